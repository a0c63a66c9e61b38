"""--trace: a Chrome trace (JSON) with one span per stage per iteration and one per model forward."""

from __future__ import annotations

import json
from collections import Counter

import torch

from helpers import save_random_hf_model, save_tiny_pair

from yggdrasil.cli import main
from yggdrasil.runtime.drafters import ModelDrafter
from yggdrasil.models.hf_loader import load_hf_model
from yggdrasil.sampling import SamplingParams
from yggdrasil.runtime.speculative import SpeculativeGenerator
from yggdrasil.runtime.steps import StepRunner
from yggdrasil.trace import NO_TRACE, Tracer, tracing

STAGES = ("draft", "prune", "verify", "accept", "compact")


def _check_chrome_format(body: dict) -> list[dict]:
    assert isinstance(body["traceEvents"], list)
    spans = [e for e in body["traceEvents"] if e["ph"] == "X"]
    for event in spans:
        assert isinstance(event["name"], str) and isinstance(event["pid"], int) and isinstance(event["tid"], int)
        assert event["ts"] >= 0 and event["dur"] >= 0
    lanes = {e["args"]["name"] for e in body["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"iteration", "target", "draft"} <= lanes
    return spans


def test_trace_has_one_span_per_stage_per_iteration(tmp_path):
    save_tiny_pair(tmp_path)
    target = StepRunner(load_hf_model(tmp_path / "tiny-random", torch.float32), 256, 16)
    draft = StepRunner(load_hf_model(tmp_path / "tiny-draft", torch.float32), 256, 16)
    speculator = SpeculativeGenerator(target, ModelDrafter(draft, 3, 2), verify_widths=(4,), profile=None)
    tracer = Tracer()
    with tracing(tracer, target, speculator):
        result = speculator.generate(list(range(10, 30)), 20, SamplingParams())
    assert target.tracer is NO_TRACE and draft.tracer is NO_TRACE  # tracing ends with the call
    spans = _check_chrome_format(json.loads(json.dumps(tracer.to_json())))
    stages = [e for e in spans if e["cat"] == "iteration" and e["name"] != "prefill"]
    per_iteration = Counter((e["args"]["iteration"], e["name"]) for e in stages)
    iterations = result.spec.iterations
    assert set(per_iteration) == {(i, s) for i in range(iterations) for s in STAGES}
    assert set(per_iteration.values()) == {1}
    # every verify stage wraps exactly one target forward, and drafting ran draft forwards
    forwards = Counter(e["name"].split("_w")[0] for e in spans if e["cat"] == "target")
    assert forwards["verify"] == iterations
    assert sum(1 for e in spans if e["cat"] == "draft") >= iterations
    # untraced generation is unaffected and gives the same tokens
    again = speculator.generate(list(range(10, 30)), 20, SamplingParams())
    assert again.tokens == result.tokens and len(tracer.events) == len(spans)


def test_generate_trace_flag_writes_the_file(tmp_path, capsys):
    model_dir = tmp_path / "m"
    save_random_hf_model(model_dir, "llama")
    out = tmp_path / "trace.json"
    assert main(["generate", "--model", str(model_dir), "--prompt", "hello trees", "--max-new-tokens", "6",
                 "--spec", "egt", "--draft", str(model_dir), "--depth", "2", "--width", "2",
                 "--trace", str(out)]) == 0
    spans = _check_chrome_format(json.loads(out.read_text()))
    assert any(e["name"] == "verify" for e in spans)
    assert f"written to {out}" in capsys.readouterr().err
    assert main(["generate", "--model", str(model_dir), "--prompt", "x", "--trace",
                 str(tmp_path / "missing" / "t.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
