"""`yggdrasil bench reproduce RESULT.json`: the command a result records runs again from where it
ran, writing into a scratch folder instead of its --out, and the recorded and new numbers are
printed side by side; a result from another machine is refused unless asked for."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from yggdrasil.bench.common import environment
from yggdrasil.bench.reproduce import ReproduceError, numbers, plan_rerun, reproduce, side_by_side

# a stand-in benchmark: writes {"tpot_ms": ..., "rows": [...]} to --out
SCRIPT = ("import json, sys; out = sys.argv[sys.argv.index('--out') + 1]; "
          "json.dump({'tpot_ms': 2.5, 'rows': [{'speedup': 1.5, 'name': 'egt'}], 'ok': True}, open(out, 'w'))")


def _result(tmp_path, **env_changes) -> tuple:
    here = environment()
    command = shlex.join([sys.executable, "-c", SCRIPT, "--out", "results/run.json"])
    recorded = {"environment": {**here, "command": command, "cwd": str(tmp_path), **env_changes},
                "tpot_ms": 2.0, "rows": [{"speedup": 1.25, "name": "egt"}], "ok": True}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(recorded))
    return path, recorded


def test_it_reruns_the_recorded_command_and_prints_both_numbers(tmp_path):
    path, _ = _result(tmp_path)
    printed: list[str] = []
    assert reproduce(path, report=printed.append) == 0
    table = "\n".join(printed)
    assert "re-running:" in table and "--out" in table and "results/run.json" not in table.split("re-running:")[1].split("\n")[0]
    row = next(line for line in printed if line.startswith("tpot_ms"))
    assert row.split()[1:] == ["2", "2.5", "1.250"]
    assert any(line.startswith("rows[0].speedup") for line in printed)
    assert not (tmp_path / "results").exists()  # the recorded --out is left alone


def test_a_result_from_another_machine_is_refused_unless_asked(tmp_path):
    path, _ = _result(tmp_path, cpu="Some Other CPU", torch_threads=64)
    with pytest.raises(ReproduceError, match="another machine.*CPU 'Some Other CPU' there.*--other-machine"):
        reproduce(path, report=lambda line: None)
    printed: list[str] = []
    assert reproduce(path, other_machine=True, report=printed.append) == 0
    assert any(line.startswith("ACROSS MACHINES") for line in printed)


def test_what_it_cannot_rerun_says_what_to_do(tmp_path):
    with pytest.raises(ReproduceError, match="does not record the command"):
        plan_rerun({"environment": {"cpu": "x"}}, tmp_path)
    command = shlex.join(["python", "-m", "yggdrasil", "bench", "compare", "--bundle", "gone/bundle", "--out", "o"])
    with pytest.raises(ReproduceError, match="gone/bundle, is not here; pass --bundle DIR"):
        plan_rerun({"environment": {"command": command, "cwd": str(tmp_path)}}, tmp_path)
    (tmp_path / "copy").mkdir()
    rerun = plan_rerun({"environment": {"command": command, "cwd": str(tmp_path)}}, tmp_path / "s", tmp_path / "copy")
    assert rerun.argv[0] == sys.executable and rerun.argv[rerun.argv.index("--bundle") + 1] == str(tmp_path / "copy")
    assert rerun.argv[rerun.argv.index("--out") + 1] == str(tmp_path / "s")


def test_numbers_leave_provenance_and_flags_out():
    found = numbers({"environment": {"cores": 2}, "a": {"b": [1, {"c": 2.5}]}, "ok": True, "name": "x"})
    assert found == {"a.b[0]": 1.0, "a.b[1].c": 2.5}
    assert "share no numbers" in side_by_side({"a": 1}, {"b": 2})[-1]


def test_the_cli_runs_it(tmp_path):
    path, _ = _result(tmp_path)
    done = subprocess.run([sys.executable, "-m", "yggdrasil", "bench", "reproduce", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "tpot_ms" in done.stdout, done.stdout + done.stderr
    done = subprocess.run([sys.executable, "-m", "yggdrasil", "bench", "compare"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and "required: --bundle" in done.stderr and "Traceback" not in done.stderr


def test_a_missing_bundle_is_rebuilt_from_the_recorded_recipe_when_asked(tmp_path, monkeypatch):
    """--rebuild: the bundle the command names is gone, so its recipe is compiled into the scratch
    folder and the command runs on that (compile itself is replaced here: tests elsewhere compile)."""
    from yggdrasil.bench import reproduce as module

    recipe = tmp_path / "pair.yaml"
    recipe.write_text("name: pair\n")
    script = ("import json, sys; a = sys.argv; b = a[a.index('--bundle') + 1]; "
              "json.dump({'tpot_ms': 3.0, 'bundle_seen': b}, open(a[a.index('--out') + 1], 'w'))")
    command = shlex.join([sys.executable, "-c", script, "--bundle", "gone/bundle", "--out", "results/run.json"])
    here = environment()
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"environment": {**here, "command": command, "cwd": str(tmp_path)}, "tpot_ms": 2.0,
                                "bundle": {"recipe": "pair", "recipe_source": str(recipe)}}))
    with pytest.raises(ReproduceError, match="--rebuild"):
        reproduce(path, report=lambda line: None)
    built = []

    def fake_rebuild(recipe_path, dest, report=print):
        built.append(recipe_path)
        dest.mkdir(parents=True)
        return dest

    monkeypatch.setattr(module, "rebuild_bundle", fake_rebuild)
    printed: list[str] = []
    assert reproduce(path, report=printed.append, rebuild=True) == 0
    assert built == [recipe]
    assert any(line.startswith("tpot_ms") and line.split()[1:] == ["2", "3", "1.500"] for line in printed), printed
