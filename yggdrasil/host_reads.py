"""The one way the decode loop reads device tensors on the host (issue 23).

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
    """Counts device→host reads; `count` is the total since creation (tests diff it)."""

    def __init__(self) -> None:
        self.count = 0

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
        if all(v.device.type == "cpu" for v in values):
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
