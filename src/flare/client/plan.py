"""A client's round, planned once before its first step, and the round's step logs: what both client engines run.

The sequential (and threads) engine (`Client.train_round`) and the batched engine (`BatchedClients.train_round`)
differ in how a step is computed, not in what a client does in a round. That lives here, so the two engines cannot
drift apart: the random streams (`derived_seed(seed, r, i, purpose)`), steps per epoch and batch order, each step's
clock, progress p and lr, the plain or two augmented views, and how the step logs are summed, judged and averaged.

Where the augmentation runs (`augment.schedule`): `per_batch` (the default) gathers each step's batch and calls the
augmentation on it; `chunked` gathers a run of consecutive batches of an epoch at once (as many as fit
`CHUNK_ELEMENTS`), augments it in one call over every step's images twice — [b; b], step after step, so the call's
output is already the steps' [v1; v2] layout — and lets every step slice its input out of the result without a copy.
Small models at small batches spend most of a step in the augmentation's per-call work (parameter sampling, kornia's
host reads of device values, dozens of small kernels), which one larger call pays once (airbench's way of feeding a
small network). The images, their order and the streams are the per_batch ones; the draws are not (kornia draws a
chunk's parameters in one go, and ColorJitter's order of its four steps once per call: per chunk, for both views).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from flare.config import Config
from flare.errors import TrainingDiverged
from flare.rng import RngStreams, augmentation_generators, derived_seed
from flare.registry import PROGRESS
from flare.schedules import ProgressFacts, StepProgress

# derived_seed(seed, r, i, purpose, ...): the purposes of a client-round's streams
_AUGMENT, _ORDER = 1, 2

# augment.schedule=chunked: at most this many elements in one augmentation call (both views: 4 MB of float32), and
# at least one batch. Not the whole epoch: kornia's ops are chains of elementwise passes, and once a call's tensors
# outgrow the caches a larger call costs more per image. Measured (CPU seconds per image, 1 thread, the SupCon
# policy): 1x28x28 images fastest in calls of 512-1024 images (2.8x the rate of calls of 64; calls of 2048 ran at
# 0.54x the best), 3x32x32 in calls of 512 (4096 cost 1.45x per image).
CHUNK_ELEMENTS = 1 << 20


def steps_per_epoch(num_samples: int, cfg: Config) -> int:
    """ceil(n/B); floor(n/B) with drop_last (the official loader: a client with n < B trains no step)."""
    B = cfg.batch_size
    return num_samples // B if cfg.drop_last else math.ceil(num_samples / B)


def run_progress(cfg: Config) -> StepProgress:
    """The run's `progress`, built once (`TrainContext.progress`)."""
    return PROGRESS.create(cfg.progress, ProgressFacts(cfg.local_epochs, cfg.total_epochs))


def progress_at(progress: StepProgress, cfg: Config, epoch: int, batch: int, spe: int,
                epochs_done: int) -> tuple[float, float]:
    """(p of λ annealing / s(p), p of V8's target) at step `batch` of the round's epoch `epoch`, `epochs_done`
    epochs completed before it (`progress`, the run's built `progress`; `align.target_progress`)."""
    p = progress(epoch, batch, spe, epochs_done)
    return p, (epoch / cfg.local_epochs if cfg.align.target_progress == "round-reset" else p)


@dataclass(frozen=True)
class Step:
    epoch: int       # the round's epoch
    batch: int       # the step within the epoch
    clock: float     # epochs since training began, fractional: the lr schedule's t
    p: float         # progress of λ annealing / s(p)
    p_target: float  # progress of V8's moving target
    lr: float


