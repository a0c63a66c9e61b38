"""The depth predictor's model (docs/design.md §3.4) as the runtime uses it: a two-layer MLP
encoder over the target's last hidden state and one head per draft depth d giving P(accepted
length >= d) for the coming iteration, loaded from a calibration directory. Training, judging and
saving it live in predictor/depth.py."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from yggdrasil.policy.files import PredictorError, read_pair


SCHEMA = "yggdrasil-predictor/1"


HIDDEN_UNITS = 256


class DepthMLP(nn.Module):
    def __init__(self, dim: int, max_depth: int, units: int = HIDDEN_UNITS) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(dim, units), nn.GELU(), nn.Dropout(0.1),
                                     nn.Linear(units, units), nn.GELU())
        self.heads = nn.Linear(units, max_depth)  # head d: logit of P(accepted >= d + 1)
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("std", torch.ones(dim))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.heads(self.encoder((hidden.float() - self.mean) / self.std))

    def tail(self, hidden: torch.Tensor) -> torch.Tensor:
        """P(accepted >= d) for d = 1..max_depth, made non-increasing in d."""
        return torch.sigmoid(self(hidden)).cummin(-1).values


def load(directory: Path, dim: int | None = None, target_sha256: str | None = None) -> tuple[DepthMLP, dict]:
    """The predictor saved in `directory`, checked against the target it will read."""
    directory = Path(directory)
    rebuild = "re-run `yggdrasil calibrate` for this model"
    meta, weights = read_pair(directory, "predictor", SCHEMA, f"{directory} has no depth predictor",
                              f"the depth predictor in {directory} is unreadable", rebuild)
    if dim is not None and meta["dim"] != dim:
        raise PredictorError(f"the depth predictor reads hidden states of size {meta['dim']} but this "
                             f"target's are {dim}; {rebuild}")
    if target_sha256 and meta.get("target_sha256") and meta["target_sha256"] != target_sha256:
        raise PredictorError(f"the depth predictor was trained on another target model file "
                             f"(sha256 {meta['target_sha256'][:12]}…, this one {target_sha256[:12]}…); {rebuild}")
    model = DepthMLP(meta["dim"], meta["max_depth"], meta["units"])
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        raise PredictorError(f"the depth predictor weights in {directory} do not match its metadata "
                             f"({exc}); {rebuild}") from None
    return model.eval(), meta
