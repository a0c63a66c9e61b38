"""Device→host reads per decode-loop iteration, for every speculation mode (issue 23).

On CPU there is no device boundary, so the test draws one: every tensor a model forward returns
is "on the device", and so is everything computed from it (a TorchFunctionMode follows the data,
including writes into other tensors). Reading any such tensor on the host (`.tolist()`,
`.item()`, `int()`, `.cpu()`, `.to(a device)`, ...) is a device→host read: the loop must make
each one through its runner's HostReads (yggdrasil/host_reads.py), and make few of them.
Indexing by a 0-dim device tensor or a device boolean mask reads it too (a hidden sync).
The other direction is counted as well (issue 36): a host tensor moved with `.to(a device)` or
built from Python values with an explicit `device=` is a pageable host→device copy (a sync on
CUDA); host-built inputs must go through `staged()` (one pinned, non-blocking copy).

Trees built on the host must also give exactly the tokens of the trees built before
(tests/data/host_tree_tokens.json, recorded with the old code by tests/sync_scenarios.py).
"""

from __future__ import annotations

import json
import weakref
from contextlib import contextmanager

import pytest
import torch
from torch.overrides import TorchFunctionMode

import sync_scenarios as sc
from yggdrasil.host_reads import HostReads
from yggdrasil.runtime.speculative import SpeculativeGenerator
from yggdrasil.runtime.stage_plan import StagePlan
from yggdrasil.runtime.steps import StepRunner

READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy", "nonzero"}
SPEC_BUDGET, PLAIN_BUDGET = 2, 1  # a draft model's tree, then the target's choices; one sample


class DeviceBoundary(TorchFunctionMode):
    """Follows model outputs through every op; counts host reads of them, and which of those
    bypassed HostReads (stray)."""

    def __init__(self) -> None:
        super().__init__()
        self._device: dict[int, weakref.ref] = {}  # id -> weak reference (tensors compare by value)
        self.reads = self.stray = 0
        self.hidden_syncs = 0  # indexing by a 0-dim device tensor or a device bool mask
        self.unstaged = 0  # host→device copies outside staged()
        self.sanctioned = False

    def add(self, t: torch.Tensor) -> None:
        key = id(t)
        self._device[key] = weakref.ref(t, lambda _, key=key: self._device.pop(key, None))

    def holds(self, t: torch.Tensor) -> bool:
        ref = self._device.get(id(t))
        return ref is not None and ref() is t

    def mark(self, out) -> None:
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.add(t)

    def _touches_device(self, args, kwargs) -> bool:
        stack = [*args, *(kwargs or {}).values()]
        while stack:
            a = stack.pop()
            if isinstance(a, torch.Tensor) and self.holds(a):
                return True
            if isinstance(a, (tuple, list)):
                stack.extend(a)
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        device = self._touches_device(args, kwargs)
        if self.sanctioned:  # inside HostReads' one transfer: counted there
            return func(*args, **kwargs)
        if device and (name in READS or (name == "to" and _moves(args, kwargs))):
            self.reads += 1
            self.stray += not self.sanctioned
            return func(*args, **kwargs)
        if name in ("__getitem__", "__setitem__") and self._syncing_index(args):
            self.hidden_syncs += 1
        if not device and ((name in ("tensor", "as_tensor") and kwargs.get("device") is not None)
                           or (name == "to" and _moves(args, kwargs))):
            self.unstaged += 1
        out = func(*args, **kwargs)
        if device:
            self.mark(out)
            if (name.endswith("_") or name == "__setitem__") and args and isinstance(args[0], torch.Tensor):
                self.add(args[0])  # written with device data: it is device data now
        return out


    def _syncing_index(self, args) -> bool:
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(i, torch.Tensor) and self.holds(i) and (i.dim() == 0 or i.dtype == torch.bool)
                   for i in parts)


def _moves(args, kwargs) -> bool:
    """Whether a Tensor.to call names a device (not only a dtype)."""
    return any(isinstance(a, (torch.device, str)) for a in args[1:]) or kwargs.get("device") is not None


@contextmanager
def boundary(monkeypatch):
    mode = DeviceBoundary()
    run, transfer = StepRunner.run, HostReads._to_host

    def device_run(self, *args, **kwargs):
        out = run(self, *args, **kwargs)
        mode.mark(out)
        return out

    def sanctioned_read(self, values):
        mode.reads += 1
        mode.sanctioned = True
        try:
            return transfer(self, values)
        finally:
            mode.sanctioned = False

    monkeypatch.setattr(StepRunner, "run", device_run)
    monkeypatch.setattr(HostReads, "_to_host", sanctioned_read)
    monkeypatch.setattr(HostReads, "on_host", False)  # the device paths, whose reads this audits
    with mode:
        yield mode


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return sc.load_models(tmp_path_factory.mktemp("sync"))


