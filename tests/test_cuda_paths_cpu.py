"""The CUDA paths' device-independent logic, checked on a CPU (issue 23; no GPU has run them):
packages open single-threaded on CUDA, capture warms up and captures every graph largest
first on one side stream into one pool and reports memory_reserved's rise, the planner's
contention timings synchronize, and step times come from the device timer."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from yggdrasil.runtime import latency
from yggdrasil.storage import cuda_graphs, registry
from yggdrasil.storage.cuda_graphs import CapturedStep, capture, replay_counts
from yggdrasil.planner import costs


@pytest.mark.parametrize("device, expected", [(torch.device("cuda"), (True, 1, 0)),
                                              (torch.device("cuda", 1), (True, 1, 1)),
                                              (torch.device("cpu"), (False, 1, -1))])
def test_packages_open_single_threaded_on_cuda(monkeypatch, tmp_path, device, expected):
    opened = []
    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", lambda *args: opened.append(args))
    registry.open_loader(tmp_path / "g.pt2", device)
    assert opened == [(str(tmp_path / "g.pt2"), "model", *expected)]


class _FakeCuda:
    """What capture() uses of torch.cuda, recording the order of events."""

    def __init__(self) -> None:
        self.events, self.reserved, self.current, self.capturing = [], 1000, "default", None
        self.streams = []

    def install(self, monkeypatch) -> None:
        for name in ("synchronize", "empty_cache", "memory_reserved", "graph_pool_handle", "Stream",
                     "current_stream", "stream", "graph", "CUDAGraph"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def synchronize(self, device=None):
        self.events.append("sync")

    def empty_cache(self):
        self.events.append("empty_cache")

    def memory_reserved(self, device=None):
        return self.reserved

    def graph_pool_handle(self):
        self.events.append("pool")
        return "POOL"

    def Stream(self, device=None):
        stream = SimpleNamespace(name=f"side{len(self.streams)}", wait_stream=lambda other: None,
                                 synchronize=lambda: self.events.append("stream_sync"))
        self.streams.append(stream)
        return stream

    def current_stream(self, device=None):
        return SimpleNamespace(name=self.current, wait_stream=lambda other: None)

    @contextlib.contextmanager
    def stream(self, stream):
        previous, self.current = self.current, stream.name
        yield
        self.current = previous

    @contextlib.contextmanager
    def graph(self, graph, pool=None, stream=None):
        self.capturing = (graph, pool, stream.name)
        yield
        self.capturing = None
        self.reserved += 100  # each capture takes pool memory

    def CUDAGraph(self):
        return SimpleNamespace(replay=lambda: None)


class _FakeStep:
    def __init__(self, name: str, cuda: _FakeCuda) -> None:
        self.name, self.cuda, self.seconds = name, cuda, 0.0

    def __call__(self, tokens, positions, slots, mask, logit_index=None):
        mode = "capture" if self.cuda.capturing else "warm"
        pool = self.cuda.capturing[1] if self.cuda.capturing else None
        self.cuda.events.append((mode, self.name, tokens.shape[1], self.cuda.current, pool, logit_index is not None))
        return torch.zeros(1, tokens.shape[1], 8)


def test_capture_warms_up_and_captures_largest_first_on_one_stream_into_one_pool(monkeypatch):
    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    names = ["decode_w1", "verify_w16", "prefill_w64", "verify_w4"]
    graph_set = registry.GraphSet("target", {n: _FakeStep(n, cuda) for n in names}, None, 0.0, "hint")
    taken = capture(graph_set, 128, 255, "cpu")
    runs = [e for e in cuda.events if isinstance(e, tuple)]
    order = [e[1] for e in runs if e[0] == "capture"]
    assert order == ["prefill_w64", "verify_w16", "verify_w4", "decode_w1"]  # largest first
    assert len(cuda.streams) == 1 and {e[3] for e in runs} == {"side0"}  # warm-up and capture: one stream
    assert {e[4] for e in runs if e[0] == "capture"} == {"POOL"} and cuda.events.count("pool") == 1
    for name in names:  # each graph warmed up (twice) right before its capture
        mine = [e[0] for e in runs if e[1] == name]
        assert mine == ["warm"] * cuda_graphs.WARMUP_RUNS + ["capture"]
    assert all(e[5] == e[1].startswith(("prefill", "decode")) for e in runs)  # logit_index where exported
    assert taken == 400  # memory_reserved's rise, measured from after an empty_cache
    assert cuda.events.index("empty_cache") < cuda.events.index("pool")
    assert graph_set.fixed_span == 128 and all(isinstance(g, CapturedStep) for g in graph_set.graphs.values())
    step = graph_set.graphs["verify_w4"]
    out = step(torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long),
               torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4, 128, dtype=torch.bool))
    assert out.shape == (1, 4, 8) and step.replays == 1
    assert replay_counts({"target": graph_set})["target/verify_w4"] == 1


def test_contention_timings_synchronize_each_run(monkeypatch):
    synced = []
    monkeypatch.setattr(costs, "device_sync", lambda device: lambda: synced.append(device))
    ran = []
    c = costs.measure_contention(lambda: ran.append("a"), lambda: ran.append("b"), repeats=3,
                                 device=torch.device("cpu"))
    assert 1.0 <= c <= 4.0
    # warm + 3 timed alone each + 3 together, every timed run followed by a sync
    assert ran.count("a") == 1 + 3 + 3 and ran.count("b") == 1 + 3 + 3
    assert len(synced) == 3 * (1 + 3)


def test_step_times_come_from_the_device_timer():
    calls = []
    times = latency.device_timed_runs(lambda: calls.append(1), repeats=4, warmup=2, device=torch.device("cpu"))
    assert len(times) == 4 and len(calls) == 6 and all(t >= 0 for t in times)


# ---- issue 36: CUDA-path defects a CPU can show ------------------------------------------------

def test_every_host_read_goes_through_the_one_transfer(monkeypatch):
    """tests/test_bundle_gpu.py sanctions reads by patching HostReads._to_host: every kind of
    read (tensor, tolist, item, packed) must reach it, or that test fails on the first other one."""
    from yggdrasil.host_reads import HostReads

    seen = []
    transfer = HostReads._to_host
    monkeypatch.setattr(HostReads, "_to_host", lambda self, values: seen.append(len(values)) or transfer(self, values))
    reads = HostReads()
    x = torch.arange(4)
    reads.tensor(x), reads.tolist(x), reads.item(x[0]), reads.packed(x, x.float())
    assert seen == [1, 1, 1, 2] and reads.count == 4


def test_staged_inputs_are_16_byte_aligned():
    """AOTInductor's CUDA wrapper copies every input that is not 16-byte aligned (a warning and a
    copy per call); staged() places each piece at a multiple of 16 bytes."""
    from yggdrasil.host_reads import STAGING_ALIGNMENT, staged, staging_layout

    values = (torch.tensor([[1, 2, 3]]), torch.ones(1, 3, 5, dtype=torch.bool), torch.tensor([[7]]),
              torch.ones(1, 1, 3, dtype=torch.bool), torch.arange(5)[None])
    layout, size = staging_layout(values)
    assert STAGING_ALIGNMENT == 16 and all(offset % 16 == 0 for offset, *_ in layout) and size % 16 == 0
    assert [n for _, n, _, _ in layout] == [24, 15, 8, 3, 40]
    moved = staged(values, torch.device("meta"))  # a device other than the host: the staging path
    assert [m.shape for m in moved] == [v.shape for v in values] and all(m.is_meta for m in moved)
    assert [m.dtype for m in moved] == [v.dtype for v in values]


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sampling_on_a_device_reads_nothing_back(top_p):
    """Sampled decoding on a device draws on the device with host-drawn uniforms: nothing is
    copied back to the host (a meta tensor refuses any such copy). Before issue 36, sample()
    moved the probabilities to the CPU generator's device and back."""
    from yggdrasil.sampling import SamplingParams, draw_from, sample

    params = SamplingParams(temperature=0.8, top_p=top_p, seed=3)
    drawn = sample(torch.randn(2, 3, 50, device="meta"), params, params.generator())
    assert drawn.is_meta and drawn.shape == (2, 3)
    # the same draw on the host: inverse CDF of the host uniforms, as the device path computes it
    probs = torch.softmax(torch.randn(4, 50), -1)
    uniforms = torch.rand(4, 1, generator=torch.Generator().manual_seed(0))
    cdf = probs.cumsum(-1)
    assert torch.equal(draw_from(probs, uniforms), torch.searchsorted(cdf, uniforms * cdf[:, -1:]).squeeze(-1))


