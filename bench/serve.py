"""Serving benchmark (issue 8): a load generator over loopback against `yggdrasil serve`, at
request rates from low to saturation, for no speculation, fixed speculation and goodput-based
speculation, side by side in one run.

    yggdrasil bench serve --bundle DIR [--rates 0.25,0.5,1,2] [--requests 12] [--max-tokens 48]
                          [--fixed 4] [--max-batch 4] [--prompts sharegpt|mtbench] [--eager-too]
                          [--out FILE.json]

Every server runs the bundle's compiled serve graphs; --eager-too adds a goodput server on eager
forwards (`serve --eager`), to measure what the compiled graphs are worth under load.

One server process per mode is started (each its own `yggdrasil serve`), all before the first
measurement; then for every rate the modes run one after another (rotating which goes first), so
drift on a shared machine hits all alike. Requests arrive as a Poisson process (seeded) with chat
prompts from ShareGPT or MT-Bench, stream their replies greedily, and are timed by the client:
time to first token, per-request time per output token, throughput. Prints a table, writes a
PNG next to --out, ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from yggdrasil.predictor import prompts as sets

from .common import environment, fmt, format_table, log
from .provenance import Results
from . import plots

EAGER = "+eager"  # a mode name's suffix: the server runs eager forwards


def start_server(bundle: str, port: int, mode: str, max_batch: int, max_queue: int) -> subprocess.Popen:
    """mode: off | fixed:K | goodput, optionally with EAGER appended."""
    return subprocess.Popen([sys.executable, "-m", "yggdrasil.cli", "serve", bundle, "--port", str(port),
                             "--speculation", mode.removesuffix(EAGER), "--max-batch", str(max_batch),
                             "--max-queue", str(max_queue), "--log-level", "warning"]
                            + (["--eager"] if mode.endswith(EAGER) else []),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_ready(process: subprocess.Popen, port: int, timeout: float = 180) -> str:
    # an optional dependency (the test extra): only the serve bench's client needs it
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server on port {port} exited: {process.stderr.read()}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        except (httpx.TransportError, KeyError, ValueError):
            time.sleep(0.3)
    raise SystemExit(f"server on port {port} did not start within {timeout:.0f} s")


async def one_request(client, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    stamps, text, status, tokens = [], [], None, 0
    async with client.stream("POST", url, json=body) as response:
        status = response.status_code
        if status != 200:
            await response.aread()
            return {"status": status}
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            piece = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if piece:
                stamps.append(time.perf_counter())
                text.append(piece)
    return {"status": status, "sent": sent, "stamps": stamps, "text": "".join(text), "tokens": tokens}


async def run_load(port: int, model: str, prompts: list[str], rate: float, max_tokens: int, seed: int) -> dict:
    # an optional dependency (the test extra): only the serve bench's client needs it
    import httpx

    rng = random.Random(seed)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one_request(client, url, model, prompt, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        makespan = time.perf_counter() - started
    return summarize(results, makespan)


def summarize(results: list[dict], makespan: float) -> dict:
    ok = [r for r in results if r["status"] == 200 and r["stamps"]]
    ttft = [r["stamps"][0] - r["sent"] for r in ok]
    # a chunk may carry several tokens (a verify accepts a few at once): time over tokens
    tpot = [(r["stamps"][-1] - r["stamps"][0]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in ok)

    def pct(values, q):
        return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else (values[0] if values else None)

    return {"requests": len(results), "ok": len(ok), "rejected": sum(r["status"] == 429 for r in results),
            "makespan_s": round(makespan, 2), "tokens_per_s": round(tokens / makespan, 2),
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "tpot_p50_ms": pct(tpot, 50) and pct(tpot, 50) * 1e3, "tpot_p99_ms": pct(tpot, 99) and pct(tpot, 99) * 1e3,
            "texts": [r.get("text") for r in results]}


def metric(port: int, name: str) -> float:
    # an optional dependency (the test extra): only the serve bench's client needs it
    import httpx

    for line in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def load_prompts(name: str, n: int, seed: int) -> list[str]:
    texts = [p.text for p in (sets.sharegpt() if name == "sharegpt" else sets.mtbench())]
    texts = [t for t in texts if 20 <= len(t) <= 1500]  # keep prompts inside a small context
    random.Random(seed).shuffle(texts)
    return texts[:n]


def plot(rows: list[dict], path: Path) -> None:
    plt = plots.pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        rates = [r["rate"] for r in mine]
        axes[0].plot(rates, [r["tokens_per_s"] for r in mine], "o-", label=mode)
        axes[1].plot(rates, [r["tpot_p50_ms"] for r in mine], "o-", label=mode)
        axes[2].plot(rates, [r["ttft_p50_s"] for r in mine], "o-", label=mode)
    for ax, title in zip(axes, ("throughput (tokens/s)", "p50 time per output token (ms)",
                                "p50 time to first token (s)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].legend()
    plots.save(fig, path, dpi=110)
    log(f"wrote {path}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--rates", default="0.25,0.5,1,2", help="requests per second, comma-separated")
    parser.add_argument("--requests", type=int, default=12, help="requests per rate and mode (default 12)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--fixed", type=int, default=4, help="k of the fixed-speculation mode (default 4)")
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--prompts", default="sharegpt", choices=("sharegpt", "mtbench"))
    parser.add_argument("--port", type=int, default=18300, help="first port (one per mode)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eager-too", action="store_true",
                        help="also run goodput on eager forwards (serve --eager) beside the compiled graphs")
    parser.add_argument("--out", default=None, help="JSON result file (the PNG goes next to it)")


def run(args: argparse.Namespace, record: Results) -> int | None:
    modes = ["off", f"fixed:{args.fixed}", "goodput"] + (["goodput" + EAGER] if args.eager_too else [])
    rates = [float(r) for r in args.rates.split(",")]
    prompts = load_prompts(args.prompts, args.requests, args.seed)
    servers = {mode: (start_server(args.bundle, args.port + i, mode, args.max_batch, 4 * args.requests),
                      args.port + i) for i, mode in enumerate(modes)}
    rows, invalid = [], []
    try:
        names = {mode: wait_ready(proc, port) for mode, (proc, port) in servers.items()}
        log(f"{len(modes)} servers ready; {len(prompts)} {args.prompts} prompts per rate")
        for i, rate in enumerate(rates):
            order = modes[i % len(modes):] + modes[:i % len(modes)]
            for mode in order:
                port = servers[mode][1]
                proposed0, steps0 = metric(port, "yggdrasil_proposed_tokens_total"), metric(port, "yggdrasil_steps_total")
                result = asyncio.run(run_load(port, names[mode], prompts, rate, args.max_tokens, args.seed + i))
                result.update(mode=mode, rate=rate,
                              proposed_per_step=round((metric(port, "yggdrasil_proposed_tokens_total") - proposed0)
                                                      / max(metric(port, "yggdrasil_steps_total") - steps0, 1), 3))
                log(f"rate {rate:g}/s {mode}: {result['tokens_per_s']} tok/s, TPOT p50 {result['tpot_p50_ms'] or float('nan'):.1f} ms")
                rows.append(result)
        for rate in rates:  # greedy: every mode must give the same replies
            texts = [r["texts"] for r in rows if r["rate"] == rate]
            if any(t != texts[0] for t in texts):
                invalid.append(rate)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)

    table = format_table(
        ["rate/s", "mode", "ok", "tok/s", "TPOT p50 ms", "TPOT p99 ms", "TTFT p50 s", "TTFT p99 s", "k/step"],
        [[f"{r['rate']:g}", r["mode"], r["ok"], fmt(r["tokens_per_s"], 2), fmt(r["tpot_p50_ms"], 1),
          fmt(r["tpot_p99_ms"], 1), fmt(r["ttft_p50_s"], 2), fmt(r["ttft_p99_s"], 2), fmt(r["proposed_per_step"], 2)]
         for r in rows])
    print(table)
    if invalid:
        print(f"INVALID: replies differ between modes at rates {invalid}")
    def row(rate, mode):
        return next(r for r in rows if r["rate"] == rate and r["mode"] == mode)

    goodput_ok = all(row(rate, "goodput")["tokens_per_s"]
                     >= 0.95 * max(row(rate, mode)["tokens_per_s"] for mode in modes[:2]) for rate in rates)
    print(f"goodput within 5 % of the better of off/fixed at every rate: {goodput_ok}")
    compiled_speedup = None
    if args.eager_too:  # throughput of the compiled graphs over eager forwards, per rate
        compiled_speedup = {f"{rate:g}": round(row(rate, "goodput")["tokens_per_s"]
                                               / row(rate, "goodput" + EAGER)["tokens_per_s"], 3) for rate in rates}
        print("compiled serve graphs over eager (goodput, tok/s): "
              + ", ".join(f"{rate}/s {x:.2f}x" for rate, x in compiled_speedup.items()))
    for r in rows:
        r.pop("texts")
    result = {"bench": "serve", "bundle": args.bundle, "prompts": args.prompts, "requests_per_rate": args.requests,
              "max_tokens": args.max_tokens, "max_batch": args.max_batch, "rows": rows,
              "replies_equal_across_modes": not invalid, "goodput_never_worse_5pct": goodput_ok,
              "compiled_over_eager_throughput": compiled_speedup,
              "env": environment(),
              "statistic": "per (rate, mode), one run: tokens/s over the run; TPOT and TTFT p50/p99 over its requests"}
    if args.out:
        plot(rows, Path(args.out).with_suffix(".png"))
    record.write(result, args.out, bundle=Path(args.bundle))

