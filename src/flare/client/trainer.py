"""The local loop: batch → two views → model → loss terms → λ → backward → step.

The trainer never asks "is this V7?": it composes the parts the config picked — the objective's terms,
the anchors and their target, a λ provider, gradient surgery, a contrast extension — and logs every
named loss as it is. Data stays on the training device; a batch is a gather by index. What a client does in a
round — its random streams, batch order, per-step progress and lr, views, and how its logs are summed and averaged
— is its `RoundPlan` (client/plan.py), the plan the batched engine runs too.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor
from torch.profiler import record_function

from flare.client.lam import LamProvider, lam_facts
from flare.client.plan import RoundLogs, RoundPlan, Step, run_progress, steps_per_epoch
from flare.client.step import local_loss
from flare.client.terms.extra import uses_params
from flare.client.terms.align import align_target
from flare.config import Config
from flare.registry import CLIENT_ENGINES, LAM_PROVIDERS, SURGERY, NoFacts
from flare.schedules import LRSchedule, StepProgress, progress
from flare.server.upload import Upload, upload_of


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
    channels_last: bool = False               # NHWC inputs (decided once, by `backend.use_channels_last`)
    extension_factory: object | None = None  # builds a per-client contrast extension (banks)
    plain: Callable[[Tensor], Tensor] | None = None  # uint8 batch → the un-augmented input (loss.ce_input=plain)
    # what the server sent with this round's training message (`Strategy.configure_train`), set between rounds
    received: dict[str, Tensor] = field(default_factory=dict)
    # the run's per-step parts, each built once from the config here (`progress`, `align.surgery`; None: none)
    progress: StepProgress = field(init=False)
    surgery: Callable | None = field(init=False)

    def __post_init__(self) -> None:
        self.progress = run_progress(self.cfg)
        self.surgery = SURGERY.create(self.cfg.align.surgery, NoFacts())

    @property
    def align_anchors(self) -> Tensor | None:
        """What clients align to: the target the server sent (`align_target`), else the fixed anchors."""
        return self.received.get("align_target", self.anchors)


@CLIENT_ENGINES.register("sequential", description="one client after another")
@CLIENT_ENGINES.register("threads", description="one thread per client, each on its own CUDA stream")
class Client:
    """One federated client: its data indices, its model (never replaced by a server model), its optimizer and λ
    provider. `upload()` is all the server ever sees. Its `train_round` is the sequential and threads engines' round."""

    @staticmethod
    def check(cfg: Config) -> None:
        """What the sequential and threads engines cannot run: nothing (every part is written for them)."""

    def __init__(self, cid: int, indices: Tensor, model: torch.nn.Module, ctx: TrainContext, normalized_entropy: float):
        self.cid, self.indices, self.model, self.cfg = cid, indices, model, ctx.cfg
        self.num_samples, self.normalized_entropy = int(indices.numel()), normalized_entropy
        self.lam: LamProvider = LAM_PROVIDERS.create(ctx.cfg.lam.learner, lam_facts(ctx.cfg, normalized_entropy,
                                                                                 ctx.device), ctx.cfg.lam.options)
        self.optimizer: torch.optim.Optimizer | None = None
        self.epochs_done = 0
        protos = getattr(model, "prototypes", None)
        self.initial_prototypes = protos.detach().clone() if protos is not None else None
        # the model the client started from (FedProx's w_global), kept only when a loss term reads weights
        self.start_params = ({n: q.detach().clone() for n, q in model.named_parameters() if q.requires_grad}
                             if uses_params(ctx.cfg.loss) else None)
        self.extension = ctx.extension_factory(self, ctx) if ctx.extension_factory else None
        self._sgdr_cycle = 0

    # -- optimisation -------------------------------------------------------------------------
    def _make_optimizer(self) -> torch.optim.Optimizer:
        o = self.cfg.optim
        fused = True if next(self.model.parameters()).device.type == "cuda" else None  # CUDA: one kernel per update
        return torch.optim.SGD(self.model.parameters(), lr=self.cfg.base_lr, momentum=o.momentum,
                               weight_decay=o.weight_decay, fused=fused)

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.num_samples, self.cfg)

    # -- one round of local training: the round's plan (client/plan.py), step by step ------------
    def train_round(self, ctx: TrainContext, round_idx: int, on_step=None) -> dict:
        t0 = time.perf_counter()
        if self.optimizer is None or self.cfg.optim.reset_each_round:
            self.optimizer = self._make_optimizer()
        plan = RoundPlan(self, ctx, round_idx)
        logs = RoundLogs([self.cid], plan.E, round_idx, ctx.device)
        # eval mode after `train_mode_epochs` epochs: a reference loop that evaluates every epoch and never calls
        # `model.train()` again trains the rest in eval mode, and reproducing its numbers means doing the same
        n = self.cfg.train_mode_epochs
        for e in range(plan.E):
            self.model.train(n is None or self.epochs_done < n)
            for t in plan.epoch_steps(e):
                self._set_lr(ctx, plan.steps[t])
                logs.add(self._step(ctx, plan, t), slice(e, e + 1), plan.steps[t].batch)
                if on_step is not None:
                    on_step()
            logs.close(range(e, e + 1))
            self.epochs_done += 1
        return self.round_record(plan, logs.means(0, len(plan.steps)), time.perf_counter() - t0)

    def round_record(self, plan: RoundPlan, means: dict[str, float], seconds: float) -> dict:
        """The client's metrics record of a round (both engines write it through here): `means`, its step logs
        averaged over the round (`RoundLogs.means`)."""
        return {"kind": "client", "round": plan.round_idx, "client": self.cid, "num_samples": self.num_samples,
                "normalized_entropy": self.normalized_entropy, "lr": plan.last_lr, "steps": len(plan.steps),
                "progress": progress(self.epochs_done, self.cfg.total_epochs), **means, **self.lam.state_logs(),
                "seconds": seconds}

    def _set_lr(self, ctx: TrainContext, step: Step) -> None:
        sched = ctx.lr_schedule
        if sched.kind == "sgdr" and self.cfg.lr_schedule.reset_momentum:
            cyc = sched.cycle(step.clock)[0]
            if cyc != self._sgdr_cycle:
                self._sgdr_cycle = cyc
                for st in self.optimizer.state.values():
                    st.pop("momentum_buffer", None)
        for g in self.optimizer.param_groups:
            g["lr"] = step.lr

    def _step(self, ctx: TrainContext, plan: RoundPlan, t: int) -> dict[str, Tensor]:
        """Step t of the round's plan: one optimisation step."""
        cfg, step = self.cfg, plan.steps[t]
        amp = (torch.autocast(device_type=ctx.device.type, dtype=ctx.amp_dtype)
               if ctx.amp_dtype is not None else nullcontext())
        with amp:
            with record_function("flare.augment"):
                imgs, y2 = plan.views(ctx, t)
            if ctx.channels_last:
                imgs = imgs.contiguous(memory_format=torch.channels_last)
            with record_function("flare.forward"):
                feat, logits = self.model(imgs)
        with record_function("flare.loss"):
            target = (align_target(ctx.align_anchors, cfg.align.target, step.p_target, self.initial_prototypes)
                      if ctx.anchors is not None else None)
            params = (dict((n, q) for n, q in self.model.named_parameters() if q.requires_grad)
                      if self.start_params is not None else None)
            loss = local_loss(cfg, feat, logits, y2, self.model.prototypes, target=target,
                              weigh=lambda base, align: self.lam(base, align, step.p), extension=self.extension,
                              epoch=self.epochs_done, params=params, start=self.start_params)
            st = loss.lam

        self.optimizer.zero_grad(set_to_none=True)
        params = [q for q in self.model.parameters() if q.requires_grad]
        with record_function("flare.backward"):
            if ctx.surgery is not None and st.align is not None:  # (local, align, params, extra) -> logs
                surgery_logs = ctx.surgery(st.local, st.align, params, extra=st.sigma)
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

        return {**loss.logs(), **surgery_logs}

    # -- what the server sees, and checkpoints ------------------------------------------------
    def upload(self, extras: dict[str, Tensor] | None = None) -> Upload:
        """What the server sees; `extras`: the statistics its strategies asked for (server/extras.py)."""
        return upload_of(self.cid, self.model, self.num_samples, extras)

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "lam": self.lam.state_dict(), "epochs_done": self.epochs_done, "sgdr_cycle": self._sgdr_cycle,
                "extension": self.extension.state_dict() if self.extension is not None else None}

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
