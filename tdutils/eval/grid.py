"""The default real-model leaderboard grid, defined once: `LEADERBOARD` (`python -m tdutils eval --tasks leaderboard`,
`notebooks/compare_policies.ipynb`'s `real_model`).

Issue 43's grid on SmolLM2-135M-Instruct: the two binary RULER tasks its full cache answers at least half the time
(`ruler_niah_single_1` 20/20, `ruler_niah_multikey_1` 11/20 at 2048 tokens: docs/real_models.md), one partial-credit task
(`ruler_niah_multivalue_partial`: it lists 58% of the values, 0/6 exactly) and text fidelity (`text_fidelity`: KL to
the full cache on a teacher-forced continuation, agnostic mode only), every policy that keeps one set per request
plus the full cache, drop ratios 0.5 / 0.75 / 0.9, both modes, 2048 tokens; 100 prompts per binary or partial
cell and 32 texts for fidelity. Every cell runs on the same prompts as the full cache, so the paired tests of
`tdutils.eval.statistics` rank them.

Its dtype (`Grid.dtype`): bfloat16 on any GPU or on a CPU that computes bfloat16 natively, else float32 (torch
emulates bfloat16 there, slower than float32). Measured (docs/models.md, "bfloat16 against float32"): on RULER the
bfloat16 model gave float32's answers token for token (16/16 prompts, no discordant one), and its next-token KL to
float32 (~1e-3 nats) is a twentieth of SnapKV's effect at 0.5; each cell is compared with the full cache in the
same dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engines.hf import cpu_has_native_bf16
from ..policies import policy_names
from ..policies.registry import get_policy
from .common import FULL
from .tasks import MODES

LEADERBOARD_WORD = "leaderboard"  # --tasks word that runs the grid


@dataclass(frozen=True)
class Grid:
    """A named evaluation grid: what `eval --tasks <word>` runs when its other options are left out.

    Attributes:
        tasks: registered task names, in run order; n: prompts per (task, context length), one per task.
        model: the model it is defined for (`--model` left out).
        drop_ratios, context_lengths, modes: the grid's other axes (a teacher-forced task runs agnostic only,
            `tdutils.eval.runner.task_modes`).

    Raises:
        ValueError: `n` not one count >= 1 per task.
    """

    tasks: tuple[str, ...]
    n: tuple[int, ...]
    model: str
    drop_ratios: tuple[float, ...]
    context_lengths: tuple[int, ...]
    modes: tuple[str, ...] = MODES

    def __post_init__(self):
        if len(self.n) != len(self.tasks) or any(int(k) < 1 for k in self.n):
            raise ValueError(f"Grid: give one n >= 1 per task ({len(self.tasks)} tasks), got {self.n}")

    @property
    def task_n(self) -> dict[str, int]:
        """`{task: n}`."""
        return dict(zip(self.tasks, (int(k) for k in self.n)))

    def policies(self) -> list[str]:
        """`"full"` and every registered policy that selects one set per request (in registration order, those a
        user registered in this process too); policies that only select per KV head because they move budget
        between heads or layers (`Policy.per_head_only`: AdaKV, PyramidKV) are left out."""
        return [FULL, *(p for p in policy_names() if not get_policy(p).per_head_only)]

    def dtype(self) -> tuple[str, str]:
        """`(dtype, why)`: `"bfloat16"` where the model will run on a GPU (`eval` opens it on CUDA when there is
        one) or on a CPU with native bfloat16 (`tdutils.engines.hf.cpu_has_native_bf16`), else `"float32"`."""
        if torch.cuda.is_available():
            return "bfloat16", "there is a GPU"
        if cpu_has_native_bf16():
            return "bfloat16", "this CPU computes bfloat16 natively"
        return "float32", "this CPU has no native bfloat16 (torch would emulate it, slower than float32)"


LEADERBOARD = Grid(
    tasks=("ruler_niah_single_1", "ruler_niah_multikey_1", "ruler_niah_multivalue_partial", "text_fidelity"),
    n=(100, 100, 100, 32), model="smollm2-135m", drop_ratios=(0.5, 0.75, 0.9), context_lengths=(2048,))

__all__ = ["LEADERBOARD", "LEADERBOARD_WORD", "Grid"]
