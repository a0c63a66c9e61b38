"""Reading and writing the predictor's file pairs (a YAML description + a safetensors array file).

Writes go through a temporary name and a rename, so an interrupted run never leaves a
half-written file under the real name; reads check the schema and say what to re-run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from safetensors.torch import load_file

from yggdrasil.errors import YggdrasilError
from yggdrasil.yaml_files import parse_yaml


class PredictorError(YggdrasilError):
    """Too little calibration data, or a calibration/predictor file that is malformed or for
    another model."""


def atomic_write(path: Path, write: Callable[[Path], Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    tmp.replace(path)


def read_pair(directory: Path, stem: str, schema: str, missing: str, unreadable: str,
              rebuild: str) -> tuple[dict, dict]:
    """(YAML mapping, tensors) of `stem`.yaml / `stem`.safetensors in `directory`.

    missing / unreadable start the error messages ("<missing> (x is missing)", "<unreadable> (why)").
    """
    try:
        meta = parse_yaml((directory / f"{stem}.yaml").read_text())
        arrays = load_file(str(directory / f"{stem}.safetensors"))
    except FileNotFoundError as exc:
        raise PredictorError(f"{missing} ({Path(exc.filename).name} is missing); {rebuild}") from None
    except Exception as exc:  # malformed YAML or safetensors
        raise PredictorError(f"{unreadable} ({exc}); {rebuild}") from None
    if not isinstance(meta, dict) or meta.get("schema") != schema:
        found = meta.get("schema") if isinstance(meta, dict) else None
        raise PredictorError(f"{directory}/{stem}.yaml: expected schema {schema}, found {found!r}; {rebuild}")
    return meta, arrays
