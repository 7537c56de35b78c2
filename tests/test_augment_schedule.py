"""augment.schedule=chunked: a client's epoch augmented in large calls, each step slicing its views out of them.

It must feed every step the same images and labels, in the same order and layout, as the per-batch schedule (only
the random draws differ), be reproducible from the client-round's streams, and leave the default untouched.
"""
from types import SimpleNamespace

import pytest
import torch

import flare.client.plan as plan_mod
from flare.client.batched import BatchedClients
from flare.client.plan import RoundPlan
from flare.config import load_config
from flare.errors import FlareError
from flare.schedules import LRSchedule
from flare.setup import RunSetup


class Tagging(torch.nn.Module):
    """A deterministic stand-in for the augmentation: view 1 is the images as floats, view 2 the same plus 1000, so
    a test can see which image and which view landed in every row."""

    def forward(self, x):
        f = x.float()
        return f, f + 1000


def _plan(schedule: str, n: int, batch: int, epochs: int, drop_last: bool, augment, seed: int = 0):
    cfg = load_config(None, None, [f"augment.schedule={schedule}", f"batch_size={batch}", f"local_epochs={epochs}",
                                   f"drop_last={str(drop_last).lower()}", f"seed={seed}", "device=cpu"])
    x = torch.randint(0, 256, (n + 7, 1, 4, 4), dtype=torch.uint8)  # more images than the client holds
    y = torch.arange(n + 7)
    ctx = SimpleNamespace(cfg=cfg, device=torch.device("cpu"), train_x=x, train_y=y, augment=augment, plain=None,
                          lr_schedule=LRSchedule("constant", cfg.base_lr, cfg.total_epochs))
    client = SimpleNamespace(cid=1, indices=torch.arange(3, n + 3), num_samples=n, epochs_done=0)
    return RoundPlan(client, ctx, 0), ctx


@pytest.mark.parametrize("n, batch, drop_last", [(37, 8, False), (37, 8, True), (32, 8, False), (5, 8, False)])
@pytest.mark.parametrize("chunk_batches", [1, 2, 3, 100])
def test_every_step_sees_the_per_batch_images_and_layout(n, batch, drop_last, chunk_batches, monkeypatch):
    """Chunks of 1, 2, 3 batches or all of an epoch, ragged last batches, drop_last, two epochs: each step's
    [v1; v2] and labels are exactly what the per-batch schedule gives it."""
    monkeypatch.setattr(plan_mod, "CHUNK_ELEMENTS", chunk_batches * batch * 16)  # 16 elements per image
    per_batch, ctx_b = _plan("per_batch", n, batch, 2, drop_last, Tagging())
    chunked, ctx_w = _plan("chunked", n, batch, 2, drop_last, Tagging())
    ctx_w.train_x, ctx_w.train_y = ctx_b.train_x, ctx_b.train_y
    assert chunked.chunk_batches(16) == chunk_batches
    assert len(chunked.steps) == len(per_batch.steps) > 0
    for t in range(len(chunked.steps)):
        (vw, yw), (vb, yb) = chunked.views(ctx_w, t), per_batch.views(ctx_b, t)
        assert vw.shape == vb.shape and torch.equal(vw, vb), t
        assert torch.equal(yw, yb), t
        assert vw.is_contiguous()


class Counting(Tagging):
    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, x):
        self.calls.append(x.shape[0])
        return super().forward(x)


def test_one_call_per_chunk_not_per_step(monkeypatch):
    """37 samples, batch 8: 5 steps an epoch; chunks of 2 batches → calls of 16, 16, 5 images per epoch."""
    monkeypatch.setattr(plan_mod, "CHUNK_ELEMENTS", 2 * 8 * 16)
    aug = Counting()
    chunked, ctx = _plan("chunked", 37, 8, 2, False, aug)
    for t in range(len(chunked.steps)):
        chunked.views(ctx, t)
    assert aug.calls == [16, 16, 5, 16, 16, 5]


def _kornia_views(schedule: str, seed: int):
    from flare.data.augment import TwoViewAugment
    aug = TwoViewAugment(4, 1, 0.5, 0.25)
    p, ctx = _plan(schedule, 37, 8, 1, False, aug, seed=seed)
    torch.manual_seed(123)  # the data, identical for every call
    ctx.train_x = torch.randint(0, 256, ctx.train_x.shape, dtype=torch.uint8)
    return torch.cat([p.views(ctx, t)[0] for t in range(len(p.steps))])


def test_chunked_draws_are_reproducible_and_its_own():
    """The client-round's streams fix the draws (same seed, same views; another seed, other views), and they are not
    the per-batch draws: chunked is a different augmentation of the same images, hence its own option."""
    a, b = _kornia_views("chunked", 0), _kornia_views("chunked", 0)
    assert torch.equal(a, b)
    assert not torch.equal(a, _kornia_views("chunked", 1))
    assert not torch.equal(a, _kornia_views("per_batch", 0))


def test_default_is_per_batch_and_per_image_false_is_refused():
    assert load_config(None, "fafi", []).augment.schedule == "per_batch"
    with pytest.raises(FlareError, match="augment.schedule"):
        load_config(None, "fafi", ["augment.schedule=chunked", "augment.per_image=false"])


def test_batched_engine_trains_the_sequential_clients(tiny_overrides):
    """Both engines run the same plan, so chunked gives the batched engine the sequential engine's views: one
    round of FAFI ends in the same losses."""
    setup = RunSetup.build(load_config(None, "fafi", tiny_overrides + ["augment.schedule=chunked"]))
    seq = setup.make_clients(print, lambda m: None)
    bat = setup.make_clients(print, lambda m: None)
    want = [c.train_round(setup.ctx, 0) for c in seq]
    got = BatchedClients(bat, setup.ctx).train_round(0)
    for w, g in zip(want, got):
        for k in ("loss_con", "base_loss"):
            if k in w:
                assert abs(w[k] - g[k]) <= 1e-5 * abs(w[k]) + 1e-7, (w["client"], k, w[k], g[k])
    assert any("loss_con" in w for w in want)
