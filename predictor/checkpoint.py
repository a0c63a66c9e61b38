"""Per-prompt checkpoints of a calibration (issue 24: a kill near the end of a 22-minute
calibration lost all of it).

`Calibrator.run` hands each prompt's part (its iterations' rows and its share of the counts, a
dict of tensors) to `save` as soon as the prompt is done, and asks `load` before running a
prompt, so a run killed part-way and started again runs only the prompts that were not saved.
The parts are the same tensors either way, so a resumed run returns exactly what an
uninterrupted one would.

A checkpoint directory holds `key` (what the parts were computed from: models, grid, prompts,
reply length; a different key clears it) and one `prompt-NNNNN.safetensors` per finished
prompt, each written under a temporary name and renamed, so a kill never leaves half a part.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from yggdrasil.policy.files import atomic_write


class CalibrationCheckpoint:
    def __init__(self, directory: Path, key: str, log: Callable[[str], None] = print) -> None:
        """Open (or start) the checkpoint in `directory` for work with this key; parts saved
        for any other key are deleted."""
        self.directory, self.log = Path(directory), log
        key_file = self.directory / "key"
        if self.directory.is_dir() and not (key_file.is_file() and key_file.read_text() == key):
            if any(self._parts()):
                log(f"discarding the calibration checkpoint in {self.directory}: it was made for other "
                    "models, prompts or settings")
            shutil.rmtree(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        key_file.write_text(key)

    def _parts(self):
        return self.directory.glob("prompt-*.safetensors")

    def _path(self, index: int) -> Path:
        return self.directory / f"prompt-{index:05d}.safetensors"

    def saved(self) -> int:
        """How many prompts' parts are saved."""
        return sum(1 for _ in self._parts())

    def load(self, index: int) -> dict[str, torch.Tensor] | None:
        """The saved part of prompt `index`, or None (not saved, or unreadable: run it again)."""
        path = self._path(index)
        if not path.is_file():
            return None
        try:
            return load_file(str(path))
        except Exception as exc:  # a damaged file: the prompt is simply run again
            self.log(f"calibration checkpoint {path.name} is unreadable ({exc}); running that prompt again")
            path.unlink(missing_ok=True)
            return None

    def save(self, index: int, part: dict[str, torch.Tensor]) -> None:
        atomic_write(self._path(index), lambda p: save_file({k: v.contiguous() for k, v in part.items()}, str(p)))

    def remove(self) -> None:
        """Delete the checkpoint (its calibration is finished and saved)."""
        shutil.rmtree(self.directory, ignore_errors=True)
