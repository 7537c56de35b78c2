"""Private augmentation streams: `RngStreams` swaps a client's states into torch's default generators.

kornia draws from the default generators of the device its module lives on (0.9 on a GPU: the CUDA generator),
so every generator the augmentation may touch must be swapped, not only the CPU one. On CPU a second
`torch.Generator` stands in for a GPU's default generator; the CUDA tests run where a GPU is present.
"""
import threading

import pytest
import torch

from flare.rng import RngStreams, augmentation_generators
from flare.data.augment import TwoViewAugment

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _draw(extra: torch.Generator) -> list[float]:
    """Like kornia: draws from default generators, never from a generator argument passed by the caller."""
    return torch.rand(3).tolist() + torch.rand(2, generator=extra).tolist()


def _alone(gens, seeds, extra, n=4):
    s = RngStreams(gens, seeds)
    out = []
    for _ in range(n):
        with s.active():
            out.append(_draw(extra))
    return out


def test_interleaved_streams_see_their_own_draws_on_every_generator_and_restore_the_outer_state():
    extra = torch.Generator()  # stands in for the GPU's default generator
    gens = [torch.default_generator, extra]
    ref_a, ref_b = _alone(gens, [1, 2], extra), _alone(gens, [3, 4], extra)
    assert ref_a != ref_b

    torch.manual_seed(123)
    extra.manual_seed(456)
    a, b = RngStreams(gens, [1, 2]), RngStreams(gens, [3, 4])
    got_a, got_b = [], []
    for _ in range(4):
        with a.active():
            got_a.append(_draw(extra))
        torch.rand(5), torch.rand(1, generator=extra)  # draws outside any stream, in between
        with b.active():
            got_b.append(_draw(extra))
    assert got_a == ref_a and got_b == ref_b
    after = (torch.rand(1).item(), torch.rand(1, generator=extra).item())

    torch.manual_seed(123)  # the outer generators advanced only by the outside draws
    extra.manual_seed(456)
    for _ in range(4):
        torch.rand(5), torch.rand(1, generator=extra)
    assert after == (torch.rand(1).item(), torch.rand(1, generator=extra).item())


def test_swapping_only_the_cpu_generator_would_mix_the_streams():
    """The failure the second generator prevents: a stream that leaves the device generator alone shares it."""
    extra = torch.Generator().manual_seed(0)
    ref = _alone([torch.default_generator, extra], [1, 2], extra)
    extra.manual_seed(0)
    a, b = RngStreams([torch.default_generator], [1]), RngStreams([torch.default_generator], [3])
    got = []
    for _ in range(4):
        with a.active():
            got.append(_draw(extra))
        with b.active():
            _draw(extra)
    assert [g[:3] for g in got] == [r[:3] for r in ref]  # the swapped CPU part is private ...
    assert [g[3:] for g in got] != [r[3:] for r in ref]  # ... the shared one is not


def test_threads_see_the_draws_they_see_alone():
    extra = torch.Generator()
    gens = [torch.default_generator, extra]
    seeds = [[10 + i, 20 + i] for i in range(4)]
    ref = [_alone(gens, s, extra, n=30) for s in seeds]
    got = [None] * len(seeds)
    barrier = threading.Barrier(len(seeds))

    def work(i):
        barrier.wait()
        got[i] = _alone(gens, seeds[i], extra, n=30)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(seeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == ref


def test_streams_need_one_seed_per_generator():
    with pytest.raises(ValueError, match="2 generators but 1 seeds"):
        RngStreams([torch.default_generator, torch.Generator()], [1])


def test_cpu_augmentation_draws_from_the_client_stream_and_leaves_the_global_one_alone():
    """On CPU the augmentation's draws come from the client's stream alone: the same stream seed gives the same
    views whatever the global generator holds, another seed other views, and the global state is untouched."""
    aug = TwoViewAugment(16, 3, [0.5] * 3, [0.25] * 3)
    x = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    gens = augmentation_generators(torch.device("cpu"))

    def views(seed, global_seed):
        torch.manual_seed(global_seed)
        before = torch.get_rng_state()
        with RngStreams(gens, [seed]).active():
            v = torch.cat(aug(x))
        assert torch.equal(torch.get_rng_state(), before)
        return v

    assert torch.equal(views(5, 0), views(5, 123))
    assert not torch.equal(views(5, 0), views(6, 0))


@cuda
def test_gpu_training_swaps_the_gpu_generator_too():
    gens = augmentation_generators(torch.device("cuda"))
    assert len(gens) == 2 and gens[1].device.type == "cuda"


@cuda
def test_kornia_on_a_gpu_draws_from_the_gpu_generator():
    """Same CPU seed, different CUDA seed → different views: the CUDA generator matters (kornia ≥ 0.8)."""
    aug = TwoViewAugment(16, 3, [0.5] * 3, [0.25] * 3).cuda()
    x = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8, device="cuda")
    views = []
    for cuda_seed in (1, 2):
        torch.default_generator.manual_seed(0)
        torch.cuda.default_generators[torch.cuda.current_device()].manual_seed(cuda_seed)
        views.append(aug(x)[0])
    assert not torch.equal(views[0], views[1])


@cuda
def test_gpu_streams_interleaved_give_the_views_they_give_alone():
    device = torch.device("cuda")
    aug = TwoViewAugment(16, 3, [0.5] * 3, [0.25] * 3).to(device)
    x = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8, device=device)
    gens = augmentation_generators(device)

    def views(streams, n=3):
        out = []
        for _ in range(n):
            with streams.active():
                out.append(torch.cat(aug(x)))
        return out

    ref_a, ref_b = views(RngStreams(gens, [1, 2])), views(RngStreams(gens, [3, 4]))
    a, b = RngStreams(gens, [1, 2]), RngStreams(gens, [3, 4])
    got_a, got_b = [], []
    for _ in range(3):
        got_a += views(a, 1)
        got_b += views(b, 1)
    assert all(torch.equal(g, r) for g, r in zip(got_a + got_b, ref_a + ref_b))
