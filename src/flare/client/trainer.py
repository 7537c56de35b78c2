"""The local loop: batch → two views → model → loss terms → λ → backward → step.

The trainer never asks "is this V7?": it composes the parts the config picked — the objective's terms,
the anchors and their target, a λ provider, gradient surgery, a contrast extension — and logs every
named loss as it is. Data stays on the training device; a batch is a gather by index.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from torch.profiler import record_function

from flare.client.lam import LamProvider, make_lam_provider
from flare.client.step import local_loss
from flare.client.terms.align import align_target
from flare.config import Config
from flare.errors import TrainingDiverged
from flare.registry import SURGERY
from flare.rng import RngStreams, augmentation_generators, derived_seed
from flare.schedules import LRSchedule, progress
from flare.server.upload import Upload


@dataclass
class TrainContext:
    """What every client of a run shares (read-only during training)."""

    cfg: Config
    train_x: Tensor           # uint8 N×C×H×W on the training device
    train_y: Tensor           # int64 N on the training device
    augment: torch.nn.Module  # uint8 batch → (view1, view2), normalised
    anchors: Tensor | None    # C×d on the device, fixed by the server before training
    device: torch.device
    amp_dtype: torch.dtype | None
    lr_schedule: LRSchedule
    channels_last: bool = False               # NHWC inputs (decided once, by `setup.use_channels_last`)
    extension_factory: object | None = None  # builds a per-client contrast extension (banks)
    plain: Callable[[Tensor], Tensor] | None = None  # uint8 batch → the un-augmented input (loss.ce_input=plain)
    server_target: Tensor | None = None      # Plan B under protos_flow=reference: the server's G, set between rounds

    @property
    def align_anchors(self) -> Tensor | None:
        """What clients align to: the server's G when it sends one, else the fixed anchors."""
        return self.server_target if self.server_target is not None else self.anchors

    @property
    def total_epochs(self) -> int:
        return self.cfg.total_epochs


class StepLogs:
    """Per-epoch sums of the step logs, kept on the device as one vector (no sync per step), plus the
    first step at which each entry went non-finite — so a NaN is blamed on the term where it started,
    not on the terms it contaminated afterwards. The batched engine keeps the same sums for all clients in
    one table and hands each client-epoch's row to `of` so that both engines judge and report alike."""

    def __init__(self):
        self.keys: list[str] | None = None
        self.sum: Tensor | None = None
        self.first_bad: Tensor | None = None

    @classmethod
    def of(cls, keys: list[str], sums: Tensor, first_bad: Tensor) -> "StepLogs":
        acc = cls()
        acc.keys, acc.sum, acc.first_bad = list(keys), sums, first_bad
        return acc

    def add(self, logs: dict[str, Tensor], step: int) -> None:
        if self.keys is None:
            self.keys = list(logs)
        elif list(logs) != self.keys:
            raise RuntimeError(f"step logs changed keys within an epoch: {self.keys} -> {list(logs)}")
        v = torch.stack([t.float().reshape(()) for t in logs.values()])
        bad = ~torch.isfinite(v)
        if self.sum is None:
            self.sum = v.clone()
            self.first_bad = torch.where(bad, step, -1)
        else:
            self.sum += v
            self.first_bad = torch.where(bad & (self.first_bad < 0), step, self.first_bad)

    def finish(self, cid: int, round_idx: int) -> dict[str, float]:
        if self.keys is None:
            return {}
        sums, first = self.sum.tolist(), self.first_bad.tolist()  # one device sync per epoch
        bad = [(f, i) for i, f in enumerate(first) if f >= 0]
        if bad:
            f, i = min(bad)
            raise TrainingDiverged(
                f"loss term '{self.keys[i]}' became {sums[i]} for client {cid} in round {round_idx + 1} "
                f"(epoch step {f}); the run stopped here and the metrics of earlier rounds are intact.",
                key="lr", fix="lower lr, keep optim.grad_clip on, or check the λ settings of this method.")
        return dict(zip(self.keys, sums))