def test_a_cache_bound_to_graphs_is_never_replaced_under_them(tmp_path):
    """A bundle's graphs hold their cache's addresses (captured CUDA graphs replay into them):
    a runner that would need another cache (torch.compile's separate buffers, another size) is
    refused with a clear error instead of leaving the graphs writing to freed memory."""
    from helpers import save_random_hf_model
    from yggdrasil.errors import YggdrasilError
    from yggdrasil.models.hf_loader import load_hf_model
    from yggdrasil.runtime.steps import StepRunner

    save_random_hf_model(tmp_path / "m", "qwen2")
    model = load_hf_model(tmp_path / "m", torch.float32)
    cache = model.setup_cache(1, 128, stacked=True)
    cache.bound_by = "the target graphs of some bundle"  # what load_graph_set records
    assert StepRunner(model, 128).cache is cache  # an eager runner of the same size shares it
    with pytest.raises(YggdrasilError, match="bound to the target graphs of some bundle"):
        StepRunner(model, 128, compile=True)
    with pytest.raises(YggdrasilError, match="256 positions"):
        StepRunner(model, 256)
    assert model.cache is cache


class _FakePoolStep:
    """The server's dynamic step graph as PoolGraphBuckets calls it (records shapes and mode)."""

    def __init__(self, cuda: _FakeCuda) -> None:
        self.cuda, self.calls = cuda, []

    def __call__(self, tokens, positions, slots, mask, logit_index, kv=()):
        mode = "capture" if self.cuda.capturing else "run"
        self.calls.append((mode, tokens.shape[1], mask.shape[2], logit_index.shape[1], len(kv), self.cuda.current))
        return torch.zeros(1, logit_index.shape[1], 8)


