"""FedDF (Lin et al., "Ensemble Distillation for Robust Model Fusion in Federated Learning", NeurIPS 2020) as a
one-shot server, `feddf`: the FedAvg of the uploads distilled from the clients' ensemble on the unlabeled public slice,
as the reference's `noise_knowledge_transfer` (epfml/federated-learning-public-code) — a fixed number of `steps`, the
last student, nothing selected on labels. The teacher, the loss, the optimiser and the departures:
docs/baselines.md, `feddf`.
"""
from __future__ import annotations

from itertools import chain, count
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from flare.baselines.kd import (Cost, agreement, client_logits, crop_flip, eval_mode, fresh_model, generator, kd_loss,
                                passes, public_slice, require_public)
from flare.errors import FlareError
from flare.models import layout
from flare.progress import Counter
from flare.rng import derived_seed
from flare.registry import STRATEGIES
from flare.server.rules import FedAvgRule, fedavg_model
from flare.server.strategy import ModelPredictor, ServerContext, Strategy

TAG = 2101  # this strategy's seed stream


class FedDFOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = Field(10000, ge=1, description="distillation batches (the reference's total_n_server_pseudo_batches "
                                                "cap; no early stopping on labels)")
    batch_size: int = Field(64, ge=1, description="public images per batch")
    lr: float = Field(1e-3, gt=0, description="Adam learning rate")
    temperature: float = Field(1.0, gt=0, description="KL temperature T")
    ensemble: Literal["logits", "softmax"] = Field(
        "logits", description="teacher: softmax(Σ w_k z_k / T) (avg_logits) or Σ w_k softmax(z_k) (avg_probs)")
    cosine: bool = Field(True, description="cosine-anneal the learning rate over the steps")
    clip: float | None = Field(5.0, gt=0, description="gradient-norm clip (null: none)")
    augment: bool = Field(True, description="random crop (4-pixel zero padding) and horizontal flip")


@STRATEGIES.register("feddf", options=FedDFOptions)
class FedDF(Strategy):
    """FedDF: the FedAvg model distilled from the weighted client ensemble on the server's unlabeled public slice."""

    every_round = False
    mixed_architectures = True  # the student is the server architecture (server.model)

    @classmethod
    def check(cls, cfg) -> None:  # at config validation: before any client trains
        require_public(cfg, "feddf")
        if cfg.data_kind != "images" and cls.options_in(cfg).augment:
            raise FlareError(f"server.strategies.feddf.augment=true crops and flips images; dataset.name="
                             f"{cfg.dataset.name} holds {cfg.data_kind}.", key="server.strategies.feddf.augment",
                             fix="set server.strategies.feddf.augment=false.")

    def predictor(self, ctx: ServerContext) -> ModelPredictor:
        with eval_mode(ctx.models), torch.enable_grad():  # frozen teachers; the student trains whatever the caller set
            return self._distil(ctx)

    def _start(self, ctx: ServerContext, pub) -> torch.nn.Module:
        """The student's start: the FedAvg of the uploads; with clients of different architectures (or a
        `server.model` of its own), the FedAvg of the clients that run the server architecture, or its fresh init
        when none does (FedDF distils each architecture from the average of its own clients)."""
        f = self.facts
        if not f.mixed_architectures and not f.server_model:
            return fedavg_model(ctx.models, ctx.weights, self.options_of(FedAvgRule).buffers)
        fresh = fresh_model(f, int(pub.shape[1]), int(ctx.models[0].num_classes),
                            derived_seed(f.seed, ctx.round, TAG, 2), ctx.device)
        own = [i for i, m in enumerate(ctx.models) if layout(m) == layout(fresh)]
        if not own:
            return fresh
        w = ctx.weights[own] / ctx.weights[own].sum()
        return fedavg_model([ctx.models[i] for i in own], w, self.options_of(FedAvgRule).buffers)

    def _distil(self, ctx: ServerContext) -> ModelPredictor:
        o, cost = self.options, Cost(ctx.device)
        pub = public_slice(ctx, "feddf")
        gen = generator(self.facts.seed, ctx.round, TAG)
        w = ctx.weights.to(ctx.device, torch.float32)
        student = self._start(ctx, pub).requires_grad_(True)
        plain = ctx.normalize(pub)
        before = agreement(student.eval(), ctx.models, w, plain)
        opt = torch.optim.Adam(student.parameters(), lr=o.lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, o.steps) if o.cosine else None
        student.train()
        losses = []
        with Counter(o.steps, desc="feddf", unit="step") as bar:  # 10,000 steps: minutes on a CPU
            # shuffled passes, each drawn when the last one ends (a DataLoader with shuffle=True), forever
            shuffled = chain.from_iterable(passes(pub.shape[0], o.batch_size, gen) for _ in count())
            for _, ix in zip(range(o.steps), shuffled):
                xb = pub[ix.to(pub.device)]
                x = ctx.normalize(crop_flip(xb, gen) if o.augment else xb)
                with torch.no_grad():
                    z = client_logits(ctx.models, x)  # K×B×C
                    teacher = ((w[:, None, None] * z).sum(0) if o.ensemble == "logits"
                               else (w[:, None, None] * z.softmax(-1)).sum(0))
                s = student(x)[1].float()
                loss = kd_loss(s, teacher, o.temperature, probs=o.ensemble == "softmax", scale=False)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if o.clip is not None:
                    torch.nn.utils.clip_grad_norm_(student.parameters(), o.clip)
                opt.step()
                if sched is not None:
                    sched.step()
                losses.append(float(loss.detach()))
                bar.update()
        student.eval().requires_grad_(False)
        logs = {**cost.logs(), "steps": float(len(losses)), "loss_first": losses[0], "loss_last": losses[-1],
                "agree_public_before": before, "agree_public_after": agreement(student, ctx.models, w, plain)}
        return ModelPredictor(student, logs)
