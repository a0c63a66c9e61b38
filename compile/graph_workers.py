"""Compile AOTInductor packages in parallel worker processes (issue 50).

Compiling one package is single-threaded almost throughout: export and Inductor's lowering are
Python, and the generated C++ is one g++ call. So on a machine with two cores and the memory for
it, two processes compile two graphs at once. Each worker maps the models as the bundle will
carry them (compile writes the deployed weights into the work cache once, as
yggdrasil/runtime/deployed.py stores them: memory-mapped, so the workers share the pages and
nothing is converted again), takes its graphs one after another, and reports each as a JSON
line; the parent records them exactly as a sequential compile does (compile_graphs.py). The
packages are the same as sequential ones (tests/test_graph_workers.py: identical files apart
from the archive's random serialization id).

    python -m yggdrasil.compile.graph_workers WEIGHTS_DIR   # a worker: one job per stdin line
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import yggdrasil
from yggdrasil import kernels
from yggdrasil.buckets import SERVE_STAGE, GraphKey
from yggdrasil.errors import YggdrasilError
from yggdrasil.models.quant_q4 import Q4Linear, Q8Linear
from yggdrasil.runtime.deployed import DeployedWeights

from yggdrasil.graphs.aoti import export_pool_step, export_step
from yggdrasil.graphs.isa import inductor_isa

WORKER_MEMORY = 3 * 2**30  # what one worker needs besides the shared mapped weights (exporting a 1.5B model)
MAX_WORKERS = 4
DEPLOYED = "deployed"  # the work cache's copy of the deployed models, for the workers


@dataclass(frozen=True)
class Job:
    """One graph for a worker to compile into `path`."""

    role: str
    stage: str
    rows: int
    hidden: bool
    max_context: int
    path: str
    dynamic_span: bool
    isa_target: str

    @property
    def key(self) -> GraphKey:
        return GraphKey(self.stage, self.rows, hidden=self.hidden, role=self.role)


def memory_available() -> int:
    """MemAvailable from /proc/meminfo (bytes); 0 where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def worker_count(jobs: int) -> int:
    """How many workers: one per allowed CPU, as many as memory holds, no more than the jobs."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cpus, jobs, memory_available() // WORKER_MEMORY, MAX_WORKERS))


def _cost(job: Job) -> int:
    """A rough order of compile cost: the serve graph (symbolic shapes) first, then wider ones."""
    return 10**6 if job.stage == SERVE_STAGE else job.rows


def same_code(job: Job) -> tuple:
    """What a graph's generated code depends on besides the weights' values: two jobs that agree
    on it (a draft head and a draft step of the same rows: both return every row's logits)
    generate the same files under the same keys in the Inductor cache."""
    return job.role, job.rows, job.hidden, job.key.logit_rows, job.stage == SERVE_STAGE, job.max_context, \
        job.dynamic_span, job.isa_target


def share_out(jobs: list[Job], workers: int) -> list[list[Job]]:
    """Jobs dealt largest first to the worker with the least so far (by count: compile times of a
    model's graphs differ by far less than their number). Jobs with the same code go to one
    worker, one after the other: two workers writing the same cache entry at once raced (one
    packaged the other's half-written metadata: 'parse error ... empty input'), and the second of
    them now reuses the first's generated code."""
    groups: dict[tuple, list[Job]] = {}
    for job in sorted(jobs, key=_cost, reverse=True):
        groups.setdefault(same_code(job), []).append(job)
    shares: list[list[Job]] = [[] for _ in range(workers)]
    for group in groups.values():
        min(shares, key=len).extend(group)
    return [share for share in shares if share]


def compile_in_workers(weights: Path, jobs: list[Job], workers: int, done) -> dict[str, float]:
    """Compile the jobs in `workers` processes over the deployed weights in `weights`; done(job,
    seconds) is called as each finishes (from a reader thread, one at a time). Returns the
    seconds per job path; a failed graph raises naming it and the worker's last words."""
    root = Path(yggdrasil.__file__).resolve().parent.parent  # a plain checkout runs from here too
    lock, results, failures = threading.Lock(), {}, []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one core each: the workers are the parallelism

    def run(share: list[Job]) -> None:
        proc = subprocess.Popen([sys.executable, "-m", "yggdrasil.compile.graph_workers", str(weights)], cwd=root,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)
        proc.stdin.write("".join(json.dumps(asdict(job)) + "\n" for job in share))
        proc.stdin.close()
        by_path = {job.path: job for job in share}
        for line in proc.stdout:
            answer = json.loads(line)
            job = by_path[answer["path"]]
            with lock:
                if "error" in answer:
                    failures.append(f"{job.role}/{job.key.name}: {answer['error']}")
                else:
                    results[job.path] = answer["seconds"]
                    done(job, answer["seconds"])
        stderr = proc.stderr.read()
        if proc.wait() != 0 and not failures:
            with lock:
                failures.append(f"a graph worker ended with exit {proc.returncode}: "
                                f"{(stderr.strip().splitlines() or ['no output'])[-1][:300]}")

    threads = [threading.Thread(target=run, args=(share,)) for share in share_out(jobs, workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise YggdrasilError("compiling graphs failed: " + "; ".join(failures))
    return results


def load_kernels_for(weights: DeployedWeights) -> None:
    """Our CPU kernels, where the deployed models call them (before any model is loaded)."""
    ours = {Q4Linear.fmt, Q8Linear.fmt}  # the formats whose linears (and invariant ops) call our kernels
    if any(entry.get("invariant_ops") or {p["format"] for p in entry["packed"].values()} & ours
           for entry in weights.index.values()):
        kernels.load()


def main(argv: list[str]) -> int:
    """A worker: the models from the deployed weights, each stdin job compiled in turn."""
    torch.set_num_threads(1)
    weights = DeployedWeights(Path(argv[0]))
    load_kernels_for(weights)
    models = {}
    for line in sys.stdin:
        job = Job(**json.loads(line))
        try:
            if job.role not in models:
                models[job.role] = weights.load(job.role, "cpu").model
            model = models[job.role]
            with inductor_isa(job.isa_target):
                if job.stage == SERVE_STAGE:
                    seconds = export_pool_step(model, Path(job.path))
                else:
                    model.setup_cache(1, job.max_context)
                    seconds = export_step(model, job.key, job.max_context, Path(job.path), job.dynamic_span)
            print(json.dumps({"path": job.path, "seconds": seconds}), flush=True)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which names the graph
            print(json.dumps({"path": job.path, "error": f"{type(exc).__name__}: {str(exc)[:500]}"}), flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
