"""Contrast-set extensions (docs/method.md#contrast-banks, which says what each kind adds to the loss): memory bank,
public feature bank, two-stage training. The notes report all three as failures (9/22, 9/23, 9/24); they stay as
options so the findings can be reproduced.

The server builds the public bank once (`build_public_bank`); `CONTRAST.create` builds a callable
`(client, ctx) -> extension` from it (the same call in the in-process runner and on a Flower node, which receives the
bank with its task). The trainer calls, per step, `contrast_bank() -> (feats, labels) | None` (extra SupCon contrast
entries), `adjust_terms(terms, feat, y2, epoch_idx) -> terms` and `after_step(feat_detached, y2)`, and
`state_dict()` / `load_state_dict()` for checkpoints.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from flare.client.objective import base_terms
from flare.config import Config, LossCfg
from flare.errors import FlareError
from flare.registry import CONTRAST
from flare.rng import derived_seed


@dataclass(frozen=True)
class BankFacts:
    """What a contrast bank is built from: the server's public bank (`build_public_bank`, or None), the device, and
    the banks' keys of the loss section."""
    public_bank: Tensor | None
    device: torch.device
    bank_size: int
    bank_tau: float
    public_stage_epochs: int


def bank_facts(loss: LossCfg, public_bank: Tensor | None, device: torch.device) -> BankFacts:
    return BankFacts(public_bank, device, loss.bank_size, loss.bank_tau, loss.public_stage_epochs)


class ContrastBankFn(Protocol):
    """What `CONTRAST` holds: a per-client extension builder `(client, ctx) -> extension`, built once per run by
    `CONTRAST.create`; the entry `none` is None."""
    def __call__(self, facts: BankFacts, options: None) -> Callable: ...


