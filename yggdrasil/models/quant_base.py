"""What every packed weight format shares (yggdrasil/models/quant.py, yggdrasil/models/quant_q4.py): the base
module of a linear whose weight is stored packed, and the format error."""

from __future__ import annotations

import torch
from torch import nn

from yggdrasil.errors import YggdrasilError


class WeightFormatError(YggdrasilError):
    """A weight format that is unknown, or that this model or device cannot use."""


class PackedLinear(nn.Module):
    """A linear layer whose weight is stored in a packed format; subclasses define the kernel."""

    fmt = ""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        if bias is not None:
            self.register_buffer("bias", bias.detach().clone())
        else:
            self.bias = None

    @classmethod
    def from_buffers(cls, in_features: int, out_features: int, buffers: dict[str, torch.Tensor]) -> "PackedLinear":
        """The layer over tensors already in its packed form (a bundle's mapped weights): nothing
        is converted or copied, unlike __init__, which packs."""
        module = cls.__new__(cls)
        PackedLinear.__init__(module, in_features, out_features, None)
        for name, tensor in buffers.items():
            if name == "bias":
                del module.bias  # __init__ left a plain None attribute in its place
            module.register_buffer(name, tensor)
        return module

    def dequantized_weight(self) -> torch.Tensor:
        """The weight this layer multiplies by, as float32 [out, in], in plain PyTorch."""
        raise NotImplementedError

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}"
