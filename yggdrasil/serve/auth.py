"""API keys for a server reachable from a network (`serve --api-key`): a client sends one as
OpenAI's clients do (`Authorization: Bearer KEY`); it is compared with every key in constant
time, so neither a match nor its position shows in how long the answer takes."""

from __future__ import annotations

import hmac
import ipaddress
import os
from pathlib import Path

from yggdrasil.errors import InvalidRequestError

KEY_ENVIRONMENT = "YGGDRASIL_API_KEY"  # one key, or several separated by commas


def check_key(header: str | None, keys: tuple[str, ...]) -> str | None:
    """None when the Authorization header carries one of the keys, else why not (for the 401)."""
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return ("this server needs an API key: send it as 'Authorization: Bearer KEY' (OpenAI clients: "
                "api_key=KEY)")
    given_bytes = given.strip().encode()
    matched = False
    for key in keys:  # every key is compared, whichever matches
        matched |= hmac.compare_digest(given_bytes, key.encode())
    return None if matched else "incorrect API key provided"


def load_keys(given: list[str], key_file: str | None, environment: dict[str, str] = os.environ) -> tuple[str, ...]:
    """The keys from --api-key (repeatable), --api-key-file (one per line, # comments) and
    YGGDRASIL_API_KEY (comma-separated); empty ones are refused."""
    keys = list(given)
    if key_file:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise InvalidRequestError(f"--api-key-file {key_file}: {exc.strerror or exc}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not keys:
            raise InvalidRequestError(f"--api-key-file {key_file} holds no key (one per line)")
    keys += [k.strip() for k in environment.get(KEY_ENVIRONMENT, "").split(",") if k.strip()]
    for key in keys:
        if not key or any(c.isspace() for c in key):
            raise InvalidRequestError("an API key must be non-empty and hold no whitespace")
    return tuple(dict.fromkeys(keys))


def is_loopback(host: str) -> bool:
    """Whether a --host reaches this machine only."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