# memory bank
class MemoryBank:
    """Per-client FIFO of the `size` most recent (normalised feature, label) pairs, as a ring buffer: the memory bank
    as a client's contrast extension (its checkpoint: the bank's `state_dict`)."""

    def __init__(self, size: int, dim: int, device: torch.device | str = "cpu"):
        self.size, self.dim = int(size), int(dim)
        self.feats = torch.zeros(self.size, self.dim, device=device)
        self.labels = torch.zeros(self.size, dtype=torch.long, device=device)
        self.ptr, self.count = 0, 0  # the next slot to write, the filled slots

    def __len__(self) -> int:
        return self.count

    def push(self, feats: Tensor, labels: Tensor) -> None:
        """Enqueue rows (oldest first); when full, the oldest entries are dropped."""
        z = F.normalize(feats.detach().float(), dim=1)
        y = labels.detach().long()
        if z.shape[0] > self.size:  # only the newest `size` rows can survive
            z, y = z[-self.size:], y[-self.size:]
        n = z.shape[0]
        idx = (self.ptr + torch.arange(n, device=self.feats.device)) % self.size
        self.feats[idx] = z.to(self.feats.device)
        self.labels[idx] = y.to(self.labels.device)
        self.ptr = (self.ptr + n) % self.size
        self.count = min(self.count + n, self.size)

    def contrast_bank(self) -> tuple[Tensor, Tensor]:
        """The filled entries in storage order (SupCon does not care about order; no copy)."""
        return self.feats[: self.count], self.labels[: self.count]

    def adjust_terms(self, terms: dict, feat: Tensor, y2: Tensor, epoch_idx: int) -> dict:
        return terms

    def after_step(self, feat: Tensor, y2: Tensor) -> None:
        self.push(feat, y2)

    def state_dict(self) -> dict:
        return {"feats": self.feats, "labels": self.labels, "ptr": self.ptr, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.feats = state["feats"].to(self.feats.device)
        self.labels = state["labels"].to(self.labels.device)
        self.ptr, self.count = int(state["ptr"]), int(state["count"])


# public feature bank and two-stage
def public_infonce(feat: Tensor, bank: Tensor, tau: float) -> Tensor:
    """InfoNCE over a batch laid out as [view1; view2] (2B rows): the positive of each row is the other
    view of the same image, the negatives are the (normalised) bank rows."""
    z = F.normalize(feat.float(), dim=1)
    b = z.shape[0] // 2
    other = torch.cat([z[b:], z[:b]])
    pos = (z * other).sum(1, keepdim=True)
    neg = z @ bank.to(z.dtype).T
    logits = torch.cat([pos, neg], dim=1) / tau
    return F.cross_entropy(logits, torch.zeros(z.shape[0], dtype=torch.long, device=z.device))


class PublicBankExtension:
    def __init__(self, bank: Tensor, tau: float, public_stage_epochs: int | None):
        self.bank, self.tau = bank, tau
        self.public_stage_epochs = public_stage_epochs  # None: public-bank (term always added)

    def contrast_bank(self):
        return None

    def adjust_terms(self, terms: dict, feat: Tensor, y2: Tensor, epoch_idx: int) -> dict:
        if self.public_stage_epochs is None:
            return {**terms, "loss_public": public_infonce(feat, self.bank, self.tau)}
        if epoch_idx < self.public_stage_epochs:  # stage 1: the public term alone
            return {"loss_public": public_infonce(feat, self.bank, self.tau)}
        return terms                           # stage 2: the base loss alone

    def after_step(self, feat: Tensor, y2: Tensor) -> None:
        pass

    def state_dict(self) -> dict:
        return {}  # the bank is rebuilt deterministically from the seed on resume

    def load_state_dict(self, state: dict) -> None:
        pass


def train_teacher(cfg: Config, public: tuple[Tensor, Tensor], global_model: torch.nn.Module, augment,
                  device: torch.device) -> tuple[torch.nn.Module, list[float]]:
    """The server's teacher: a copy of the initial global model trained on the public slice for
    `loss.teacher_epochs` epochs with the run's objective. Returns (teacher, mean loss per epoch)."""
    x, y = public[0].to(device), public[1].to(device)
    teacher = copy.deepcopy(global_model).to(device)
    teacher.train()
    opt = torch.optim.SGD(teacher.parameters(), lr=cfg.lr, momentum=cfg.optim.momentum,
                          weight_decay=cfg.optim.weight_decay)
    order = torch.Generator().manual_seed(derived_seed(cfg.seed, 424242, 2))
    n, bs = len(y), cfg.batch_size
    steps, losses = math.ceil(n / bs), []
    with torch.random.fork_rng(devices=[]):  # leave the global stream as we found it
        torch.manual_seed(derived_seed(cfg.seed, 424242, 1))  # the teacher's augmentation stream
        for _ in range(cfg.loss.teacher_epochs):
            perm = torch.randperm(n, generator=order).to(device)
            total = 0.0
            for b in range(steps):
                idx = perm[b * bs:(b + 1) * bs]
                v1, v2 = augment(x[idx])
                feat, logits = teacher(torch.cat([v1, v2]))
                y2 = torch.cat([y[idx], y[idx]])
                loss = sum(base_terms(cfg.loss, feat, logits, y2, teacher.prototypes).values())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.optim.grad_clip is not None:
                    torch.nn.utils.clip_grad_norm_(teacher.parameters(), cfg.optim.grad_clip)
                opt.step()
                total += float(loss.detach())
            losses.append(total / steps)
    return teacher, losses


@torch.no_grad()
def teacher_bank(teacher: torch.nn.Module, x_uint8: Tensor, norm, device: torch.device,
                 batch_size: int = 256) -> Tensor:
    """L2-normalised teacher features of the public slice (eval mode, no augmentation)."""
    teacher.eval()
    return torch.cat([F.normalize(teacher(norm(xb.to(device)))[0].float(), dim=1) for xb in x_uint8.split(batch_size)])


def build_public_bank(cfg: Config, public: tuple[Tensor, Tensor] | None, global_model: torch.nn.Module, augment,
                      norm, device: torch.device) -> Tensor | None:
    """The server's side of `public-bank` / `two-stage`: train the teacher on the held-out slice and return its
    normalised features of that slice (None for every other `loss.contrast`)."""
    if cfg.loss.contrast not in ("public-bank", "two-stage"):
        return None  # (a public slice is there: the config refused these kinds without one, `_public_check`)
    teacher, _losses = train_teacher(cfg, public, global_model, augment, device)
    return teacher_bank(teacher, public[0], norm, device, cfg.test_batch_size)


def _memory_bank(facts: BankFacts, options: None):
    return lambda client, ctx: MemoryBank(facts.bank_size, client.model.feature_dim, facts.device)


def _public_bank(kind: str):
    def build(facts: BankFacts, options: None):
        if facts.public_bank is None:
            raise FlareError(f"loss.contrast={kind} needs the server's public bank, which is missing.",
                             key="loss.contrast", fix="the server builds it from dataset.public_size; check the "
                                                      "run's setup (a Flower node receives it with its first task).")
        stages = facts.public_stage_epochs if kind == "two-stage" else None
        b = facts.public_bank.to(facts.device)
        return lambda client, ctx: PublicBankExtension(b, facts.bank_tau, stages)
    return build


def _public_check(cfg: Config) -> None:
    """The teacher bank is trained on the public slice the server holds out of the training set."""
    if cfg.dataset.public_size == 0:
        raise FlareError(f"loss.contrast={cfg.loss.contrast} needs a public slice held out by the server.",
                         key="dataset.public_size", fix="set dataset.public_size (e.g. 1000).")


CONTRAST.register("none", None, description="no contrast-set extension")
CONTRAST.register("memory-bank", _memory_bank, description="per-client FIFO of recent features in SupCon")
CONTRAST.register("public-bank", _public_bank("public-bank"),
                  description="InfoNCE against the server's public teacher bank",
                  check=_public_check)
CONTRAST.register("two-stage", _public_bank("two-stage"),
                  description="public-bank term alone first, then the base loss",
                  check=_public_check)