class RoundPlan:
    """One client's round r: its augmentation streams, its batch order (E permutations from its order generator,
    drawn before the first step), and every step's clock, progress and lr. `client` needs `cid`, `indices`,
    `num_samples` and `epochs_done` (the epochs it completed before this round)."""

    def __init__(self, client, ctx, round_idx: int):
        cfg = ctx.cfg
        self.round_idx = round_idx
        self.B, self.E, self.n = cfg.batch_size, cfg.local_epochs, client.num_samples
        self.spe = steps_per_epoch(self.n, cfg)
        # one un-augmented view per step (the reference's CE baselines) instead of two augmented ones
        self.plain = cfg.loss.objective == "ce" and cfg.loss.ce_input == "plain"
        # the augmentation's streams: the CPU generator's seed (…, 1), on CUDA the GPU's (…, 1, 1)
        gens = augmentation_generators(ctx.device)
        self.streams = RngStreams(gens, [derived_seed(cfg.seed, round_idx, client.cid, _AUGMENT, *([k] if k else []))
                                         for k in range(len(gens))])
        order = torch.Generator().manual_seed(derived_seed(cfg.seed, round_idx, client.cid, _ORDER))
        perms = torch.cat([torch.randperm(self.n, generator=order) for _ in range(self.E)])
        self.samples = client.indices[perms.to(client.indices.device)]  # E·n sample ids, epoch after epoch
        self.steps: list[Step] = []
        for e in range(self.E):
            done = client.epochs_done + e
            for b in range(self.spe):
                clock = done + b / self.spe
                p, p_target = progress_at(ctx.progress, cfg, e, b, self.spe, done)
                self.steps.append(Step(e, b, clock, p, p_target, ctx.lr_schedule(clock, round_idx)))
        self.last_lr = self.steps[-1].lr if self.steps else cfg.base_lr  # the record's lr
        self.chunked = cfg.augment.schedule == "chunked" and not self.plain
        # the chunk the steps slice now: (epoch, first batch, views, labels)
        self._chunk: tuple[int, int, Tensor, Tensor] | None = None

    def epoch_steps(self, epoch: int) -> range:
        return range(epoch * self.spe, (epoch + 1) * self.spe)

    def size(self, t: int) -> int:
        """The number of samples of step t (B, or fewer in a ragged last batch)."""
        return min(self.B, self.n - self.steps[t].batch * self.B)

    def batch(self, t: int) -> Tensor:
        """The sample ids of step t (a slice: no copy, no sync)."""
        s = self.steps[t]
        start = s.epoch * self.n + s.batch * self.B
        return self.samples[start:start + self.size(t)]

    def views(self, ctx, t: int) -> tuple[Tensor, Tensor]:
        """Step t's input and labels: the two augmented views [v1; v2] drawn from this client-round's streams and
        the labels twice, or (`plain`) the evaluation transform's one view and the labels."""
        if self.chunked:
            return self._chunk_views(ctx, t)
        idx = self.batch(t)
        xb, yb = ctx.train_x[idx], ctx.train_y[idx]
        if self.plain:
            if ctx.plain is None:
                raise RuntimeError("loss.ce_input=plain needs TrainContext.plain (the evaluation transform)")
            return ctx.plain(xb), yb
        with self.streams.active():
            v1, v2 = ctx.augment(xb)
        return torch.cat([v1, v2]), torch.cat([yb, yb])

    def _chunk_views(self, ctx, t: int) -> tuple[Tensor, Tensor]:
        """Step t's [v1; v2] and labels, sliced out of its chunk's views (augmented when the chunk is first reached;
        the module docstring). Chunks are fixed runs of batches of an epoch, so the draws do not depend on who asks."""
        s = self.steps[t]
        per = self.chunk_batches(ctx.train_x[0].numel())
        first = s.batch // per * per
        if self._chunk is None or self._chunk[:2] != (s.epoch, first):
            t0 = t - (s.batch - first)
            idx = torch.cat([self.batch(u) for u in range(t0, t0 + min(per, self.spe - first)) for _ in (0, 1)])
            with self.streams.active():
                views = ctx.augment.single_view(ctx.train_x[idx])
            self._chunk = (s.epoch, first, views, ctx.train_y[idx])
        _, first, views, labels = self._chunk
        lo = 2 * (s.batch - first) * self.B
        hi = lo + 2 * self.size(t)
        return views[lo:hi], labels[lo:hi]

    def chunk_batches(self, elements_per_image: int) -> int:
        """How many consecutive batches of an epoch one chunked augmentation call (both views) covers."""
        return max(1, CHUNK_ELEMENTS // max(1, 2 * elements_per_image * self.B))


class RoundLogs:
    """The step logs of a round for clients `cids`: one row per (client, epoch), row i·E + e, summed on the device
    (no sync per step), with the step at which each entry first went non-finite, so a NaN is blamed on the term where
    it started, not on the terms it contaminated afterwards. The sequential engine closes an epoch's row when the
    epoch ends (so it stops at the first diverged epoch), the batched engine all rows when the round ends."""

    def __init__(self, cids: list[int], epochs: int, round_idx: int, device: torch.device):
        self.cids, self.E, self.round_idx, self.device = list(cids), epochs, round_idx, device
        self.keys: list[str] | None = None
        self.sum: Tensor | None = None
        self.first_bad: Tensor | None = None
        self.totals: list[dict[str, float]] = [{} for _ in self.cids]

    def add(self, logs: dict[str, Tensor], rows: slice | Tensor, batch: int | Tensor) -> None:
        """Add one step's logs — 0-d tensors of one client, or vectors of k clients under vmap — to their rows (a
        slice of one row, or a k-vector of rows), at the step `batch` within the epoch (an int, or a k-vector)."""
        if self.keys is None:
            self.keys = list(logs)
            # −0.0, the exact identity of float addition: a row's sum is its first step's value bit for bit
            self.sum = torch.full((len(self.cids) * self.E, len(self.keys)), -0.0, device=self.device)
            self.first_bad = torch.full(self.sum.shape, -1, dtype=torch.long, device=self.device)
        elif list(logs) != self.keys:
            raise RuntimeError(f"step logs changed keys within a round: {self.keys} -> {list(logs)}")
        v = torch.stack([t.float().reshape(-1) for t in logs.values()], dim=1)  # k × keys
        if isinstance(batch, Tensor):
            batch = batch[:, None]
        self.sum[rows] += v
        cur = self.first_bad[rows]
        self.first_bad[rows] = torch.where(~torch.isfinite(v) & (cur < 0), batch, cur)

    def close(self, rows: range) -> None:
        """Read `rows` (one device sync), stop at the first non-finite entry in row order, add them to their clients'
        totals. Nothing to read before the first step (no client trained a step yet)."""
        if self.keys is None:
            return
        sums = self.sum[rows.start:rows.stop].tolist()
        first = self.first_bad[rows.start:rows.stop].tolist()
        for row, s, f in zip(rows, sums, first):
            i, e = divmod(row, self.E)
            if bad := [(step, j) for j, step in enumerate(f) if step >= 0]:
                step, j = min(bad)
                raise TrainingDiverged(
                    f"loss term '{self.keys[j]}' became {s[j]} for client {self.cids[i]} in round "
                    f"{self.round_idx + 1} (epoch step {step}); the run stopped here and the metrics of earlier "
                    "rounds are intact.",
                    key="lr", fix="lower lr, keep optim.grad_clip on, or check the λ settings of this method.")
            for k, v in zip(self.keys, s):
                self.totals[i][k] = self.totals[i].get(k, 0.0) + v

    def means(self, i: int, steps: int) -> dict[str, float]:
        """Client i's logs averaged over its `steps` steps of the round (none without a step)."""
        return {k: v / steps for k, v in self.totals[i].items()} if steps else {}
