"""The depth predictor (docs/design.md §3.4): a two-layer MLP encoder over the target's last hidden state
and one head per draft depth d giving P(accepted length >= d) for the coming iteration.

From those tails follow the class probabilities over accepted lengths 0..D_max (the
classification over depths) and the expected accepted tokens of any depth-D tree,
E[min(a, D)] = Σ_{k<=D} P(a >= k), which is what bucket selection needs. Trained at calibration
time with a held-out split by prompt; it must beat the best constant to be used at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file
from torch import nn

from yggdrasil.policy.files import PredictorError, atomic_write
from yggdrasil.policy.device_profile import median_time
from yggdrasil.policy.depth_model import SCHEMA, DepthMLP

MIN_RECORDS = 200  # fewer calibration iterations than this cannot train or judge a predictor
MIN_PROMPTS = 4  # and they must come from enough prompts to hold some out


def tail_targets(accepted: torch.Tensor, max_depth: int) -> torch.Tensor:
    depths = torch.arange(1, max_depth + 1)
    return (accepted[:, None] >= depths[None, :]).float()


def class_probs(tail: torch.Tensor) -> torch.Tensor:
    """[N, max_depth + 1] P(accepted == k) from the tails."""
    ones = torch.ones(*tail.shape[:-1], 1)
    zeros = torch.zeros(*tail.shape[:-1], 1)
    padded = torch.cat([ones, tail, zeros], -1)
    return (padded[..., :-1] - padded[..., 1:]).clamp(min=0)


def split_by_prompt(prompt_index: torch.Tensor, every: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(train mask, held-out mask): every `every`-th distinct prompt is held out."""
    prompts = sorted(set(prompt_index.tolist()))
    held = {p for i, p in enumerate(prompts) if i % every == every - 1}
    held_mask = torch.tensor([p in held for p in prompt_index.tolist()])
    return ~held_mask, held_mask


def check_enough(prompt_index: torch.Tensor) -> None:
    n, prompts = prompt_index.numel(), len(set(prompt_index.tolist()))
    if n < MIN_RECORDS or prompts < MIN_PROMPTS:
        raise PredictorError(
            f"calibration gave {n} iterations from {prompts} prompts; a depth predictor needs at "
            f"least {MIN_RECORDS} iterations from {MIN_PROMPTS} prompts to be trained and judged. "
            "Calibrate on more prompts (--num-prompts) or longer replies (--max-new-tokens)")


def bce(tail: torch.Tensor, targets: torch.Tensor) -> float:
    p = tail.clamp(1e-6, 1 - 1e-6)
    return float(-(targets * p.log() + (1 - targets) * (1 - p).log()).mean())


def train(hidden: torch.Tensor, accepted: torch.Tensor, train_mask: torch.Tensor, max_depth: int,
          epochs: int = 400, patience: int = 40, seed: int = 0) -> DepthMLP:
    """Fit on train_mask rows; early-stop on an inner split of those rows by position."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    x, y = hidden[train_mask].float(), tail_targets(accepted[train_mask], max_depth)
    order = torch.randperm(x.shape[0], generator=generator)
    n_stop = max(1, x.shape[0] // 8)
    stop_rows, fit_rows = order[:n_stop], order[n_stop:]
    model = DepthMLP(x.shape[1], max_depth)
    model.mean.copy_(x[fit_rows].mean(0))
    model.std.copy_(x[fit_rows].std(0).clamp(min=1e-3))
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    loss_fn = nn.BCEWithLogitsLoss()
    best, best_state, waited = math.inf, None, 0
    batch = 256
    for _ in range(epochs):
        model.train()
        perm = fit_rows[torch.randperm(fit_rows.numel(), generator=generator)]
        for start in range(0, perm.numel(), batch):
            rows = perm[start:start + batch]
            optimiser.zero_grad()
            loss_fn(model(x[rows]), y[rows]).backward()
            optimiser.step()
        model.eval()
        with torch.no_grad():
            stop_loss = float(loss_fn(model(x[stop_rows]), y[stop_rows]))
        if stop_loss < best - 1e-5:
            best, waited = stop_loss, 0
            best_state = {k: v.clone() for k, v in model.state_dict().items()}
        else:
            waited += 1
            if waited >= patience:
                break
    model.load_state_dict(best_state)
    return model.eval()


@dataclass(frozen=True)
class HeldOutReport:
    records: int
    accuracy: float  # predicted accepted length (argmax class) == realised, capped at max depth
    within_one: float
    majority_accuracy: float  # always predicting the most common training length
    log_loss: float  # per-depth binary cross-entropy of the tails
    constant_log_loss: float  # the same for the training set's average tails
    inference_us: float  # one prediction for one hidden state, median

    @property
    def useful(self) -> bool:
        return self.log_loss < self.constant_log_loss


def evaluate(model: DepthMLP, hidden: torch.Tensor, accepted: torch.Tensor, train_mask: torch.Tensor,
             held_mask: torch.Tensor, max_depth: int) -> HeldOutReport:
    x, a = hidden[held_mask].float(), accepted[held_mask].clamp(max=max_depth)
    with torch.inference_mode():
        tail = model.tail(x)
    predicted = class_probs(tail).argmax(-1)
    train_a = accepted[train_mask].clamp(max=max_depth)
    majority = int(torch.bincount(train_a, minlength=max_depth + 1).argmax())
    constant_tail = tail_targets(train_a, max_depth).mean(0).expand_as(tail)
    targets = tail_targets(a, max_depth)
    one = hidden[:1].float()
    with torch.inference_mode():
        seconds = median_time(lambda: model.tail(one), 200, warmup=10)[0]
    return HeldOutReport(int(a.numel()), float((predicted == a).float().mean()),
                         float(((predicted - a).abs() <= 1).float().mean()),
                         float((a == majority).float().mean()), bce(tail, targets),
                         bce(constant_tail, targets), seconds * 1e6)


def save(model: DepthMLP, directory: Path, meta: dict) -> None:
    directory = Path(directory)
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    atomic_write(directory / "predictor.safetensors", lambda p: save_file(weights, str(p)))
    dim, max_depth = model.mean.numel(), model.heads.out_features
    body = {"schema": SCHEMA, "dim": dim, "max_depth": max_depth, "units": model.heads.in_features, **meta}
    atomic_write(directory / "predictor.yaml", lambda p: p.write_text(yaml.safe_dump(body, sort_keys=False)))