class Client:
    """One federated client: its data indices, its model (never replaced by a server model), its
    optimizer and λ provider. `upload()` is all the server ever sees."""

    def __init__(self, cid: int, indices: Tensor, model: torch.nn.Module, ctx: TrainContext,
                 normalized_entropy: float):
        self.cid = cid
        self.indices = indices
        self.num_samples = int(indices.numel())
        self.normalized_entropy = normalized_entropy
        self.model = model
        self.cfg = ctx.cfg
        self.lam: LamProvider = make_lam_provider(ctx.cfg, normalized_entropy, ctx.device)
        self.optimizer: torch.optim.Optimizer | None = None
        self.epochs_done = 0
        protos = getattr(model, "prototypes", None)
        self.initial_prototypes = protos.detach().clone() if protos is not None else None
        self.extension = ctx.extension_factory(self, ctx) if ctx.extension_factory else None
        self._sgdr_cycle = 0
        self._p_target: float | None = None  # V8 target progress of the current step (align.target_progress)

    # -- optimisation -------------------------------------------------------------------------
    def _make_optimizer(self) -> torch.optim.Optimizer:
        o = self.cfg.optim
        kw = {}
        if self.model_device.type == "cuda":
            kw["fused"] = True  # one kernel for the whole update (torch ≥ 2.0 for SGD on CUDA)
        return torch.optim.SGD(self.model.parameters(), lr=self.cfg.base_lr, momentum=o.momentum,
                               weight_decay=o.weight_decay, **kw)

    @property
    def model_device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def steps_per_epoch(self) -> int:
        """ceil(n/B); floor(n/B) with drop_last (the official loader: a client with n < B trains no step)."""
        B = self.cfg.batch_size
        return self.num_samples // B if self.cfg.drop_last else math.ceil(self.num_samples / B)

    def progress_at(self, ctx: TrainContext, j: int, b: int, steps_per_epoch: int,
                    epochs_done: int | None = None) -> tuple[float, float]:
        """(p of λ annealing / s(p), p of V8's target) at step b of the round's epoch j (`progress`,
        `align.target_progress`); `epochs_done` counts the epochs completed before this one (the client's own
        count by default; the batched engine plans a whole round ahead)."""
        mode, E = self.cfg.progress, self.cfg.local_epochs
        done = self.epochs_done if epochs_done is None else epochs_done
        if mode == "step":
            p = progress(done + b / steps_per_epoch, ctx.total_epochs)
        elif mode == "round-reset":  # the reference's first batch: (e − start_epoch)/E, restarting every round
            p = j / E
        elif mode == "epoch-end":    # (e+1)/(R·E): V12's logged s(p) = 1 − (r+1)/R
            p = progress(done + 1, ctx.total_epochs)
        else:
            p = progress(done, ctx.total_epochs)
        return p, (j / E if self.cfg.align.target_progress == "round-reset" else p)

    # -- one round of local training ------------------------------------------------------------
    def train_round(self, ctx: TrainContext, round_idx: int, on_step=None) -> dict:
        cfg = self.cfg
        t0 = time.perf_counter()
        if self.optimizer is None or cfg.optim.reset_each_round:
            self.optimizer = self._make_optimizer()
        # The augmentation's streams: CPU derived_seed(seed, r, i, 1), the GPU's (on CUDA) derived_seed(seed, r, i, 1, 1).
        gens = augmentation_generators(ctx.device)
        self._aug_streams = RngStreams(gens, [derived_seed(cfg.seed, round_idx, self.cid, 1, *([k] if k else []))
                                              for k in range(len(gens))])
        order_gen = torch.Generator().manual_seed(derived_seed(cfg.seed, round_idx, self.cid, 2))
        self.model.train()
        steps_per_epoch = self.steps_per_epoch
        sums: dict[str, float] = {}
        steps = 0
        lr = self.cfg.base_lr
        for j in range(cfg.local_epochs):
            perm = torch.randperm(self.num_samples, generator=order_gen).to(self.indices.device)
            acc = StepLogs()
            for b in range(steps_per_epoch):
                p, self._p_target = self.progress_at(ctx, j, b, steps_per_epoch)
                lr = self._set_lr(ctx, round_idx, self.epochs_done + b / steps_per_epoch)
                idx = self.indices[perm[b * cfg.batch_size:(b + 1) * cfg.batch_size]]
                acc.add(self._step(ctx, idx, p), b)
                steps += 1
                if on_step is not None:
                    on_step()
            epoch_sums = acc.finish(self.cid, round_idx)
            for k, v in epoch_sums.items():
                sums[k] = sums.get(k, 0.0) + v
            self.epochs_done += 1
        return self.round_record(ctx, round_idx, lr, steps, sums, time.perf_counter() - t0)

    def round_record(self, ctx: TrainContext, round_idx: int, lr: float, steps: int, sums: dict[str, float],
                     seconds: float) -> dict:
        """The client's metrics record of a round (both engines write it through here)."""
        record = {"kind": "client", "round": round_idx, "client": self.cid, "num_samples": self.num_samples,
                  "normalized_entropy": self.normalized_entropy, "lr": lr, "steps": steps,
                  "progress": progress(self.epochs_done, ctx.total_epochs)}
        record.update({k: v / steps for k, v in sums.items()} if steps else {})
        record.update(self.lam.state_logs())
        record["seconds"] = seconds
        return record

    def _set_lr(self, ctx: TrainContext, round_idx: int, t: float) -> float:
        sched = ctx.lr_schedule
        lr = sched(t, round_idx)
        if sched.kind == "sgdr" and self.cfg.lr_schedule.reset_momentum:
            cyc = sched.cycle(t)[0]
            if cyc != self._sgdr_cycle:
                self._sgdr_cycle = cyc
                for st in self.optimizer.state.values():
                    st.pop("momentum_buffer", None)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def _step(self, ctx: TrainContext, idx: Tensor, p: float) -> dict[str, Tensor]:
        """One optimisation step at progress p (V8's target reads `self._p_target`, set by `train_round`)."""
        cfg = self.cfg
        xb, yb = ctx.train_x[idx], ctx.train_y[idx]
        amp = (torch.autocast(device_type=ctx.device.type, dtype=ctx.amp_dtype)
               if ctx.amp_dtype is not None else nullcontext())
        plain = cfg.loss.objective == "ce" and cfg.loss.ce_input == "plain"
        with amp:
            if plain:  # the reference's baselines: one un-augmented view, CE
                if ctx.plain is None:
                    raise RuntimeError("loss.ce_input=plain needs TrainContext.plain (the evaluation transform)")
                imgs, y2 = ctx.plain(xb), yb
            else:
                with record_function("flare.augment"), self._aug_streams.active():
                    v1, v2 = ctx.augment(xb)
                imgs, y2 = torch.cat([v1, v2]), torch.cat([yb, yb])
            if ctx.channels_last:
                imgs = imgs.contiguous(memory_format=torch.channels_last)
            with record_function("flare.forward"):
                feat, logits = self.model(imgs)
        with record_function("flare.loss"):
            target = None
            if ctx.anchors is not None:
                p_target = p if self._p_target is None else self._p_target
                target = align_target(ctx.align_anchors, cfg.align.target, p_target, self.initial_prototypes)
            loss = local_loss(cfg, feat, logits, y2, self.model.prototypes, target=target,
                              weigh=lambda base, align: self.lam(base, align, p), extension=self.extension,
                              epoch=self.epochs_done)
            st = loss.lam

        self.optimizer.zero_grad(set_to_none=True)
        params = [q for q in self.model.parameters() if q.requires_grad]
        with record_function("flare.backward"):
            surgery = SURGERY.get(cfg.align.surgery)  # (local, align, params, extra) -> logs; None: plain
            if surgery is not None and st.align is not None:
                surgery_logs = surgery(st.local, st.align, params, extra=st.sigma)
            else:
                loss.total().backward()
                surgery_logs = {}
        with record_function("flare.optimizer"):
            if cfg.optim.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
            self.optimizer.step()
            self.lam.step()
        if self.extension is not None:
            self.extension.after_step(feat.detach(), y2)

        logs = loss.logs()
        logs.update(surgery_logs)
        return logs

    # -- what the server sees, and checkpoints ------------------------------------------------
    def upload(self, extras: dict[str, Tensor] | None = None) -> Upload:
        """What the server sees; `extras`: the statistics its strategies asked for (server/extras.py)."""
        protos = getattr(self.model, "prototypes", None)
        return Upload(client=self.cid, state=self.model.state_dict(), num_samples=self.num_samples,
                      prototypes=protos.detach() if protos is not None else None, extras=dict(extras or {}))

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "lam": self.lam.state_dict(),
            "epochs_done": self.epochs_done,
            "sgdr_cycle": self._sgdr_cycle,
            "extension": self.extension.state_dict() if self.extension is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        if state["optimizer"] is not None:
            self.optimizer = self._make_optimizer()
            self.optimizer.load_state_dict(state["optimizer"])
        self.lam.load_state_dict(state["lam"])
        self.epochs_done = int(state["epochs_done"])
        self._sgdr_cycle = int(state.get("sgdr_cycle", 0))
        if self.extension is not None and state.get("extension") is not None:
            self.extension.load_state_dict(state["extension"])
