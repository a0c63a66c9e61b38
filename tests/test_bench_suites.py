"""Every benchmark is a `yggdrasil bench` suite (issue 39): one list of suites, one runner, one
way of writing results, with the provenance every result must carry (commit, command, CPU,
torch, bundle, the machine's quiet/noisy state before and after, a named statistic)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from yggdrasil.bench import provenance, suites
from yggdrasil.bench.provenance import FIELDS, Provenance, Results, invalid_values, machine_state, missing_fields
from yggdrasil.bench.run import measurement_parser
from yggdrasil.device import CpuWindow

ROOT = Path(__file__).resolve().parent.parent
# the GPU session runs from a plain checkout on the device image (bench/gpu_session.sh); the report
# suite also runs as `python -m yggdrasil.bench.report` (the README's command)
NOT_SUITES = {"gpu_session.py", "report.py"}


def test_the_command_line_offers_every_suite_of_the_table():
    from yggdrasil.cli import build_parser

    bench = next(a for a in build_parser()._actions if a.dest == "command").choices["bench"]
    offered = next(a for a in bench._actions if a.dest == "suite").choices
    assert set(offered) == set(suites.NAMES) | {"reproduce"}


@pytest.mark.parametrize("suite", suites.MEASUREMENT_SUITES, ids=lambda s: s.name)
def test_each_measurement_suite_builds_its_parser_and_has_a_run(suite):
    module, parser = measurement_parser(suite)
    assert callable(module.run) and parser.prog == f"yggdrasil bench {suite.name}"
    assert "--threads" in parser._option_string_actions  # every suite takes the CLI's --threads
    source = Path(module.__file__).read_text()
    assert "emit_json(" not in source, f"{suite.module} writes results around the shared Results.write"


def test_no_benchmark_is_a_standalone_script_or_imports_by_path():
    for path in sorted((ROOT / "bench").glob("*.py")):
        tree = ast.parse(path.read_text())
        mains = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        if path.name not in NOT_SUITES:
            assert not mains, f"bench/{path.name} runs as a script: make it a suite (bench/suites.py)"
        assert "sys.path.insert" not in path.read_text(), f"bench/{path.name} imports by path"


def test_bench_help_lists_every_suite_and_a_suite_passes_its_own_options_through():
    done = subprocess.run([sys.executable, "-m", "yggdrasil", "bench", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and all(name in done.stdout for name in suites.NAMES)
    done = subprocess.run([sys.executable, "-m", "yggdrasil", "bench", "gemm-rows", "--help"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "--in-features" in done.stdout and "yggdrasil bench gemm-rows" in done.stdout
    done = subprocess.run([sys.executable, "-m", "yggdrasil", "generate", "--prompt", "x", "--no-such-flag"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "unrecognized arguments: --no-such-flag" in done.stderr


def _window(others: float, steal: float):
    return lambda before, after: CpuWindow(others, steal, 0.5, 2)


@pytest.mark.parametrize("others, steal, verdict", [(0.0, 0.0, "quiet"), (0.9, 0.0, "noisy"), (0.0, 0.2, "noisy")])
def test_the_machine_state_says_quiet_or_noisy_and_why(monkeypatch, others, steal, verdict):
    monkeypatch.setattr(provenance, "cpu_window", _window(others, steal))
    state = machine_state(window_seconds=0.01)
    assert state["verdict"] == verdict and bool(state["reasons"]) == (verdict == "noisy")


def test_a_result_gets_every_provenance_field_and_must_name_its_statistic(tmp_path, capsys):
    results = Results(Provenance.start("yggdrasil bench kernels --tag t"))
    with pytest.raises(ValueError, match="statistic"):
        results.write({"numbers": [1]}, tmp_path / "r.json")
    written = results.write({"numbers": [1], "statistic": "best of 5"}, tmp_path / "r.json")
    assert missing_fields(written) == [] and set(FIELDS) <= set(written["provenance"])
    prov = json.loads((tmp_path / "r.json").read_text())["provenance"]
    assert prov["command"] == "yggdrasil bench kernels --tag t" and prov["commit"] and isinstance(prov["dirty"], bool)
    assert prov["cpu"]["isa_flags"] and prov["cpu"]["threads"] >= 1
    assert prov["machine_before"]["verdict"] in ("quiet", "noisy") and "load_average" in prov["machine_after"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["statistic"] == "best of 5"


def test_every_committed_result_carries_its_provenance():
    files = sorted((ROOT / "bench" / "results").rglob("*.json"))
    assert len(files) > 40
    lacking = {str(p.relative_to(ROOT)): missing_fields(json.loads(p.read_text())) for p in files}
    assert not {p: m for p, m in lacking.items() if m}, lacking
    # values, not only keys: every result not backfilled names its commit, command and verdicts
    wrong = {str(p.relative_to(ROOT)): invalid_values(json.loads(p.read_text())) for p in files}
    assert not {p: w for p, w in wrong.items() if w}, wrong
    backfilled = [p for p in files if json.loads(p.read_text())["provenance"].get("backfilled")]
    assert len(backfilled) < len(files)  # the exemption is for the old files, not all of them


def test_provenance_values_are_checked_not_only_their_keys(tmp_path):
    written = Results(Provenance.start("yggdrasil bench kernels")).write({"statistic": "best of 5"}, tmp_path / "r.json")
    assert invalid_values(written) == []
    prov = written["provenance"]
    bad = {**prov, "command": None, "commit": "5c824bd", "dirty": None,
           "machine_before": {"verdict": "not recorded"}, "cpu": {**prov["cpu"], "threads": 0}}
    wrong = invalid_values({**written, "provenance": bad})
    assert len(wrong) == 5 and "command None" in wrong[2] and "machine_before.verdict 'not recorded'" in wrong[3]
    assert missing_fields({**written, "provenance": bad}) == []  # the keys are all there: only the values fail
    assert invalid_values({**written, "provenance": {**bad, "backfilled": "2026-11-27 from the file"}}) == []


@pytest.mark.slow
def test_a_measurement_suite_on_the_tiny_bundle_records_it_and_reproduce_reruns_it(tiny_bundle, tmp_path):
    _, bundle = tiny_bundle
    out = tmp_path / "serve-graph.json"
    done = subprocess.run([sys.executable, "-m", "yggdrasil", "bench", "serve-graph", "--bundle", str(bundle),
                           "--rows", "1,2", "--context", "64", "--repeats", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert missing_fields(result) == []
    prov = result["provenance"]
    assert prov["command"].startswith("yggdrasil bench serve-graph --bundle") and prov["cpu"]["threads"] >= 1
    assert prov["bundle"]["id"] and prov["bundle"]["recipe_identity"]
    again = subprocess.run([sys.executable, "-m", "yggdrasil", "bench", "reproduce", str(out)],
                           capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "re-running:" in again.stdout and "rows[0].serve_graph_ms" in again.stdout
