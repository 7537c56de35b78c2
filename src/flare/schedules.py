"""Schedules: pure functions of training progress.

One abstraction serves λ annealing a(p), the meta-annealing s(p) of the λ learner, and the local
learning rate (docs/method.md#schedules). `p` runs once from 0 to 1 over the *whole* local training (all rounds),
never per round — the seeds' saw-tooth was a bug."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Protocol

from flare.registry import PROGRESS, SCHEDULES, NoFacts


class ScheduleFn(Protocol):
    """What `SCHEDULES` holds: built by `SCHEDULES.create` (align.schedule, lam.anneal), a(p) of progress
    p ∈ [0, 1]."""
    def __call__(self, facts: NoFacts, options: None) -> Callable[[float], float]: ...


def _schedule(name: str, a: Callable[[float], float], description: str) -> None:
    SCHEDULES.register(name, lambda facts, options: a, description=description)


_schedule("constant", lambda p: 1.0, "a(p) = 1")
_schedule("linear", lambda p: 1.0 - p, "a(p) = 1 − p")
_schedule("cosine", lambda p: 0.5 * (1.0 + math.cos(math.pi * p)), "a(p) = ½(1 + cos πp)")


def progress(epochs_done: float, total_epochs: int) -> float:
    """p = e / (R·E), clamped to [0, 1]."""
    return min(max(epochs_done / total_epochs, 0.0), 1.0)


@dataclass(frozen=True)
class ProgressFacts:
    """What a progress function is built from: E (`local_epochs`) and R·E (`total_epochs`)."""
    local_epochs: int
    total_epochs: int


StepProgress = Callable[[int, int, int, int], float]  # (epoch, batch, steps_per_epoch, epochs_done) -> p


class ProgressFn(Protocol):
    """What `PROGRESS` holds (the config's `progress`), built by `PROGRESS.create`: p of λ annealing and s(p) at step
    `batch` (of `steps_per_epoch`) of the round's epoch `epoch`, `epochs_done` epochs completed before it.
    `spans_the_run` (read when the config is validated): whether p runs over the whole training (so it changes with
    `rounds`) rather than restarting every round."""
    spans_the_run: bool

    def __call__(self, facts: ProgressFacts, options: None) -> StepProgress: ...


def _progress(name: str, p: Callable[..., float], description: str, spans_the_run: bool = True) -> None:
    """Register the progress `name`: p(facts, epoch, batch, steps_per_epoch, epochs_done) at a step, and whether it
    spans the run."""
    def build(facts: ProgressFacts, options: None) -> StepProgress:
        return functools.partial(p, facts)
    build.spans_the_run = spans_the_run
    PROGRESS.register(name, build, description=description)


_progress("epoch", lambda f, e, b, spe, done: progress(done, f.total_epochs), "e/(R·E), e the completed epochs (ours)")
_progress("step", lambda f, e, b, spe, done: progress(done + b / spe, f.total_epochs),
          "Per step: (e + b/steps)/(R·E)")
_progress("round-reset", lambda f, e, b, spe, done: e / f.local_epochs,
          "j/E, j the epoch within the round: the reference's first batch (λ constant when E = 1)", spans_the_run=False)
_progress("epoch-end", lambda f, e, b, spe, done: progress(done + 1, f.total_epochs),
          "(e+1)/(R·E): V12's logged s(p) = 1 − (r+1)/R (the reference's learned-λ runs)")


class LRSchedule:
    """Local learning rate as a function of (round, epoch-progress).

    `t` is measured in local epochs since the start of training (fractional with per-step progress),
    `T = R·E` in total.
      constant: η = η0 · decay_per_round^round
      cosine:   η = η_min + ½(η0 − η_min)(1 + cos(π t/T))
      sgdr:     cosine within cycles of length T0, T0·T_mult, T0·T_mult², …; the peak is multiplied by
                `cycle_decay` at every restart (Robbins–Monro friendly when < 1)."""

    def __init__(self, kind: str, base_lr: float, total_epochs: int, *, decay_per_round: float = 1.0,
                 min_lr: float = 0.0, t0: float = 10.0, t_mult: float = 2.0, cycle_decay: float = 1.0):
        self.kind, self.base_lr, self.total = kind, base_lr, total_epochs
        self.decay_per_round, self.min_lr = decay_per_round, min_lr
        self.t0, self.t_mult, self.cycle_decay = t0, t_mult, cycle_decay

    def cycle(self, t: float) -> tuple[int, float, float]:
        """SGDR: (cycle index, time within cycle, cycle length) at epoch-time t."""
        i, start, length = 0, 0.0, self.t0
        while t >= start + length - 1e-12:
            start += length
            length *= self.t_mult
            i += 1
        return i, t - start, length

    def __call__(self, t: float, round_idx: int) -> float:
        if self.kind == "constant":
            return self.base_lr * self.decay_per_round ** round_idx
        if self.kind == "cosine":
            frac = min(t / self.total, 1.0)
            return self.min_lr + 0.5 * (self.base_lr - self.min_lr) * (1 + math.cos(math.pi * frac))
        i, tc, length = self.cycle(t)
        peak = self.base_lr * self.cycle_decay ** i
        return self.min_lr + 0.5 * (peak - self.min_lr) * (1 + math.cos(math.pi * tc / length))
