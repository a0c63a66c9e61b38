"""`yggdrasil chat`: the real CLI over a tiny bundle (scripted stdin and a pseudo-terminal), and
the session's KV reuse against fresh generation."""

from __future__ import annotations

from dataclasses import replace

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
import torch

from helpers import write_tiny_chat_recipe_dir, write_tiny_recipe_dir

from yggdrasil.chat import ChatSession, ChatSettings, common_prefix
from yggdrasil.errors import InvalidRequestError
from yggdrasil.runtime.generate import generate
from yggdrasil.models.loader import load
from yggdrasil.sampling import SamplingParams
from yggdrasil.runtime.steps import StepRunner
from yggdrasil.models.tokenizer import Message

CONTEXT = 2048  # long enough for a reply a person can interrupt


@pytest.fixture(scope="module")
def chat_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-chat")
    return root, write_tiny_chat_recipe_dir(root, "tiny-chat-cpu", CONTEXT)


@pytest.fixture(scope="module")
def chat_bundle(chat_models):
    from yggdrasil.compile.build import build_bundle
    from yggdrasil.compile.recipe import load_recipe

    root, recipe_path = chat_models
    raw = yaml.safe_load(recipe_path.read_text())  # chat never runs the server's graphs
    recipe_path.write_text(yaml.safe_dump({**raw, "serve_graphs": False}))
    build_bundle(load_recipe(recipe_path), root / "bundle", log=lambda _: None)
    return root, root / "bundle"


class Reference:
    """Plain eager greedy decoding of each turn from scratch: what every reply must equal."""

    def __init__(self, model_dir: Path) -> None:
        loaded = load(str(model_dir), dtype=torch.float32, quiet=True)
        self.tokenizer, self.runner = loaded.tokenizer, StepRunner(loaded.model, CONTEXT, 64)

    def reply(self, turns: list[tuple[str, str]], user: str, max_new_tokens: int,
              system: str | None = None) -> str:
        messages = [Message("system", system)] if system else []
        for asked, answered in turns:
            messages += [Message("user", asked), Message("assistant", answered)]
        ids = self.tokenizer.encode_chat(messages + [Message("user", user)])
        with torch.inference_mode():
            out = generate(self.runner, ids, max_new_tokens, SamplingParams(), self.tokenizer.stop_ids)
        return self.tokenizer.decode(out.tokens)

    def conversation(self, users: list[str], max_new_tokens: int) -> list[str]:
        turns = []
        for user in users:
            turns.append((user, self.reply(turns, user, max_new_tokens)))
        return [answer for _, answer in turns]


def _chat(bundle: Path, stdin: str, *flags: str) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-m", "yggdrasil.cli", "chat", str(bundle), *flags],
                         input=stdin, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def _words(start: int, count: int) -> str:
    return " ".join(f"w{5 + (start + 11 * k) % 250}" for k in range(count))


@pytest.mark.slow
def test_scripted_conversation_equals_greedy_and_reuses_the_cache(chat_bundle):
    root, bundle = chat_bundle
    users = [_words(1, 6), _words(40, 9), _words(90, 4)]
    run = _chat(bundle, "\n".join([users[0], users[1], "/stats", users[2], "/stats"]) + "\n",
                "--max-new-tokens", "24")
    reference = Reference(root / "tiny-random")
    expected = reference.conversation(users, 24)
    assert run.stdout == "".join(reply + "\n" for reply in expected)
    assert "ready in" in run.stderr and "0 compilations" in run.stderr
    # turn 2 prefills only what turn 2 added: the prompt minus turn 1's prompt and reply
    prompt, prefilled = map(int, re.findall(r"last reply: .*?prompt (\d+) tokens, prefilled (\d+)", run.stderr)[0])
    tok = reference.tokenizer
    turn1_prompt = tok.encode_chat([Message("user", users[0])])
    turn1_reply = tok.encode(expected[0], add_special_tokens=False)
    assert prompt == len(tok.encode_chat([Message("user", users[0]), Message("assistant", expected[0]),
                                          Message("user", users[1])]))
    assert 1 <= prefilled <= prompt - len(turn1_prompt) - len(turn1_reply) + 1
    assert "session: 3 replies" in run.stderr
    # whether the plan speculates depends on this machine's measured costs; /stats says which
    assert "AAL" in run.stderr or "plain decoding: this bundle's plan does not speculate" in run.stderr