def test_serve_graph_is_captured_at_each_row_bucket_largest_first(monkeypatch):
    from yggdrasil.storage.cuda_graphs import PoolGraphBuckets

    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    step = _FakePoolStep(cuda)
    kv = [torch.zeros(1, 2, 128, 4) for _ in range(4)]
    graphs = PoolGraphBuckets(step, kv, span=128, scratch_slot=127, buckets=(1, 2, 4, 8), device="cpu")
    captured = [c for c in step.calls if c[0] == "capture"]
    assert [c[1] for c in captured] == [8, 4, 2, 1]  # largest first, into one pool
    assert all(c[2] == 128 and c[3] == c[1] and c[4] == 4 and c[5] == "side0" for c in captured)
    assert cuda.events.count("pool") == 1 and graphs.capture_bytes == 400
    assert graphs.rows_for(3) == 4 and graphs.rows_for(9) is None
    before = len(step.calls)
    tokens = torch.ones(1, 4, dtype=torch.long)
    out = graphs(tokens, tokens, tokens, torch.ones(1, 4, 128, dtype=torch.bool), torch.zeros(1, 4, dtype=torch.long), kv)
    assert out.shape == (1, 4, 8) and graphs.replays[4] == 1 and len(step.calls) == before  # a replay, no call
    wide = torch.ones(1, 9, dtype=torch.long)  # wider than every bucket: the uncaptured graph
    graphs(wide, wide, wide, torch.ones(1, 9, 128, dtype=torch.bool), torch.zeros(1, 2, dtype=torch.long), kv)
    assert step.calls[-1][:2] == ("run", 9)
