"""Every command the docs quote exists: each `yggdrasil ...` and `python -m ...` in a code span or
code block of README.md and docs/*.md, reduced to its command and subcommand, runs with `--help`.
The commands run in-process through the CLI's own entry point (one parse per distinct command);
one runs as a subprocess, as a user types it, to check the entry point itself."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import runpy
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a command starts a span or line, or follows a shell separator, a prompt or a venv's bin/
START = r"(?:^|(?<=[\s;&|(])|(?<=/bin/))"
YGGDRASIL = re.compile(START + r"yggdrasil((?:[ \t]+[^\s;&|)`]+)*)")
PYTHON_M = re.compile(START + r"python3? -m ([\w.]+)((?:[ \t]+[^\s;&|)`]+)*)")
SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")  # inline code, at most one line break inside


def code_texts(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every code block line and every inline code span of a Markdown file."""
    out, in_block, prose = [], False, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_block = not in_block
        elif in_block:
            out.append((number, line))
        else:
            prose.append((number, line))
    text = "\n".join(line for _, line in prose)
    starts = [0]
    for _, line in prose:
        starts.append(starts[-1] + len(line) + 1)
    for match in SPAN.finditer(text):
        index = next(i for i, start in enumerate(starts) if start > match.start()) - 1
        out.append((prose[index][0], match.group(1).replace("\n", " ")))
    return out


def placeholder(word: str) -> bool:
    """A stand-in the reader replaces (COMMAND, SUITE, NAME, ...), not a name to check."""
    return word.upper() == word and any(c.isalpha() for c in word)


def quoted_commands() -> dict[tuple[str, ...], list[str]]:
    """Each distinct command ("yggdrasil", command, subcommand) or ("python -m", module), with the
    doc lines that quote it."""
    from yggdrasil.cli import build_parser

    found: dict[tuple[str, ...], list[str]] = {}
    for path in DOCS:
        for number, text in code_texts(path):
            where = f"{path.relative_to(ROOT)}:{number}: {text.strip()[:100]}"
            for match in YGGDRASIL.finditer(text):
                if text[:match.start()].rstrip().endswith("install"):  # `pip install yggdrasil`, a package
                    continue
                found.setdefault(reduce(build_parser, match.group(1).split()), []).append(where)
            for match in PYTHON_M.finditer(text):
                module = match.group(1)
                if not placeholder(module.rsplit(".", 1)[-1]):
                    found.setdefault(("python -m", module), []).append(where)
    found.pop(("yggdrasil",), None)  # the name alone, or `yggdrasil --help`: the top level, which exists
    return found


def reduce(build_parser, words: list[str]) -> tuple[str, ...]:
    """The command and, where the command has subcommands, the subcommand; placeholders and
    arguments dropped."""
    key = ["yggdrasil"]
    parser = build_parser(words[0] if words else None)
    for word in words[:2]:
        if word.startswith("-") or placeholder(word) or word.endswith(":"):  # an option, a stand-in, a label
            break
        choices = subcommands(parser)
        if choices is None:
            break
        key.append(word)
        if word not in choices:
            break
        parser = choices[word]
    return tuple(key)


def subcommands(parser) -> dict | None:
    for action in parser._actions:
        if action.choices is not None and hasattr(action, "add_parser"):
            return action.choices
    return None


def runs_with_help(key: tuple[str, ...]) -> tuple[int, str]:
    """Exit status and output of the command with --help, in this process."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            if key[0] == "python -m":
                with mock.patch.object(sys, "argv", [key[1], "--help"]):
                    runpy.run_module(key[1], run_name="__main__", alter_sys=False)
            else:
                from yggdrasil.cli import main

                return main([*key[1:], "--help"]), out.getvalue()
        except SystemExit as exc:
            return exc.code or 0, out.getvalue()
    return 0, out.getvalue()


QUOTED = quoted_commands()


def test_the_docs_quote_commands():
    """The extraction finds what the docs are known to quote (so the test below cannot pass by
    finding nothing)."""
    assert {("yggdrasil", "compile"), ("yggdrasil", "chat"), ("yggdrasil", "serve"),
            ("yggdrasil", "bench", "compare"), ("python -m", "pytest")} <= set(QUOTED)


@pytest.mark.parametrize("key", sorted(QUOTED), ids=" ".join)
def test_every_quoted_command_runs_with_help(key):
    where = "\n  ".join(QUOTED[key])
    if key == ("python -m", "pytest") or (key[0] == "python -m" and not key[1].startswith("yggdrasil")):
        assert importlib.util.find_spec(key[1]) is not None, f"no module {key[1]}, quoted at\n  {where}"
        return
    status, output = runs_with_help(key)
    assert status == 0 and "usage:" in output, (f"`{' '.join(key)} --help` does not run (exit {status}), "
                                                f"quoted at\n  {where}\n{output[-1500:]}")


def test_the_installed_command_runs_with_help():
    """One quoted command as a user runs it: the `yggdrasil` entry point, in a fresh process."""
    key = ("yggdrasil", "compile")
    assert key in QUOTED
    script = Path(sys.executable).with_name("yggdrasil")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "yggdrasil"]
    run = subprocess.run([*command, *key[1:], "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "usage: yggdrasil compile" in run.stdout, run.stderr[-2000:]


@pytest.mark.parametrize("key", [("yggdrasil", "no-such-command"), ("yggdrasil", "bench", "no-such-suite"),
                                 ("python -m", "yggdrasil.no_such_module")], ids=" ".join)
def test_a_command_that_does_not_exist_fails_the_check(key):
    with pytest.raises((ImportError, AssertionError)) if key[0] == "python -m" else contextlib.nullcontext():
        status, _ = runs_with_help(key)
        assert status != 0
