"""Data-free one-shot servers: `dense` (Zhang et al., "DENSE: Data-Free One-Shot Federated Learning", NeurIPS 2022)
and `coboosting` (Dai et al., "Enhancing One-Shot Federated Learning Through Data and Ensemble Co-Boosting", ICLR
2024). A generator synthesises inputs from the client ensemble, and a fresh student of the run's architecture is
distilled from the ensemble on the synthetic pool. The epoch, step by step with the reference codes' lines
(zj-jayzhang/DENSE, rong-dai/Co-Boosting), the options and the departures: docs/baselines.md, `dense`.
"""
from __future__ import annotations

import hashlib
import math
from functools import partial
from pathlib import Path
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from flare.baselines.kd import (BN, Cost, affine_normalizer, client_logits, crop_flip, eval_mode, fresh_model,
                                generator, kd_loss, passes, private_stream, to_uint8)
from flare.durable import atomic_torch_save
from flare.errors import FlareError
from flare.progress import Counter
from flare.registry import STRATEGIES
from flare.rng import derived_seed
from flare.server.strategy import ModelPredictor, ServerContext, Strategy

class DenseOptions(BaseModel):
    """DENSE's published settings (the README's kd_train command, loop_df_fl.py defaults)."""

    model_config = ConfigDict(extra="forbid")
    epochs: int = Field(200, ge=1, description="synthesis + distillation epochs")
    g_steps: int = Field(30, ge=1, description="generator steps per epoch")
    lr_g: float = Field(1e-3, gt=0, description="Adam learning rate of the generator and z")
    synthesis_batch: int = Field(256, ge=2, description="images synthesised per epoch")
    batch_size: int = Field(256, ge=2, description="pool images per distillation step")
    nz: int = Field(256, ge=1, description="noise dimension")
    ngf: int = Field(64, ge=1, description="generator width")
    bn: float = Field(1.0, ge=0, description="weight of the BatchNorm-statistics term")
    oh: float = Field(1.0, ge=0, description="weight of the ensemble's CE to the pseudo-labels")
    adv: float = Field(1.0, ge=0, description="weight of the adversarial (student-ensemble disagreement) term")
    adv_temperature: float = Field(1.0, gt=0, description="temperature of the adversarial KL")
    temperature: float = Field(20.0, gt=0, description="distillation temperature T (loss × T²)")
    lr: float = Field(0.005, gt=0, description="student SGD learning rate")
    momentum: float = Field(0.9, ge=0, description="student SGD momentum")
    weight_decay: float = Field(0.0, ge=0, description="student SGD weight decay")
    cosine: bool = Field(False, description="cosine-anneal the student's learning rate over the epochs")
    curve_every: int = Field(0, ge=0, description="score the student on the test set every this many epochs, "
                             "for the record only (`curve`: accuracy against the server's budget; the best point is "
                             "the references' test-selected epoch, reported as such, never used); 0: off")
    clip: float | None = Field(None, gt=0, description="gradient-norm clip of generator and student (null: none)")
    pool_size: int | None = Field(None, ge=1, description="keep the newest N synthetic images (null: all)")
    augment: bool = Field(True, description="crop (4-pixel padding) + flip of the images the student sees")


class CoBoostingOptions(DenseOptions):
    """Co-Boosting's published settings (co_boosting.sh, datafree_kd.py defaults)."""

    synthesis_batch: int = Field(128, ge=2, description="images synthesised per epoch")
    batch_size: int = Field(128, ge=2, description="pool images per distillation step")
    bn: float = Field(0.0, ge=0, description="weight of the BatchNorm-statistics term (the code's default: 0)")
    adv_temperature: float = Field(3.0, gt=0, description="temperature of the adversarial KL")
    temperature: float = Field(4.0, gt=0, description="distillation temperature T (loss × T²)")
    lr: float = Field(0.01, gt=0, description="student SGD learning rate")
    weight_decay: float = Field(1e-4, ge=0, description="student SGD weight decay")
    cosine: bool = Field(True, description="cosine-anneal the student's learning rate over the epochs")
    clip: float | None = Field(10.0, gt=0, description="gradient-norm clip of generator and student")
    hs: float = Field(1.0, ge=0, description="hard-sample exponent: CE weighted by (1 − p_y)^hs")
    mu: float = Field(0.01, ge=0, description="step of the ensemble weights (signed gradient)")
    wdc: float = Field(0.99, gt=0, le=1, description="decay of that step per epoch")
    wa_steps: int = Field(1, ge=0, description="passes over the pool that adjust the ensemble weights per epoch")
    eps: float = Field(8 / 255, ge=0, description="size of the signed input perturbation (model-input units)")
    perturb: Literal["ods", "disagreement", "none"] = Field(
        "ods", description="distillation inputs: ODS step (the code), student-ensemble disagreement step, or none")


