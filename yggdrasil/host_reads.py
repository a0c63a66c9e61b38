"""The one way the decode loop reads device tensors on the host (issue 23), and the one way it
moves host-built tensors to the device (`staged`: one pinned, non-blocking copy).

Every device→host read in the decode loop (a `.tolist()`, `.item()` or `.cpu()` of a tensor
that lives on the model's device) goes through a HostReads object, so that reads can be counted
and their budget tested: one packed read per speculative iteration after the draft, one after
the verify, one per plain decode step. Each StepRunner owns one (no global state).

A packed read moves several tensors in one transfer: each is flattened, widened to float64
(exact for token ids, indices and every float dtype the models use) and concatenated on the
device; the host splits the result and casts each piece back.
"""

from __future__ import annotations

import torch


class HostReads:
    """Counts device→host reads; `count` is the total since creation (tests diff it).

    on_host: the runner's device is the host (CPU), so its tensors need no transfer at all. The
    loop then runs its per-iteration bookkeeping on them in numpy and Python (host fast paths,
    each with the device path as its reference), through `numpy()`. False on an accelerator, and
    where tests/test_sync_budget.py audits the device paths' reads on a CPU."""

    def __init__(self, on_host: bool = False) -> None:
        self.count = 0
        self._on_host = on_host

    @property
    def on_host(self) -> bool:
        return self._on_host

    def numpy(self, value: torch.Tensor):
        """A host fast path's view of a tensor of an on-host device (no copy, no transfer: not a
        read, and not counted)."""
        if not self.on_host:
            raise RuntimeError("numpy() views are for a runner on the host; on a device, read through "
                               "tensor()/packed()")
        return (value.detach() if value.requires_grad else value).numpy()

    def tensor(self, value: torch.Tensor) -> torch.Tensor:
        """One tensor on the host (one read)."""
        return self._to_host((value,))[0]

    def tolist(self, value: torch.Tensor) -> list:
        return self.tensor(value).tolist()

    def item(self, value: torch.Tensor) -> int | float:
        return self.tensor(value).item()

    def packed(self, *values: torch.Tensor) -> list[torch.Tensor]:
        """Several tensors (on one device) on the host in one read, with their shapes and dtypes."""
        return self._to_host(values)

    def _to_host(self, values) -> list[torch.Tensor]:
        """The one transfer every read makes (tests count and audit this function)."""
        self.count += 1
        if self._on_host or all(v.device.type == "cpu" for v in values):
            return [v.detach() for v in values]  # already host memory: nothing to move
        if len(values) == 1:
            return [values[0].detach().cpu()]
        return unpack(pack(values).cpu(), values)


def pack(values) -> torch.Tensor:
    """The tensors flattened, widened to float64 and concatenated (on their device)."""
    return torch.cat([v.detach().reshape(-1).to(torch.float64) for v in values])


def unpack(flat: torch.Tensor, like) -> list[torch.Tensor]:
    """pack's inverse: pieces of `flat` with the shapes and dtypes of `like`."""
    out, offset = [], 0
    for v in like:
        out.append(flat[offset:offset + v.numel()].reshape(v.shape).to(v.dtype))
        offset += v.numel()
    return out


STAGING_ALIGNMENT = 16  # bytes: AOTInductor's CUDA wrapper copies any input not 16-byte aligned


def staging_layout(values: tuple[torch.Tensor, ...]) -> tuple[list[tuple[int, int, torch.dtype, torch.Size]], int]:
    """Where each tensor's bytes go in the one staging buffer: (offset, bytes, dtype, shape) per
    tensor, every offset a multiple of STAGING_ALIGNMENT, and the buffer's size."""
    layout, offset = [], 0
    for value in values:
        nbytes = value.numel() * value.element_size()
        layout.append((offset, nbytes, value.dtype, value.shape))
        offset += nbytes + -nbytes % STAGING_ALIGNMENT
    return layout, offset


def staged(values: tuple[torch.Tensor, ...], device: torch.device) -> list[torch.Tensor]:
    """Host tensors on `device` in one copy: their bytes go into one host buffer (pinned on
    CUDA, each piece STAGING_ALIGNMENT-aligned), one non-blocking copy moves it, and each tensor
    is a view of the moved buffer (the device allocator aligns the buffer itself). A host device
    gets the tensors back as they are."""
    if device.type == "cpu":
        return list(values)
    layout, size = staging_layout(values)
    host = torch.zeros(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    for value, (offset, nbytes, _, _) in zip(values, layout):
        host[offset:offset + nbytes] = value.contiguous().reshape(-1).view(torch.uint8)
    moved = host.to(device, non_blocking=True)  # the pinned block is not reused before the copy ends
    return [moved[o:o + n].view(dtype).view(shape) for o, n, dtype, shape in layout]