@pytest.mark.slow
def test_bad_input_gets_a_message_and_the_session_goes_on(chat_bundle):
    root, bundle = chat_bundle
    too_long = _words(3, CONTEXT)
    script = ["", "/frobnicate", "/temp abc", "/temp -1", "/temp nan", too_long, "/temp", _words(7, 5), "/exit",
              _words(9, 5)]
    run = _chat(bundle, "\n".join(script) + "\n", "--max-new-tokens", "10")
    assert "error: empty message" in run.stderr
    assert "unknown command /frobnicate; /help lists the commands" in run.stderr
    assert run.stderr.count("error: /temp needs a number >= 0") == 3
    assert re.search(r"error: this message makes a \d+-token prompt, but the 2048-token context", run.stderr)
    assert "temperature 0 (greedy)" in run.stderr  # the bad values changed nothing
    # one reply: to the message after the errors; nothing after /exit
    assert run.stdout == Reference(root / "tiny-random").reply([], _words(7, 5), 10) + "\n"


@pytest.mark.slow
def test_context_overflow_drops_the_oldest_turns_and_stays_exact(chat_bundle):
    root, bundle = chat_bundle
    users = [_words(k * 13, 600) for k in range(4)]  # three fit in 2048 tokens, four do not
    run = _chat(bundle, "\n".join(users) + "\n", "--max-new-tokens", "8")
    assert "[context full: dropped the oldest" in run.stderr
    dropped = int(re.search(r"dropped the oldest (\d+) turn", run.stderr).group(1))
    reference = Reference(root / "tiny-random")
    replies = run.stdout.splitlines()
    assert replies[:3] == reference.conversation(users[:3], 8)
    kept = list(zip(users[dropped:3], replies[dropped:3]))
    assert replies[3] == reference.reply(kept, users[3], 8)


def _read_until(fd: int, pattern: str, timeout: float = 120.0) -> str:
    """Read the pseudo-terminal until `pattern` (a regex) appears in what was read."""
    seen, deadline = "", time.monotonic() + timeout
    while not re.search(pattern, seen):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"timed out waiting for {pattern!r}; got {seen[-2000:]!r}")
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            try:
                seen += os.read(fd, 4096).decode(errors="replace")
            except OSError:  # the child closed the terminal
                raise AssertionError(f"chat exited while waiting for {pattern!r}; got {seen[-2000:]!r}")
    return seen


@pytest.mark.slow
def _end_child(pid: int, fd: int) -> None:
    """Kill the pty's chat process if it is still there and close the terminal."""
    try:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    os.close(fd)


