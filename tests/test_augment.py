"""On-device two-view SupCon augmentation (docs/method.md#local-objective-fafi)."""
from __future__ import annotations

import pytest
import torch

from flare.config import build_config
from flare.data.augment import TwoViewAugment, normalize
from flare.data.scaling import InputScaling, ScalingFacts, input_scaling
from flare.registry import SCALINGS

MEAN3 = (0.4914, 0.4822, 0.4465)
STD3 = (0.2470, 0.2435, 0.2616)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# every random part switched off: the augmentation must reduce to `normalize`
OFF = dict(crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), flip_p=0.0, jitter_p=0.0, gray_p=0.0)


def batch(b=8, c=3, h=32, w=32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, c, h, w), dtype=torch.uint8, generator=g).to(device)


def smooth_image(c=3, size=32, seed=0):
    """A structured uint8 image (so crops and flips visibly change it)."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(1, c, 4, 4, generator=g)
    img = torch.nn.functional.interpolate(low, size=(size, size), mode="bilinear", align_corners=False)
    return (img * 255).round().clamp(0, 255).to(torch.uint8)


@pytest.mark.parametrize("device", DEVICES)
def test_shapes_dtypes_devices(device):
    aug = TwoViewAugment(32, 3, MEAN3, STD3).to(device)
    x = batch(device=device)
    v1, v2 = aug(x)
    for v in (v1, v2):
        assert v.shape == x.shape
        assert v.dtype == torch.float32
        assert v.device == x.device
        assert v.is_contiguous()
        assert torch.isfinite(v).all()
    assert x.dtype == torch.uint8  # input untouched


def test_normalize_values():
    x = torch.tensor([0, 51, 255], dtype=torch.uint8).view(1, 3, 1, 1).expand(2, 3, 2, 2).contiguous()
    y = normalize(x, (0.5, 0.2, 1.0), (0.5, 0.1, 2.0))
    expected = torch.tensor([(0.0 - 0.5) / 0.5, (0.2 - 0.2) / 0.1, (1.0 - 1.0) / 2.0]).view(1, 3, 1, 1)
    assert y.dtype == torch.float32
    assert torch.allclose(y, expected.expand_as(y), atol=1e-6)
    # scalar stats broadcast over channels; 3-D input works
    y1 = normalize(torch.full((1, 4, 4), 255, dtype=torch.uint8), 0.5, 0.25)
    assert y1.shape == (1, 4, 4) and torch.allclose(y1, torch.full_like(y1, 2.0))
    with pytest.raises(TypeError):
        normalize(torch.zeros(1, 3, 2, 2), MEAN3, STD3)


@pytest.mark.parametrize("c,mean,std", [(3, MEAN3, STD3), (1, (0.2860,), (0.3530,))])
def test_everything_off_equals_normalize(c, mean, std):
    aug = TwoViewAugment(32, c, mean, std, **OFF)
    x = batch(c=c)
    v1, v2 = aug(x)
    ref = normalize(x, mean, std)
    assert torch.allclose(v1, ref, atol=1e-5)
    assert torch.allclose(v2, ref, atol=1e-5)


def test_flip_only_and_gray_only():
    x = batch()
    ref = normalize(x, MEAN3, STD3)
    flip = TwoViewAugment(32, 3, MEAN3, STD3, **{**OFF, "flip_p": 1.0})
    assert torch.allclose(flip(x)[0], ref.flip(-1), atol=1e-5)

    gray = TwoViewAugment(32, 3, MEAN3, STD3, **{**OFF, "gray_p": 1.0})
    v = gray(x)[0]
    un = v * torch.tensor(STD3).view(1, 3, 1, 1) + torch.tensor(MEAN3).view(1, 3, 1, 1)
    assert torch.allclose(un[:, 0], un[:, 1], atol=1e-5) and torch.allclose(un[:, 1], un[:, 2], atol=1e-5)
    lum = (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).float() / 255
    assert torch.allclose(un[:, 0], lum, atol=1e-3)


def test_default_policy_composition():
    aug = TwoViewAugment(32, 3, MEAN3, STD3)
    names = [type(m).__name__ for m in aug.policy]
    assert names == ["RandomResizedCrop", "RandomHorizontalFlip", "ColorJitter", "RandomGrayscale"]
    crop, flip, jitter, gray = aug.policy
    assert flip.p == 0.5 and jitter.p == 0.8 and gray.p == 0.2
    assert (jitter.brightness, jitter.contrast, jitter.saturation, jitter.hue) == (0.4, 0.4, 0.4, 0.1)
    assert not any(m.same_on_batch for m in aug.policy)
    assert all(m.same_on_batch for m in TwoViewAugment(32, 3, MEAN3, STD3, per_image=False).policy)


def test_per_image_parameters_differ_across_rows():
    torch.manual_seed(0)
    x = smooth_image().expand(16, -1, -1, -1).contiguous()
    v1, v2 = TwoViewAugment(32, 3, MEAN3, STD3, per_image=True)(x)
    for v in (v1, v2):
        distinct = {tuple(v[i].flatten()[:64].tolist()) for i in range(v.shape[0])}
        assert len(distinct) == v.shape[0]  # every row got its own crop/flip/jitter


def test_per_batch_parameters_identical_rows():
    torch.manual_seed(0)
    x = smooth_image().expand(16, -1, -1, -1).contiguous()
    aug = TwoViewAugment(32, 3, MEAN3, STD3, per_image=False)
    for _ in range(3):
        v1, v2 = aug(x)
        for v in (v1, v2):
            assert torch.equal(v, v[:1].expand_as(v))
        assert not torch.equal(v1, v2)  # the two views still draw independently


@pytest.mark.parametrize("per_image", [True, False])
def test_two_views_differ(per_image):
    torch.manual_seed(1)
    v1, v2 = TwoViewAugment(32, 3, MEAN3, STD3, per_image=per_image)(batch())
    assert not torch.allclose(v1, v2)


@pytest.mark.parametrize("per_image", [True, False])
def test_seeded_determinism(per_image):
    aug = TwoViewAugment(32, 3, MEAN3, STD3, per_image=per_image)
    x = batch()
    torch.manual_seed(42)
    a1, a2 = aug(x)
    torch.manual_seed(42)
    b1, b2 = TwoViewAugment(32, 3, MEAN3, STD3, per_image=per_image)(x)
    assert torch.equal(a1, b1) and torch.equal(a2, b2)
    c1, _ = aug(x)  # no reseed → different draw
    assert not torch.equal(a1, c1)


@pytest.mark.parametrize("size", [28, 32])
def test_one_channel(size):
    torch.manual_seed(0)
    aug = TwoViewAugment(size, 1, (0.2860,), (0.3530,))
    names = [type(m).__name__ for m in aug.policy]
    assert "RandomGrayscale" not in names
    jitter = aug.policy[names.index("ColorJitter")]
    assert jitter.saturation == 0 and jitter.hue == 0 and jitter.brightness == 0.4 and jitter.contrast == 0.4
    x = batch(b=6, c=1, h=size, w=size)
    v1, v2 = aug(x)
    assert v1.shape == v2.shape == (6, 1, size, size)
    assert v1.dtype == torch.float32 and torch.isfinite(v1).all()
    assert not torch.allclose(v1, v2)
    # per-batch mode also works on one channel
    w1, _ = TwoViewAugment(size, 1, 0.2860, 0.3530, per_image=False)(x[:1].expand(4, -1, -1, -1))
    assert torch.equal(w1, w1[:1].expand_as(w1))


def test_values_stay_in_normalised_range():
    torch.manual_seed(0)
    aug = TwoViewAugment(32, 3, MEAN3, STD3)
    v1, _ = aug(batch(b=32))
    lo = (0 - torch.tensor(MEAN3)) / torch.tensor(STD3)
    hi = (1 - torch.tensor(MEAN3)) / torch.tensor(STD3)
    per_c = v1.transpose(0, 1).reshape(3, -1)
    assert torch.all(per_c.min(1).values >= lo - 1e-4) and torch.all(per_c.max(1).values <= hi + 1e-4)


def test_float32_under_autocast_and_input_checks():
    aug = TwoViewAugment(32, 3, MEAN3, STD3)
    x = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        v1, v2 = aug(x)
    assert v1.dtype == v2.dtype == torch.float32
    with pytest.raises(TypeError):
        aug(x.float())
    with pytest.raises(ValueError):
        aug(batch(c=1))


def test_the_input_scaling_is_a_registered_part_a_plugin_adds_like_the_reference():
    """augment.input_scaling names an entry of SCALINGS: the reference protocol's scaling is one registered part,
    and a plugin's is found the same way (by the config's validation too)."""
    assert input_scaling("reference", "cifar10", (0.4,), (0.2,)) == SCALINGS.create(
        "reference", ScalingFacts("cifar10", (0.4,), (0.2,)))
    assert input_scaling("dataset", "cifar10", (0.4,), (0.2,)).test == ((0.4,), (0.2,))
    SCALINGS.register("quarter", lambda facts, options: InputScaling(None, ((0.25,), (1.0,)), ((0.25,), (1.0,))))
    try:
        assert input_scaling("quarter", "cifar10", (0.4,), (0.2,)).post == ((0.25,), (1.0,))
        assert build_config({"augment": {"input_scaling": "quarter"}}).augment.input_scaling == "quarter"
    finally:
        del SCALINGS._entries["quarter"]


@pytest.mark.parametrize("per_image", [True, False])
@pytest.mark.parametrize("c,size,out", [(1, 28, 28), (3, 32, 32), (3, 32, 24)])
def test_the_separable_crop_draws_and_resamples_as_kornias(c, size, out, per_image):
    """augment.crop=separable: kornia's crop boxes (the same draws from the same seed) and kornia's corner-aligned
    bilinear values, up to float rounding; the stream after it is where kornia's leaves it."""
    import kornia.augmentation as K

    from flare.data.augment import SeparableResizedCrop
    kw = dict(scale=(0.2, 1.0), ratio=(0.75, 4 / 3), cropping_mode="resample", align_corners=True,
              same_on_batch=not per_image)
    x = torch.rand(64, c, size, size) * 4 - 1
    torch.manual_seed(5)
    want, after = K.RandomResizedCrop((out, out), **kw)(x), torch.rand(3)
    torch.manual_seed(5)
    got = SeparableResizedCrop((out, out), **kw)(x)
    assert got.shape == want.shape == (64, c, out, out)
    assert torch.allclose(got, want, atol=1e-4, rtol=0) and not torch.equal(got, x[..., :out, :out])  # x spans 4
    assert torch.equal(torch.rand(3), after)