def weighted_mean(w: Tensor, z: Tensor) -> Tensor:
    """Σ_k w_k z_k / Σ_k w_k of K×B×C logits (the references' weighted Ensemble; DENSE's weights sum to 1)."""
    return (w[:, None, None] * z).sum(0) / w.sum().clamp_min(1e-12)


class Generator(nn.Module):
    """The references' generator, for any C×H×W (built at ⌈H/4⌉×⌈W/4⌉, cropped to H×W); images in [0, 1]."""

    def __init__(self, nz: int, ngf: int, shape: tuple[int, int, int]):
        super().__init__()
        c, self.h, self.w = shape
        self.s = (math.ceil(self.h / 4), math.ceil(self.w / 4))
        self.l1 = nn.Linear(nz, 2 * ngf * self.s[0] * self.s[1])
        self.body = nn.Sequential(nn.BatchNorm2d(2 * ngf), nn.Upsample(scale_factor=2),
            nn.Conv2d(2 * ngf, 2 * ngf, 3, padding=1, bias=False), nn.BatchNorm2d(2 * ngf), nn.LeakyReLU(0.2),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(2 * ngf, ngf, 3, padding=1, bias=False), nn.BatchNorm2d(ngf), nn.LeakyReLU(0.2),
            nn.Conv2d(ngf, c, 3, padding=1), nn.Sigmoid())

    def forward(self, z: Tensor) -> Tensor:
        x = self.body(self.l1(z).view(z.shape[0], -1, *self.s))
        top, left = (x.shape[2] - self.h) // 2, (x.shape[3] - self.w) // 2
        return x[:, :, top:top + self.h, left:left + self.w]

    @torch.no_grad()
    def reset(self, gen: torch.Generator) -> None:
        """The references' reset_model: N(0, 0.02) weights, zero biases, BN scales N(1, 0.02)."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * 0.02)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(1 + torch.randn(m.weight.shape, generator=gen) * 0.02)
                m.bias.zero_()


class BNStats:
    """Forward hooks on every client model's BatchNorm layers; while `on`, each records ‖μ − running_mean‖₂ +
    ‖σ² − running_var‖₂ of its input (biased σ², DeepInversion's hook). Removed by `close`."""

    def __init__(self, models: list[nn.Module]):
        self.on, self.terms = False, []
        self.handles = [b.register_forward_hook(partial(self._hook, k)) for k, m in enumerate(models)
                        for b in m.modules() if isinstance(b, BN) and b.track_running_stats]

    def _hook(self, k: int, module: nn.Module, inputs: tuple, output) -> None:
        if self.on:
            x = inputs[0].float()
            dims = [0, *range(2, x.dim())]
            r = (torch.linalg.vector_norm(x.var(dims, unbiased=False) - module.running_var)
                 + torch.linalg.vector_norm(x.mean(dims) - module.running_mean))
            self.terms.append((k, r))

    def loss(self, w: Tensor) -> Tensor:
        out = sum(w[k] * r for k, r in self.terms) if self.terms else w.new_zeros(())
        self.terms = []
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class Synthesis:
    """One build: the generator's epochs, the pool, the (Co-Boosting: re-weighted) ensemble and the student.

    A server that trains something else than a fresh student on the same synthetic pool (IntactOFL's gate,
    intactofl.py) subclasses it and overrides the hooks: `make_student` (what learns, its parameters the optimiser's),
    `teacher` (what the generator's CE and BN terms read), `adversary` (the logits the adversarial term pulls the
    teacher away from) and `batch_loss` (the learner's loss on one batch of the pool)."""

    def __init__(self, facts, o: DenseOptions, ctx: ServerContext, shape: tuple[int, int, int], tag: int,
                 coboost: bool):
        self.facts, self.o, self.ctx, self.shape, self.tag, self.coboost = facts, o, ctx, shape, tag, coboost
        self.dev, self.models = ctx.device, ctx.models
        self.g = generator(facts.seed, ctx.round, tag)
        self.w = ctx.weights.to(self.dev, torch.float32).clone()  # the teacher's weights (learned by Co-Boosting)
        self.C = int(self.models[0].num_classes)  # a FlareNet (create_model)
        self.to_input = affine_normalizer(ctx.normalize, shape[0], self.dev)
        with private_stream(derived_seed(facts.seed, ctx.round, tag, 1)):
            self.gen_net = Generator(o.nz, o.ngf, shape).to(self.dev)
        self.student = self.make_student()
        self.opt = torch.optim.SGD(self.student.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, o.epochs) if o.cosine else None
        self.pool_x = torch.empty(0, *shape, dtype=torch.uint8, device=self.dev)
        self.pool_y = torch.empty(0, dtype=torch.long, device=self.dev)
        self.g_losses, self.kd_losses = [], []  # per epoch, per generator step; per distillation step

    def make_student(self) -> nn.Module:
        """A fresh model of the server architecture (seeded by the round and the strategy's tag)."""
        return fresh_model(self.facts, self.shape[0], self.C, derived_seed(self.facts.seed, self.ctx.round, self.tag, 2),
                           self.dev)

    def teacher(self, x: Tensor) -> Tensor:
        """The logits the generator's CE and BN terms read and the student learns: the weighted ensemble's."""
        return weighted_mean(self.w, client_logits(self.models, x))

    def adversary(self, x: Tensor) -> Tensor:
        """The logits the generator's adversarial term moves away from the teacher's: the student's."""
        return self.student(x)[1].float()

    def synthesize(self) -> None:
        o, g = self.o, self.g
        self.gen_net.train().reset(g)
        z = torch.randn(o.synthesis_batch, o.nz, generator=g).to(self.dev).requires_grad_(True)
        y = torch.randint(0, self.C, (o.synthesis_batch,), generator=g).to(self.dev)
        y = y if self.coboost else y.sort()[0]  # DENSE sorts its pseudo-labels
        params = [*self.gen_net.parameters(), z]
        opt = torch.optim.Adam(params, lr=o.lr_g, betas=(0.5, 0.999))
        hooks, best, best_cost = BNStats(self.models), None, math.inf
        self.g_losses.append([])
        self.student.eval()
        try:
            for _ in range(o.g_steps):
                x01 = self.gen_net(z)
                x = self.to_input(crop_flip(x01, g) if o.augment and not self.coboost else x01)
                hooks.on = True
                t = self.teacher(x)
                hooks.on = False
                ce = F.cross_entropy(t, y, reduction="none")
                if self.coboost:  # hard samples: weighted by the ensemble's missing confidence
                    ce = (1 - t.softmax(1).gather(1, y[:, None])[:, 0].detach()).pow(o.hs) * ce
                s = self.adversary(x)
                kl = kd_loss(s, t, o.adv_temperature, reduction="none").sum(1)
                if not self.coboost:
                    kl = kl * (s.argmax(1) != t.argmax(1)).float()
                loss = o.bn * hooks.loss(self.w) + o.oh * ce.mean() - o.adv * kl.mean()
                cost = float(loss.detach())
                self.g_losses[-1].append(cost)
                if cost < best_cost or best is None:
                    best_cost, best = cost, x01.detach()
                opt.zero_grad(set_to_none=True)
                loss.backward(inputs=params)  # the client models and the student accumulate no gradient
                if o.clip is not None:
                    nn.utils.clip_grad_norm_(self.gen_net.parameters(), o.clip)
                opt.step()
        finally:
            hooks.close()
        self.pool_x = torch.cat([self.pool_x, to_uint8(best)])[-(o.pool_size or 0):]
        self.pool_y = torch.cat([self.pool_y, y])[-(o.pool_size or 0):]

    def view(self, ix: Tensor) -> Tensor:
        xb = self.pool_x[ix.to(self.dev)]
        return self.ctx.normalize(crop_flip(xb, self.g) if self.o.augment else xb)

    def reweight(self, epoch: int) -> None:
        """Co-Boosting's ensemble weights: a signed step on CE(ensemble, pseudo-labels) per pool batch."""
        step = self.o.mu * self.o.wdc ** epoch
        for _ in range(self.o.wa_steps):
            for ix in passes(self.pool_x.shape[0], self.o.batch_size, self.g):
                x, y = self.view(ix), self.pool_y[ix.to(self.dev)]
                with torch.no_grad():
                    z = client_logits(self.models, x)
                w = self.w.clone().requires_grad_(True)
                (grad,) = torch.autograd.grad(F.cross_entropy(weighted_mean(w, z), y), w)
                self.w = (self.w - step * grad.sign()).clamp(0.0, 1.0)

    def perturb(self, x: Tensor, outputs: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """One signed step of size eps on the distillation inputs (Co-Boosting); `outputs`: the logits whose
        softened output the ODS direction projects (default: the teacher's)."""
        x = x.detach().requires_grad_(True)
        t = (outputs or self.teacher)(x)
        if self.o.perturb == "ods":  # a random direction of the ensemble's softened output
            r = torch.rand(t.shape, generator=self.g).to(self.dev) * 2 - 1
            obj = (r * F.softmax(t / 4, dim=1)).sum()
        else:
            was = self.student.training
            obj = kd_loss(self.student.eval()(x)[1].float(), t, 1.0)
            self.student.train(was)
        (grad,) = torch.autograd.grad(obj, x)
        return (x + self.o.eps * grad.sign()).detach()

    def batch_loss(self, ix: Tensor) -> Tensor:
        """The learner's loss on the pool images `ix`: the student's KL to the teacher."""
        x = self.view(ix)
        if self.coboost and self.o.perturb != "none":
            x = self.perturb(x)
        with torch.no_grad():
            t = self.teacher(x)
        return kd_loss(self.student(x)[1].float(), t, self.o.temperature)

    def distil(self) -> None:
        """One epoch of learning on the pool."""
        self.student.train()
        for ix in passes(self.pool_x.shape[0], self.o.batch_size, self.g):
            loss = self.batch_loss(ix)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            if self.o.clip is not None:
                nn.utils.clip_grad_norm_(self.student.parameters(), self.o.clip)
            self.opt.step()
            self.kd_losses.append(float(loss.detach()))
        if self.sched is not None:
            self.sched.step()

    def state(self) -> dict:
        """All that the epochs so far leave to the next (the generator restarts from `g` every epoch): a build
        resumed from it goes on bit for bit."""
        return {"student": self.student.state_dict(), "opt": self.opt.state_dict(), "g": self.g.get_state(),
                "sched": self.sched and self.sched.state_dict(), "w": self.w, "pool_x": self.pool_x,
                "pool_y": self.pool_y, "g_losses": self.g_losses, "kd_losses": self.kd_losses}

    def load_state(self, s: dict) -> None:
        for k in ("student", "opt", "sched"):
            if s[k] is not None:
                getattr(self, k).load_state_dict(s[k])
        self.g.set_state(s["g"])
        self.w, self.pool_x, self.pool_y = (s[k].to(self.dev) for k in ("w", "pool_x", "pool_y"))
        self.g_losses, self.kd_losses = s["g_losses"], s["kd_losses"]

    def progress_file(self) -> Path | None:
        """Where this build keeps its progress in `ServerContext.scratch`, named by all it depends on (options, round,
        strategy, the clients' states): a file of another build is never read."""
        if self.ctx.scratch is None:
            return None
        self.ctx.scratch.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256(repr((self.o.model_dump(), self.ctx.round, self.tag, type(self).__name__)).encode())
        for t in (t for m in self.models for t in m.state_dict().values()):
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return self.ctx.scratch / f"{h.hexdigest()[:16]}.pt"

    def run(self) -> tuple[nn.Module, dict[str, float]]:
        cost, file = Cost(self.dev), self.progress_file()
        curve: list[list[float]] = []  # [epoch, generator steps so far, test accuracy]
        every, start = self.o.curve_every, 0
        if file is not None and file.is_file():  # an interrupted build: on from its last finished epoch
            try:  # a torn copy must not silently restart hours of build, nor end in a traceback
                s = torch.load(file, map_location="cpu", weights_only=True)
            except Exception as e:
                raise FlareError(f"{file} holds this data-free build's progress and cannot be read ({e}).",
                                 fix="delete it: the build starts again from its first epoch.") from e
            self.load_state(s)
            start, curve, cost.t0 = s["epoch"], s["curve"], cost.t0 - s["seconds"]
        with eval_mode(self.models), Counter(self.o.epochs, start, "coboosting" if self.coboost else "dense",
                                              unit="epoch") as bar:
            for epoch in range(start, self.o.epochs):
                self.synthesize()
                if self.coboost and epoch > 0:
                    self.reweight(epoch)
                self.distil()
                if every and self.ctx.score is not None and ((epoch + 1) % every == 0 or epoch + 1 == self.o.epochs):
                    curve.append([epoch + 1, (epoch + 1) * self.o.g_steps, self.ctx.score(self.student)])
                if file is not None:
                    atomic_torch_save({**self.state(), "epoch": epoch + 1, "curve": curve,
                                       "seconds": cost.logs()["seconds"]}, file)
                bar.set_postfix_str(f"student {100 * curve[-1][2]:.2f}% after epoch {curve[-1][0]}" if curve else "")
                bar.update()
        self.student.eval().requires_grad_(False)
        n = len(self.g_losses)  # the generator restarts every epoch: its first and last steps, averaged
        logs = {**cost.logs(), "epochs": float(self.o.epochs), "g_loss_first": sum(g[0] for g in self.g_losses) / n,
                "g_loss_last": sum(g[-1] for g in self.g_losses) / n,
                "kd_loss_last": self.kd_losses[-1] if self.kd_losses else math.nan,
                "pool": float(self.pool_x.shape[0]), "pool_mb": self.pool_x.numel() / 2 ** 20}
        if self.coboost:
            logs.update(w_min=float(self.w.min()), w_max=float(self.w.max()))
        if curve:
            best = max(curve, key=lambda c: c[2])
            logs.update(curve=curve, best_epoch=float(best[0]), best_epoch_acc=best[2])
        return self.student, logs


class DataFree(Strategy):
    """A server built by a `Synthesis` (the class attribute `synthesis`) over generator-synthesised data."""

    every_round = False
    mixed_architectures = True  # the ensemble teaches a fresh student of the server architecture (server.model)
    inputs = ("images",)  # its generator synthesises images of the run's shape
    tag, coboost = 0, False
    synthesis = Synthesis

    def predictor(self, ctx: ServerContext) -> ModelPredictor:
        shape = tuple(int(v) for v in ctx.input_shape)  # ServerSetup.evaluate passes the run's C×H×W
        with torch.enable_grad(), torch.autocast(ctx.device.type, enabled=False):  # whatever the caller has set
            model, logs = self.synthesis(self.facts, self.options, ctx, shape, self.tag, self.coboost).run()
        return ModelPredictor(model.eval(), logs)


@STRATEGIES.register("dense", options=DenseOptions)
class Dense(DataFree):
    """DENSE: a fresh student distilled from the client ensemble on generator-synthesised data (data-free)."""

    tag = 2102


@STRATEGIES.register("coboosting", options=CoBoostingOptions)
class CoBoosting(DataFree):
    """Co-Boosting: DENSE with hard samples, learned ensemble weights and perturbed distillation inputs."""

    tag, coboost = 2103, True