def test_terminal_streams_and_ctrl_c_stops_the_reply(chat_bundle):
    import pty

    _, bundle = chat_bundle
    pid, fd = pty.fork()
    if pid == 0:  # the child: the chat CLI on this pseudo-terminal
        # a runner started in the background (nohup, `cmd &`) ignores SIGINT, and an ignored
        # signal stays ignored across exec: Python would then never raise KeyboardInterrupt.
        # A user's terminal delivers Ctrl-C, so the child gets the default disposition back
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execv(sys.executable, [sys.executable, "-m", "yggdrasil.cli", "chat", str(bundle),
                                  "--max-new-tokens", "1800"])
    try:
        _read_until(fd, r"ready in .*\n> ")
        message = _words(2, 5)
        os.write(fd, (message + "\n").encode())
        # reply text arrives while it is generated: a few words, then Ctrl-C stops the rest
        streamed = _read_until(fd, re.escape(message) + r"\r?\n(w\d+ ){3}")
        os.write(fd, b"\x03")
        text = streamed + _read_until(fd, r"\[stopped\]\s*\r?\n> ")
        reply = text[text.index(message) + len(message):text.index("[stopped]")]
        assert 3 <= len(re.findall(r"w\d+", reply)) < 1800  # streamed, then stopped early
        os.write(fd, (_words(4, 3) + "\n").encode())  # the next turn still works
        _read_until(fd, re.escape(_words(4, 3)) + r"\r?\n(w\d+ )+[\s\S]*\n> ")
        os.write(fd, b"/stats\n")
        # wait for the prompt: readline discards input typed before it takes the terminal, so a
        # Ctrl-D sent earlier is lost and the child waits for input forever
        assert "session: 1 replies" in _read_until(fd, r"session: \d+ replies[\s\S]*\n> ")
        os.write(fd, b"\x04")  # Ctrl-D quits
        status = _wait_exit(pid, 60.0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        _end_child(pid, fd)


def _wait_exit(pid: int, timeout: float) -> int:
    """The child's wait status, failing (not hanging) if it has not exited within timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.1)
    raise AssertionError(f"chat did not exit within {timeout:.0f} s of Ctrl-D")


def test_terminal_line_editing_and_history(chat_bundle):
    """On a terminal, input goes through readline: a left arrow moves the cursor (it used to
    print ^[[D into the message) and the up arrow brings back the previous line."""
    import pty

    _, bundle = chat_bundle
    pid, fd = pty.fork()
    if pid == 0:
        os.environ.setdefault("TERM", "xterm")  # what a terminal emulator sets
        os.execv(sys.executable, [sys.executable, "-m", "yggdrasil.cli", "chat", str(bundle)])
    try:
        seen = _read_until(fd, r"ready in .*\n> ")
        os.write(fd, b"/system ab\x1b[DX\n")  # type "ab", one left, "X": the message is "aXb"
        seen += _read_until(fd, r"system message set.*\n> ", timeout=60)
        os.write(fd, b"/system\n")
        seen += _read_until(fd, r"system message: 'aXb'.*\n> ", timeout=60)
        os.write(fd, b"\x1b[A\n")  # up, Enter: "/system" again, from the session's history
        seen += _read_until(fd, r"system message: 'aXb'.*\n> ", timeout=60)
        os.write(fd, b"\x1b[A\x1b[A\x1b[A\n")  # three up: "/system aXb" (editing kept), set again
        seen += _read_until(fd, r"system message set.*\n> ", timeout=60)
        assert "^[[" not in seen and "unknown command" not in seen
        os.write(fd, b"\x04")
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
    finally:
        _end_child(pid, fd)


# --- the session on eager models: reuse never changes a reply ---------------------------------

@pytest.fixture(scope="module")
def eager_runtime(chat_models):
    """A runtime-shaped object over the eager tiny pair with a fixed speculation policy."""
    from yggdrasil.runtime.drafters import ModelDrafter
    from yggdrasil.runtime.speculative import SpeculativeGenerator

    root, _ = chat_models
    target = load(str(root / "tiny-random"), dtype=torch.float32, quiet=True)
    draft = load(str(root / "tiny-draft"), dtype=torch.float32, quiet=True)
    runner, draft_runner = StepRunner(target.model, CONTEXT, 64), StepRunner(draft.model, CONTEXT, 64)
    drafter = ModelDrafter(draft_runner, 3, 2)
    speculator = SpeculativeGenerator(runner, drafter, verify_widths=(4,), profile=None)
    return SimpleNamespace(target=target, runner=runner, speculator=lambda: speculator)


def test_session_reuse_and_interruption_keep_replies_exact(eager_runtime, chat_models):
    root, _ = chat_models
    reference = Reference(root / "tiny-random")
    session = ChatSession(eager_runtime, ChatSettings(max_new_tokens=16))
    users = [_words(5, 4), _words(50, 7), _words(100, 3)]
    first = session.send(users[0])
    assert first.stats.prefilled_tokens == first.stats.prompt_tokens  # nothing cached yet
    assert first.text == reference.reply([], users[0], 16)

    class Stop(KeyboardInterrupt):
        pass

    def interrupt(text):  # Ctrl-C after the first streamed text of turn 2
        raise Stop

    with pytest.raises(Stop):
        session.send(users[1], on_text=interrupt)
    partial = session.turns[-1][1]
    third = session.send(users[2])
    assert third.text == reference.reply([(users[0], first.text), (users[1], partial)], users[2], 16)
    assert third.stats.prefilled_tokens < third.stats.prompt_tokens  # the cache was reused
    assert session.totals.turns == 2


def test_session_refuses_empty_and_oversized_messages_unchanged(eager_runtime):
    session = ChatSession(eager_runtime, ChatSettings(max_new_tokens=8))
    with pytest.raises(InvalidRequestError, match="empty message"):
        session.send("   ")
    with pytest.raises(InvalidRequestError, match="shorten the message"):
        session.send(_words(0, CONTEXT))
    assert session.turns == [] and session.cached_ids == []
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2


def test_default_bundle_is_reused_when_current_and_compiled_when_missing(chat_bundle, tmp_path, monkeypatch):
    import yggdrasil.cli.chat as chat_cmd
    import yggdrasil.cli.compile as bundle_cmd
    import yggdrasil.compile.build as build

    root, bundle = chat_bundle
    monkeypatch.setattr(chat_cmd, "shipped_recipe", lambda name: root / "tiny.yaml")
    compiled = []
    monkeypatch.setattr(build, "build_bundle", lambda recipe, out, log: compiled.append(out))
    monkeypatch.setattr(bundle_cmd, "default_bundle_dir", lambda name: bundle)
    assert chat_cmd.default_bundle(log=lambda _: None) == bundle and compiled == []
    monkeypatch.setattr(bundle_cmd, "default_bundle_dir", lambda name: tmp_path / name)
    notes = []
    assert chat_cmd.default_bundle(log=notes.append) == tmp_path / "tiny-chat-cpu"
    assert compiled == [tmp_path / "tiny-chat-cpu"] and "compiling" in notes[0]


def test_a_bare_chat_says_what_it_will_compile_and_how_long_before_it_starts(tmp_path, monkeypatch):
    import yggdrasil.cli.chat as chat_cmd
    import yggdrasil.cli.compile as bundle_cmd
    import yggdrasil.compile.build as build
    from yggdrasil.compile.recipe import load_recipe

    recipe_path = write_tiny_recipe_dir(tmp_path)  # one prompt set: the tiny jsonl next to it
    recipe = load_recipe(recipe_path)
    monkeypatch.setattr(chat_cmd, "shipped_recipe", lambda name: recipe_path)
    monkeypatch.setattr(bundle_cmd, "default_bundle_dir", lambda name: tmp_path / "out")
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    events = []
    monkeypatch.setattr(build, "build_bundle", lambda recipe, out, log: events.append("compile"))
    chat_cmd.default_bundle(log=events.append)
    graphs, prompts = chat_cmd.compile_work(recipe)
    assert prompts == len(recipe.calibration.prompts) * recipe.calibration.num_prompts
    assert graphs >= 3  # at least prefill, decode and serve
    assert events[-1] == "compile"  # said before compiling, not after
    note = events[0]
    assert "compiling" in note and f"calibrates on {prompts} prompts" in note
    assert f"up to {graphs} graphs" in note and "no measured time for this recipe" in note
    assert "busy" not in note

    from yggdrasil.compile.recipe import MeasuredCompile

    measured = MeasuredCompile("a 2-core test CPU", (("formats", 60.0), ("graphs", 125.0)))
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    note = chat_cmd.compile_announcement(replace(recipe, measured_cold_compile=measured), tmp_path / "out")
    assert "expect about 3m05s (measured cold on a 2-core test CPU)" in note
    assert "busy (load 9.0 on 2 cores)" in note


def test_a_bare_chat_without_the_prompt_sets_fails_before_compiling(tmp_path, monkeypatch):
    import yggdrasil.cli.chat as chat_cmd
    import yggdrasil.cli.compile as bundle_cmd
    import yggdrasil.compile.build as build
    from yggdrasil.predictor import prompts

    recipe_path = write_tiny_recipe_dir(tmp_path)
    text = recipe_path.read_text()
    recipe_path.write_text(text.replace("tiny-prompts.jsonl", "humaneval"))
    monkeypatch.setattr(chat_cmd, "shipped_recipe", lambda name: recipe_path)
    monkeypatch.setattr(bundle_cmd, "default_bundle_dir", lambda name: tmp_path / "out")
    monkeypatch.setattr(prompts.importlib.util, "find_spec", lambda name: None)  # nothing installed
    compiled = []
    monkeypatch.setattr(build, "build_bundle", lambda recipe, out, log: compiled.append(out))
    with pytest.raises(InvalidRequestError, match="requirements/datasets.txt"):
        chat_cmd.default_bundle(log=lambda _: None)
    assert compiled == []


def test_shipped_recipes_are_installed_with_the_package():
    from yggdrasil.cli.chat import DEFAULT_RECIPES, shipped_recipe
    from yggdrasil.compile.recipe import load_recipe

    for name in DEFAULT_RECIPES.values():
        assert load_recipe(shipped_recipe(name)).name == name
