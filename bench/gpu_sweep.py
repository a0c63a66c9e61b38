"""The GPU session's sweep and prediction (issue 49).

sweep: the step cost T(n), n = 1, 2, 4, ... 64 rows, of a Qwen2.5-1.5B-shaped target and a
0.5B-shaped draft (random bf16 weights; the real layer counts, widths and vocabulary), from
Inductor-compiled steps captured as CUDA graphs beside the model's eager step captured the same
way; and autoregressive time per token (T(1)) against the bandwidth floor (weight + KV bytes one
step reads, over the measured device-to-device bandwidth). To fit the session, each model's
step is compiled for one row and once with the row count dynamic for n >= 2 (Inductor calls
cuBLAS and the attention kernel for the big work either way; `graphs_compiled` says how many it
really took); each n is then captured once and replayed, timed by CUDA events (median).

predict: what the real Qwen pair would gain on this device. The latency objective (docs/design.md
§3.1) on the measured T_draft(n) and T_verify(n) with the acceptance statistics of the real pair's
calibration on a CPU (acceptance depends on the models, not on the device; the committed file is
ACCEPTANCE): the best constant tree, its predicted speed-up over plain decoding and time per
token, and the best tree per verify width. A prediction from measured step times and measured
acceptance, not a measurement of the real pair on the GPU.

    python -m yggdrasil.bench.gpu_sweep sweep --out DIR [--device cuda] [--tiny]
    python -m yggdrasil.bench.gpu_sweep acceptance CALIBRATION_DIR OUT.json   # write an acceptance file
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from yggdrasil.buckets import Grid
from yggdrasil.config import ModelConfig
from yggdrasil.storage.inductor_steps import STEP_OPTIONS, step_function
from yggdrasil.models.model import Transformer
from yggdrasil.policy.calibration import drafted_mask, load_run, mean_capped
from yggdrasil.policy.select import Selector
from yggdrasil.runtime.latency import LatencyProfile, device_timed_runs

from .gpu_measure import decode_bytes, device_bandwidth
from .provenance import Provenance, Results

ROWS = (1, 2, 4, 8, 16, 32, 64)
CONTEXT = 1024  # the cache every step attends over (a fixed span, as captured graphs replay one shape)
# the real shapes (Qwen2.5-Coder-1.5B and -0.5B's config.json); tiny stands in on a CPU dry run
SHAPES = {
    "target": dict(arch="qwen2", vocab_size=151936, dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128,
                   ffn_dim=8960, qkv_bias=True, tie_embeddings=True),
    "draft": dict(arch="qwen2", vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64,
                  ffn_dim=4864, qkv_bias=True, tie_embeddings=True),
}
TINY = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128)
# in the checkout (the installed layout the GPU session runs in leaves results out)
ACCEPTANCE = Path("bench") / "results" / "qwen-pair-acceptance-epyc-zen4-2c" / "acceptance.json"


def random_model(role: str, tiny: bool, device: str) -> Transformer:
    shape = {**SHAPES[role], **(TINY if tiny else {})}
    config = ModelConfig(norm_eps=1e-6, rope_theta=1e6, max_position=32768, **shape)
    torch.manual_seed(0)
    model = Transformer(config).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0, 1.0 if "embeddings" in name else 0.02)
            else:  # norms' weights one, biases zero
                param.fill_(0.0 if name.endswith("bias") else 1.0)
    model.setup_cache(1, CONTEXT, stacked=False)
    return model.eval()


def _inputs(rows: int, model: Transformer) -> tuple:
    device, cache = model.device, model.cache
    tokens = torch.zeros(1, rows, dtype=torch.long, device=device)
    positions = torch.arange(rows, device=device)[None] + 8
    slots = torch.full((1, rows), cache.scratch_slot, dtype=torch.long, device=device)
    mask = torch.zeros(1, rows, CONTEXT, dtype=torch.bool, device=device)
    mask[..., :8] = True
    return tokens, positions, slots, mask


def _replay_times(run, device: torch.device, repeats: int) -> float:
    """Median seconds of one call after warm-up; on CUDA the call is captured first and each
    replay timed by events (device_timed_runs), elsewhere the call itself by the wall clock."""
    if device.type != "cuda":
        return statistics.median(device_timed_runs(run, repeats, 2, device))
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):  # lazy initialisation before capture (workspaces, kernel loads)
            run()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    return statistics.median(device_timed_runs(graph.replay, repeats, 3, device))


def sweep_model(model: Transformer, rows: tuple[int, ...], repeats: int) -> dict:
    """T(n) in ms, Inductor-compiled and eager (each captured on CUDA), compile seconds and how
    many graphs Dynamo compiled (2 when every n >= 2 shared the dynamic one)."""
    from torch._dynamo.utils import counters  # imported by torch.compile already

    device, frames = model.device, counters["stats"]["unique_graphs"]
    compiled = {"one": torch.compile(step_function("sweep_one"), fullgraph=True, dynamic=False, options=STEP_OPTIONS),
                "many": torch.compile(step_function("sweep_many"), fullgraph=True, dynamic=False,
                                      options=STEP_OPTIONS)}
    inductor, eager = {}, {}
    started = time.perf_counter()
    with torch.inference_mode():
        compiled["one"](model, *_inputs(1, model), None, False)
        # the dynamic graph first at a row count no model dimension shares (2 is the KV heads'):
        # a guard from a coincidence would pin the rows; later n reuse it, or compile one of their own
        warm = _inputs(3, model)
        for tensor in warm:
            torch._dynamo.maybe_mark_dynamic(tensor, 1)
        compiled["many"](model, *warm, None, False)
        compile_seconds = time.perf_counter() - started
        for n in rows:
            args = _inputs(n, model)
            step = compiled["one" if n == 1 else "many"]
            inductor[n] = 1e3 * _replay_times(lambda: step(model, *args, None, False), device, repeats)
            eager[n] = 1e3 * _replay_times(lambda: model(*args), device, repeats)
    nbytes = decode_bytes(model, CONTEXT)
    return {"inductor_ms": inductor, "eager_ms": eager, "compile_seconds": round(compile_seconds, 1),
            "graphs_compiled": counters["stats"]["unique_graphs"] - frames,
            "weight_bytes": nbytes["weights"], "kv_bytes": nbytes["kv"]}


def run_sweep(out: Path, device: str, tiny: bool, repeats: int = 20) -> dict:
    rows = ROWS[:3] if tiny else ROWS
    dev = torch.device(device)
    result = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "tiny": tiny,
              "rows": list(rows), "context": CONTEXT, "torch": torch.__version__,
              "note": "random bf16 weights of the real shapes; Inductor steps compiled at one row and with the "
                      "row count dynamic for n >= 2; on CUDA each n captured as a CUDA graph and timed by events"}
    for role in ("target", "draft"):
        model = random_model(role, tiny, device)
        result[role] = sweep_model(model, rows, repeats)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    bandwidth = device_bandwidth(dev)
    result["bandwidth_gb_s"] = None if bandwidth is None else round(bandwidth / 1e9, 1)
    if bandwidth:
        for role in ("target", "draft"):
            part = result[role]
            part["floor_ms"] = round(1e3 * (part["weight_bytes"] + part["kv_bytes"]) / bandwidth, 4)
            part["ar_fraction_of_floor"] = round(part["floor_ms"] / part["inductor_ms"][1], 3)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(result, indent=2))
    return result


# ---- prediction ---------------------------------------------------------------------------------

def acceptance_summary(calibration: Path) -> dict:
    """What the objective needs of a calibration run, small enough to commit: the grid, mean
    tokens each (D, W, V) bucket accepted, mean min(a, D), and where it was measured."""
    run, meta, latency = load_run(calibration)
    drafted = drafted_mask(run.grid, run.drafted_depths)
    mean = run.accepted.double().mean(0).masked_fill(~drafted[:, :, None], float("nan"))
    return {"grid": {"depths": list(run.grid.depths), "widths": list(run.grid.widths),
                     "verifies": list(run.grid.verifies)},
            "mean_accepted": [[[None if v != v else round(v, 4) for v in row] for row in plane]
                              for plane in mean.tolist()],
            "mean_capped": [round(v, 4) for v in mean_capped(run).tolist()],
            "iterations": int(run.accepted.shape[0]), "generated_tokens": run.generated_tokens,
            "models": {"target": meta.get("target"), "draft": meta.get("draft")},
            "weights": meta.get("weights", "fp32"), "prompts": meta.get("prompt_sets"), "cpu": meta.get("cpu"),
            "cpu_latency": latency.as_dict()}


def predict(sweep: dict, acceptance: dict, path: str = "inductor_ms") -> dict:
    """The objective on the sweep's step times and the acceptance statistics."""
    grid = Grid(**{k: tuple(v) for k, v in acceptance["grid"].items()})
    mean = torch.tensor([[[float("nan") if v is None else v for v in row] for row in plane]
                         for plane in acceptance["mean_accepted"]], dtype=torch.double)
    costs_unknown = mean.isnan()
    mean = mean.nan_to_num(0.0)
    capped = torch.tensor(acceptance["mean_capped"], dtype=torch.double)

    def profile(times: dict) -> LatencyProfile:
        points = tuple(sorted((int(n), float(ms) / 1e3) for n, ms in times.items()))
        return LatencyProfile(draft=points, verify=points)

    gpu = LatencyProfile(draft=profile(sweep["draft"][path]).draft, verify=profile(sweep["target"][path]).verify)
    cpu = LatencyProfile.from_dict(acceptance["cpu_latency"])
    out = {"note": "a prediction from step times measured here and acceptance measured on a CPU, not a measurement "
                   "of the real pair on this device", "path": path}
    for name, latency in (("here", gpu), ("calibration_cpu", cpu)):
        selector = Selector(grid, latency, mean, capped)
        selector.costs = selector.costs.masked_fill(costs_unknown, float("inf"))  # not drafted: never chosen
        best, speedup = selector.constant()
        t1 = latency.t_verify(1)
        out[name] = {"best": str(best), "predicted_speedup_over_ar": round(speedup, 3),
                     "ar_ms": round(1e3 * t1, 4), "predicted_tpot_ms": round(1e3 * t1 / speedup, 4),
                     "aal": None if best.depth == 0 else round(1 + float(mean[_index(grid, best)]), 3),
                     "best_per_verify": {v: str(b) for v in grid.verifies if (b := selector.best_at_verify(v))}}
    return out


def _index(grid: Grid, bucket) -> tuple[int, int, int]:
    return grid.depths.index(bucket.depth), grid.widths.index(bucket.width), grid.verifies.index(bucket.verify)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sweep = sub.add_parser("sweep", help="time T(n) of the real-shape models here")
    sweep.add_argument("--out", type=Path, required=True)
    sweep.add_argument("--device", default="cuda")
    sweep.add_argument("--tiny", action="store_true", help="tiny models (a CPU dry run)")
    accept = sub.add_parser("acceptance", help="summarise a calibration directory into an acceptance file")
    accept.add_argument("calibration", type=Path)
    accept.add_argument("out", type=Path)
    accept.add_argument("--calibrated-by", required=True, help="the `yggdrasil calibrate` command that wrote it")
    args = parser.parse_args(argv)
    if args.command == "sweep":
        print(json.dumps(run_sweep(args.out, args.device, args.tiny))[:2000])
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Results(Provenance.start(None)).write(
        {**acceptance_summary(args.calibration), "calibrated_by": args.calibrated_by,
         "statistic": "mean tokens each (depth, width, verify) bucket accepted per iteration, in hindsight over every "
                      "calibration iteration (and mean min(accepted, depth)); buckets not drafted: null"}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