def count_reads(models, monkeypatch, mode: str, sampling: str, plan: str = "sequential", draft: str = "draft"):
    """Reads per speculative iteration (a list) or per plain decode step, the boundary (its stray
    reads, hidden syncs and unstaged copies) and the result."""
    target, _, spec = sc.speculator(models, mode, StagePlan.parse(plan), draft)
    prompt = sc.REPEATING if "lookup" in mode else sc.PROMPT
    per_step: list[int] = []
    with boundary(monkeypatch) as mode_:
        if spec is None:
            before = mode_.reads
            result = sc.generate(target, prompt, sc.NEW_TOKENS, sc.SAMPLINGS[sampling])
            return [(mode_.reads - before) / (len(result.tokens) + 1)], mode_, result
        step = SpeculativeGenerator.step

        def counted(self, *args, **kwargs):
            before = mode_.reads
            out = step(self, *args, **kwargs)
            per_step.append(mode_.reads - before)
            return out

        monkeypatch.setattr(SpeculativeGenerator, "step", counted)
        result = spec.generate(prompt, sc.NEW_TOKENS, sc.SAMPLINGS[sampling])
    return per_step, mode_, result


@pytest.mark.parametrize("mode", sc.MODES)
@pytest.mark.parametrize("sampling", list(sc.SAMPLINGS))
def test_reads_per_iteration_stay_within_budget(models, monkeypatch, mode, sampling):
    per_step, boundary_, result = count_reads(models, monkeypatch, mode, sampling)
    # without a draft model there is no draft read: the choices' read is the iteration's only one
    budget = PLAIN_BUDGET if mode in ("plain", "lookup", "auto-lookup") else SPEC_BUDGET
    assert per_step and max(per_step) <= budget, (mode, per_step)
    assert boundary_.stray == 0, f"{boundary_.stray} device→host reads bypassed HostReads"
    assert boundary_.hidden_syncs == 0, f"{boundary_.hidden_syncs} indexings by device tensors (hidden syncs)"
    assert boundary_.unstaged == 0, f"{boundary_.unstaged} host→device copies bypassed staged()"
    assert result.tokens  # the loop ran


@pytest.mark.parametrize("plan", ["aot-tail", "aot-head", "aot-tail+aot-head+device-accept", "device-accept"])
def test_reads_per_iteration_under_stage_plans(models, monkeypatch, plan):
    per_step, b, _ = count_reads(models, monkeypatch, "egt", "seeded", plan, "self")
    assert max(per_step) <= SPEC_BUDGET and b.stray == b.hidden_syncs == b.unstaged == 0, \
        (plan, per_step, b.stray, b.hidden_syncs, b.unstaged)


def test_the_boundary_catches_a_stray_read(models, monkeypatch):
    """The counters are real: a read outside HostReads is counted as stray, an index by a device
    scalar as a hidden sync, a host→device copy outside staged() as unstaged."""
    target = StepRunner(models["target"], sc.CONTEXT, 8)
    with boundary(monkeypatch) as mode:
        logits = target.decode(3, 0)
        token = int(logits.argmax())  # not through HostReads
        mixed = torch.zeros(2, dtype=torch.long)
        mixed[0] = logits.argmax()  # device data written into a host tensor...
        mixed.tolist()  # ...and read
        target.reads.item(logits.argmax())
        logits[logits.argmax()]  # a 0-dim device index: a hidden read
        torch.tensor([1, 2], device=target.device)  # a pageable host→device copy
        torch.zeros(2).to(target.device)  # another
        logits.to("cpu")  # a read by another name
    assert token >= 0 and mode.reads == 4 and mode.stray == 3
    assert mode.hidden_syncs == 1 and mode.unstaged == 2


RECORDED = json.loads(sc.FIXTURE.read_text())


@pytest.mark.parametrize("case", sc.cases(), ids=sc.case_id)
def test_host_trees_give_the_recorded_tokens(models, case):
    mode, sampling, plan, draft = case
    tokens = sc.run(models, mode, sampling, StagePlan.parse(plan), draft).tokens
    if sampling == "greedy":
        # Greedy has a machine-independent reference: plain decoding of the same models in this
        # process (the fixture's float32 argmaxes were recorded on one CPU; another may round apart).
        assert tokens == _plain_greedy(models, sc.REPEATING if "lookup" in mode else sc.PROMPT)
    else:
        assert tokens == RECORDED[sc.case_id(case)]


def _plain_greedy(models, prompt: list[int]) -> list[int]:
    target, _, _ = sc.speculator(models, "plain")
    return sc.generate(target, prompt, sc.NEW_TOKENS, sc.SAMPLINGS["greedy"]).tokens
