"""augment.schedule=chunked: a client's epoch augmented in large calls, each step slicing its views out of them.

It must feed every step the same images and labels, in the same order and layout, as the per-batch schedule (only
the random draws differ), be reproducible from the client-round's streams, and leave the default untouched.
"""
from types import SimpleNamespace

import pytest
import torch

import flare.client.plan as plan_mod
from flare.client.batched import BatchedClients
from flare.client.plan import RoundPlan, run_progress
from flare.config import load_config
from flare.errors import FlareError
from flare.schedules import LRSchedule
from flare.setup import RunSetup


class Tagging(torch.nn.Module):
    """A deterministic stand-in for the augmentation: a view is the images as floats, so a test can see which image
    landed in every row (chunked augments [b; b] in one call, so its rows carry no view of their own)."""

    def single_view(self, x):
        return x.float()

    def forward(self, x):
        return self.single_view(x), self.single_view(x)


def _plan(schedule: str, n: int, batch: int, epochs: int, drop_last: bool, augment, seed: int = 0):
    cfg = load_config(None, None, [f"augment.schedule={schedule}", f"batch_size={batch}", f"local_epochs={epochs}",
                                   f"drop_last={str(drop_last).lower()}", f"seed={seed}", "device=cpu"])
    x = torch.randint(0, 256, (n + 7, 1, 4, 4), dtype=torch.uint8)  # more images than the client holds
    y = torch.arange(n + 7)
    ctx = SimpleNamespace(cfg=cfg, device=torch.device("cpu"), train_x=x, train_y=y, augment=augment, plain=None,
                          lr_schedule=LRSchedule("constant", cfg.base_lr, cfg.total_epochs), progress=run_progress(cfg))
    client = SimpleNamespace(cid=1, indices=torch.arange(3, n + 3), num_samples=n, epochs_done=0)
    return RoundPlan(client, ctx, 0), ctx


@pytest.mark.parametrize("n, batch, drop_last", [(37, 8, False), (37, 8, True), (32, 8, False), (5, 8, False)])
@pytest.mark.parametrize("chunk_batches", [1, 2, 3, 100])
def test_every_step_sees_the_per_batch_images_and_layout(n, batch, drop_last, chunk_batches, monkeypatch):
    """Chunks of 1, 2, 3 batches or all of an epoch, ragged last batches, drop_last, two epochs: each step's
    [v1; v2] and labels are exactly what the per-batch schedule gives it."""
    monkeypatch.setattr(plan_mod, "CHUNK_ELEMENTS", chunk_batches * 2 * batch * 16)  # 16 elements per image
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

    def single_view(self, x):
        self.calls.append(x.shape[0])
        return super().single_view(x)


def test_one_call_per_chunk_not_per_step(monkeypatch):
    """37 samples, batch 8: 5 steps an epoch; chunks of 2 batches → one call of 32, 32, 10 images (both views) per
    epoch."""
    monkeypatch.setattr(plan_mod, "CHUNK_ELEMENTS", 2 * 2 * 8 * 16)
    aug = Counting()
    chunked, ctx = _plan("chunked", 37, 8, 2, False, aug)
    for t in range(len(chunked.steps)):
        chunked.views(ctx, t)
    assert aug.calls == [32, 32, 10, 32, 32, 10]


def _kornia_views(schedule: str, seed: int, steps: bool = False):
    from flare.data.augment import TwoViewAugment
    aug = TwoViewAugment(4, 1, 0.5, 0.25)
    p, ctx = _plan(schedule, 37, 8, 1, False, aug, seed=seed)
    torch.manual_seed(123)  # the data, identical for every call
    ctx.train_x = torch.randint(0, 256, ctx.train_x.shape, dtype=torch.uint8)
    views = [p.views(ctx, t)[0] for t in range(len(p.steps))]
    return views if steps else torch.cat(views)


def test_chunked_draws_are_reproducible_and_its_own():
    """The client-round's streams fix the draws (same seed, same views; another seed, other views), and they are not
    the per-batch draws: chunked is a different augmentation of the same images, hence its own option."""
    a, b = _kornia_views("chunked", 0), _kornia_views("chunked", 0)
    assert torch.equal(a, b)
    assert not torch.equal(a, _kornia_views("chunked", 1))
    assert not torch.equal(a, _kornia_views("per_batch", 0))


def test_chunked_views_of_an_image_are_two_draws():
    """One call augments a step's images twice: every image's two rows are independent draws, not one view twice."""
    for v in _kornia_views("chunked", 0, steps=True):
        half = v.shape[0] // 2
        differ = (v[:half] - v[half:]).flatten(1).abs().amax(1) > 1e-6
        assert differ.float().mean() > 0.8, differ


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