def test_the_separable_crop_of_one_pixel_and_of_the_whole_image():
    """A one-pixel crop axis repeats that pixel (kornia's guard); a crop of the whole image is the image."""
    import kornia.augmentation as K

    from flare.data.augment import SeparableResizedCrop
    kw = dict(cropping_mode="resample", align_corners=True)
    x = torch.rand(3, 2, 9, 9)
    params = K.RandomResizedCrop((6, 6), **kw).forward_parameters(x.shape)
    params["src"] = torch.tensor([[[4., 2.], [4., 2.], [4., 7.], [4., 7.]],  # one column wide
                                  [[1., 5.], [6., 5.], [6., 5.], [1., 5.]],  # one row high
                                  [[0., 0.], [8., 0.], [8., 8.], [0., 8.]]])  # the whole image
    want = K.RandomResizedCrop((6, 6), **kw)(x, params=params)
    got = SeparableResizedCrop((6, 6), **kw)(x, params=params)
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    assert torch.equal(got[0], got[0][..., :1].expand(2, 6, 6)) and torch.equal(got[1], got[1][:, :1].expand(2, 6, 6))
    whole = SeparableResizedCrop((9, 9), **kw)(x, params={**params, "dst": params["dst"] * 8 / 5})
    assert torch.allclose(whole[2], x[2], atol=1e-6, rtol=0)


def test_augment_crop_chooses_the_crop_and_refuses_others():
    from flare.data.augment import SeparableResizedCrop
    from flare.data.prepare import DataMeta
    from flare.errors import FlareError
    from flare.setup import make_augment
    meta = DataMeta(name="fmnist", classes=list("0123456789"), in_channels=1, image_size=28, mean=[0.5], std=[0.25])
    crop = {c: make_augment(build_config({"augment": {"crop": c}}), meta, torch.device("cpu")).policy[0]
            for c in ("kornia", "separable")}
    assert isinstance(crop["separable"], SeparableResizedCrop) and type(crop["kornia"]) is not SeparableResizedCrop
    assert build_config({}).augment.crop == "kornia"
    with pytest.raises(FlareError, match="augment.crop='bilinear'"):
        build_config({"augment": {"crop": "bilinear"}})
    with pytest.raises(KeyError):
        TwoViewAugment(28, 1, 0.5, 0.25, crop="bilinear")
