"""Graphs compiled in parallel worker processes (compile/graph_workers.py, issue 50) are the
graphs a sequential compile makes, and the workers are only as many as cores and memory allow."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest
from helpers import write_tiny_recipe_dir

from yggdrasil.buckets import GraphKey
from yggdrasil.compile import graph_workers
from yggdrasil.compile.graph_workers import Job, share_out, worker_count


def _job(stage: str, rows: int) -> Job:
    return Job("target", stage, rows, False, 256, f"/x/{stage}{rows}", True, "native")


def test_jobs_are_dealt_largest_first_and_evenly():
    jobs = [_job("verify", 2), _job("serve", 0), _job("prefill", 16), _job("decode", 1), _job("verify", 4)]
    shares = share_out(jobs, 2)
    assert [j.stage for j in shares[0]][0] == "serve" and sorted(len(s) for s in shares) == [2, 3]
    assert sorted(j.path for s in shares for j in s) == sorted(j.path for j in jobs)
    assert share_out(jobs[:1], 3) == [[jobs[0]]]  # no empty worker


def test_graphs_with_the_same_code_go_to_one_worker_one_after_the_other():
    """A draft head and a draft step of the same rows generate the same code: compiled at once
    by two workers they raced over the same cache entry (CI: 'parse error ... empty input')."""
    def draft(stage: str, rows: int) -> Job:
        return Job("draft", stage, rows, False, 256, f"/x/draft-{stage}{rows}", True, "native")

    jobs = [draft("draft_head", 2), draft("draft_step", 2), draft("draft_step", 1), draft("prefill", 16),
            _job("verify", 2), _job("decode", 1)]
    for workers in (2, 3, 4):
        shares = share_out(jobs, workers)
        holder = [s for s in shares if jobs[0] in s]
        assert len(holder) == 1 and jobs[1] in holder[0]
        at = holder[0].index(jobs[0])
        assert abs(holder[0].index(jobs[1]) - at) == 1  # one right after the other
        assert sorted(j.path for s in shares for j in s) == sorted(j.path for j in jobs)
    assert not any(_job("verify", 2) in s and draft("draft_step", 2) in s for s in share_out(jobs[1:2] + jobs[4:5], 2))


def test_workers_are_bounded_by_cores_memory_and_jobs(monkeypatch):
    monkeypatch.setattr(graph_workers.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(graph_workers, "memory_available", lambda: 64 * 2**30)
    assert worker_count(9) == 2 and worker_count(1) == 1
    monkeypatch.setattr(graph_workers, "memory_available", lambda: graph_workers.WORKER_MEMORY + 1)
    assert worker_count(9) == 1  # memory for one worker only: compile in-process


def _contents(package: Path) -> dict[str, bytes]:
    """A package's files, less the archive's random serialization id and its top folder's name."""
    with zipfile.ZipFile(package) as archive:
        return {name.split("/", 1)[1]: archive.read(name) for name in archive.namelist()
                if not name.endswith(".data/serialization_id")}


@pytest.mark.slow
def test_graphs_compiled_by_workers_equal_sequential_ones(tmp_path, monkeypatch):
    import yggdrasil.compile.compile_graphs as compile_graphs
    from yggdrasil.compile.context import load_context
    from yggdrasil.compile.recipe import load_recipe

    recipe = load_recipe(write_tiny_recipe_dir(tmp_path / "recipe"))
    keys = [GraphKey("decode", 1), GraphKey("verify", 4)]
    inductor = tmp_path / "inductor"  # one path for both (Inductor writes it into the C++ it compiles)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    packages = {}
    for workers in (1, 2):
        shutil.rmtree(inductor, ignore_errors=True)
        ctx = load_context(recipe, tmp_path / f"bundle-{workers}", log=lambda line: None)
        assert compile_graphs.compile_graphs(ctx, keys, workers=workers) == len(keys)
        packages[workers] = {k.name: _contents(ctx.work.graph(k)) for k in keys}
    assert (tmp_path / ".bundle-2.work" / graph_workers.DEPLOYED).is_dir()  # the workers' mapped models
    assert packages[1] == packages[2]
