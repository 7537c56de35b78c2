"""Model zoo contract (docs/method.md#model)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flare.errors import FlareError
from flare.models import (
    FlareNet,
    LinearHead,
    PrototypeHead,
    ModelFacts,
    create_model,
    list_models,
    register_model,
)
from flare.registry import MODELS

# resnet50 is only run at a small width to keep CPU time low.
SHAPE_CASES = [
    (name, w)
    for name in ("resnet18", "resnet34", "cnn")
    for w in (1.0, 0.25)
] + [("resnet50", 0.125)]


def expected_dim(name: str, width: float) -> int:
    base = {"resnet18": 512, "resnet34": 512, "resnet50": 2048, "cnn": 128}[name]
    if name == "resnet50":
        return round(512 * width) * 4
    return round(base * width)


BUILTIN_MODELS = {"resnet18", "resnet34", "resnet50", "cnn", "wrn16_1", "wrn40_1", "cnn_dense", "cnn_coboost",
                  "simple-cnn", "cnn_mnist_dense"}
# the frozen pretrained encoder and the adapter over its features (options-taking builders: test_frozen_encoder.py)
FEATURE_MODELS = {"efficientnet_lite0", "efficientnet_lite1", "efficientnet_lite2", "adapter"}


def test_registry_names():
    """flare.models registers exactly these networks (whatever else a test or plugin registers in this process is
    defined outside it), and each is created by its name through the one calling convention of a builder
    `(facts, options)` (`MODELS.create`): create_model's network is the builder's, tensor for tensor under the same
    seed."""
    builtin = {n for n in list_models() if MODELS.entry(n).module.startswith("flare.models")}
    assert builtin == BUILTIN_MODELS | FEATURE_MODELS
    for name in sorted(BUILTIN_MODELS):
        torch.manual_seed(0)
        m = create_model(name, in_channels=3, num_classes=4, width=0.25)
        torch.manual_seed(0)
        encoder = MODELS.create(name, ModelFacts(3, 0.25))
        assert m.name == name and type(m.encoder) is type(encoder)
        mine, theirs = m.encoder.state_dict(), encoder.state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), name
    with pytest.raises(FlareError) as e:
        create_model("resnet19", 3, 4)
    assert e.value.key == "model.name"


@pytest.mark.parametrize("name,width", SHAPE_CASES)
@pytest.mark.parametrize("in_channels", [1, 3])
def test_output_shapes(name, width, in_channels):
    torch.manual_seed(0)
    m = create_model(name, in_channels=in_channels, num_classes=7, width=width)
    assert isinstance(m, FlareNet)
    d = expected_dim(name, width)
    assert m.feature_dim == d and m.num_classes == 7 and m.head_kind == "prototype"
    size = 8 if width >= 1.0 else 16  # tiny inputs keep this fast
    x = torch.randn(2, in_channels, size, size)
    feat, logits = m(x)
    assert feat.shape == (2, d) and logits.shape == (2, 7)
    assert feat.dtype == logits.dtype == torch.float32
    assert torch.isfinite(feat).all() and torch.isfinite(logits).all()
    assert torch.equal(m.encoder(x), feat)
    assert torch.allclose(m.head(feat), logits)


def test_feature_dims_full_width():
    # construct only (forward at width 1 is too slow for a unit test on CPU)
    assert create_model("resnet18", 3, 10).feature_dim == 512
    assert create_model("resnet34", 3, 10).feature_dim == 512
    assert create_model("resnet50", 3, 10).feature_dim == 2048
    assert create_model("cnn", 3, 10).feature_dim == 128
    assert create_model("resnet18", 3, 10, width=0.25).feature_dim == 128
    assert create_model("resnet50", 3, 10, width=0.125).feature_dim == 256
    assert create_model("cnn", 1, 10, width=0.5).feature_dim == 64


def test_resnet_stage_widths_and_blocks():
    m = create_model("resnet18", 3, 10, width=0.25)
    enc = m.encoder
    assert [len(enc.layer1), len(enc.layer2), len(enc.layer3), len(enc.layer4)] == [2, 2, 2, 2]
    assert [getattr(enc, f"layer{i}")[-1].bn2.num_features for i in range(1, 5)] == [16, 32, 64, 128]
    m34 = create_model("resnet34", 3, 10, width=0.125)
    assert [len(getattr(m34.encoder, f"layer{i}")) for i in range(1, 5)] == [3, 4, 6, 3]
    m50 = create_model("resnet50", 3, 10, width=0.125)
    assert [len(getattr(m50.encoder, f"layer{i}")) for i in range(1, 5)] == [3, 4, 6, 3]
    assert m50.encoder.layer4[-1].bn3.num_features == 256  # 64·8·0.125 · expansion 4


def test_tiny_width_keeps_channels_positive():
    m = create_model("resnet18", 1, 3, width=0.01)
    for mod in m.modules():
        if isinstance(mod, nn.Conv2d):
            assert mod.in_channels >= 1 and mod.out_channels >= 1
    feat, logits = m(torch.randn(2, 1, 8, 8))
    assert feat.shape == (2, m.feature_dim) and logits.shape == (2, 3)


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_stem_stride_one_no_maxpool(name):
    m = create_model(name, 3, 10, width=0.125)
    enc = m.encoder
    stem_conv = enc.stem[0]
    assert stem_conv.kernel_size == (3, 3) and stem_conv.stride == (1, 1) and stem_conv.padding == (1, 1)
    assert stem_conv.bias is None
    assert not any(isinstance(mod, nn.MaxPool2d) for mod in enc.modules())
    x = torch.randn(2, 3, 32, 32)
    s = enc.stem(x)
    assert s.shape[-2:] == (32, 32)
    l1 = enc.layer1(s)
    assert l1.shape[-2:] == (32, 32)  # first stage keeps the resolution
    l2 = enc.layer2(l1)
    assert l2.shape[-2:] == (16, 16)
    l4 = enc.layer4(enc.layer3(l2))
    assert l4.shape[-2:] == (4, 4)


@pytest.mark.parametrize("size", [28, 32, 64])
def test_cnn_input_sizes(size):
    m = create_model("cnn", 1 if size == 28 else 3, 10, width=0.25)
    feat, logits = m(torch.randn(2, m.encoder.in_channels, size, size))
    assert feat.shape == (2, 32) and logits.shape == (2, 10)


def test_init_conv_kaiming_bn_ones():
    torch.manual_seed(0)
    m = create_model("resnet18", 3, 10)
    conv = m.encoder.layer3[0].conv1  # 128 -> 256, 3x3: fan_out = 256 * 9
    assert abs(conv.weight.std().item() - (2.0 / (256 * 9)) ** 0.5) < 0.05 * (2.0 / (256 * 9)) ** 0.5
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            assert torch.all(mod.weight == 1) and torch.all(mod.bias == 0)


def test_prototype_head_hand_example():
    head = PrototypeHead(2, 2)
    with torch.no_grad():
        head.prototypes.copy_(torch.tensor([[2.0, 0.0], [1.0, 1.0]]))
    feat = torch.tensor([[3.0, 4.0], [0.0, -2.0]])
    # normalize(feat) = [[0.6, 0.8], [0, -1]]; logits = z @ P^T
    expected = torch.tensor([[1.2, 1.4], [0.0, -1.0]])
    assert torch.allclose(head(feat), expected, atol=1e-6)
    # equals the formula for random inputs too
    p = torch.randn(5, 8)
    h = PrototypeHead(5, 8)
    with torch.no_grad():
        h.prototypes.copy_(p)
    f = torch.randn(4, 8) * 10
    assert torch.allclose(h(f), F.normalize(f, dim=1) @ p.T, atol=1e-6)


def test_prototype_init_standard_normal_not_normalised():
    torch.manual_seed(0)
    m = create_model("cnn", 3, 100, width=4.0)  # d = 512
    p = m.prototypes
    assert isinstance(p, nn.Parameter) and p.requires_grad
    assert p.shape == (100, 512)
    assert abs(p.mean().item()) < 0.02
    assert abs(p.std().item() - 1.0) < 0.02
    norms = p.norm(dim=1)
    assert not torch.allclose(norms, torch.ones_like(norms))  # not normalised
    assert abs(norms.mean().item() - 512**0.5) < 1.0


def test_forward_feat_is_raw_and_logits_match_formula():
    torch.manual_seed(0)
    m = create_model("cnn", 3, 10, width=0.25).eval()
    x = torch.randn(3, 3, 32, 32)
    feat, logits = m(x)
    assert torch.allclose(feat, m.encoder(x))
    assert not torch.allclose(feat.norm(dim=1), torch.ones(3))
    assert torch.allclose(logits, F.normalize(feat, dim=1) @ m.prototypes.T, atol=1e-5)


def test_linear_head():
    torch.manual_seed(0)
    m = create_model("resnet18", 3, 10, width=0.125, head="linear")
    assert m.head_kind == "linear" and m.prototypes is None
    assert isinstance(m.head, LinearHead)
    assert m.head.fc.in_features == m.feature_dim == 64 and m.head.fc.out_features == 10
    x = torch.randn(2, 3, 16, 16)
    feat, logits = m(x)
    assert torch.allclose(logits, m.head.fc(feat))
    assert logits.shape == (2, 10)


def test_unknown_model_and_head_raise_flare_error():
    with pytest.raises(FlareError) as ei:
        create_model("vgg16", 3, 10)
    assert ei.value.key == "model.name"
    assert "resnet18" in ei.value.fix and "cnn" in ei.value.fix
    with pytest.raises(FlareError) as ei:
        create_model("resnet18", 3, 10, head="mlp")
    assert ei.value.key == "model.head"
    with pytest.raises(FlareError) as ei:
        create_model("resnet18", 3, 10, width=0)
    assert ei.value.key == "model.width"


def test_seeded_construction_is_deterministic():
    for name in ("resnet18", "cnn"):
        torch.manual_seed(123)
        a = create_model(name, 3, 10, width=0.25).state_dict()
        torch.manual_seed(123)
        b = create_model(name, 3, 10, width=0.25).state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
        torch.manual_seed(124)
        c = create_model(name, 3, 10, width=0.25).state_dict()
        assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("name,width", [("resnet18", 0.125), ("resnet50", 0.0625), ("cnn", 0.25)])
def test_channels_last_and_bf16_autocast(name, width):
    torch.manual_seed(0)
    m = create_model(name, 3, 10, width=width)
    x = torch.randn(4, 3, 16, 16)
    ref_feat, ref_logits = m.eval()(x)
    m = m.to(memory_format=torch.channels_last)
    feat, logits = m(x.contiguous(memory_format=torch.channels_last))
    assert torch.allclose(feat, ref_feat, atol=1e-4) and torch.allclose(logits, ref_logits, atol=1e-4)
    m.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        feat, logits = m(x.contiguous(memory_format=torch.channels_last))
    assert torch.isfinite(feat.float()).all() and torch.isfinite(logits.float()).all()
    loss = F.cross_entropy(logits.float(), torch.arange(4))
    loss.backward()
    assert m.prototypes.grad is not None and torch.isfinite(m.prototypes.grad).all()


def test_register_model_decorator():
    @register_model("tiny_test_net")
    def tiny(facts: ModelFacts, options):
        enc = nn.Sequential(nn.Conv2d(facts.in_channels, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        enc.feature_dim = 4
        return enc

    try:
        assert "tiny_test_net" in list_models()
        m = create_model("tiny_test_net", 2, 3)
        feat, logits = m(torch.randn(2, 2, 8, 8))
        assert feat.shape == (2, 4) and logits.shape == (2, 3)
    finally:
        from flare import models

        models.MODELS._entries.pop("tiny_test_net", None)


@pytest.mark.parametrize("kw", [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1),
                                dict(kernel_size=2, ceil_mode=True)])
@pytest.mark.parametrize("shape", [(16, 8, 28, 28), (5, 1, 9, 11), (4, 32, 7, 7)])
def test_channels_last_max_pool_is_torchs_bit_for_bit(kw, shape):
    """flare's MaxPool2d takes its own path (the grad_fn says so) and gives torch's values and gradients exactly,
    on inputs full of ties (ReLU zeros, values on a coarse grid) where a different tie rule would show."""
    from flare.models.pool import MaxPool2d

    torch.manual_seed(0)
    x = ((torch.randn(*shape) * 4).round() / 4).relu()
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = nn.MaxPool2d(**kw)(a), MaxPool2d(**kw)(b)
    assert "MaxPool" in type(yb.grad_fn).__name__ and type(yb.grad_fn) is not type(ya.grad_fn)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    with torch.no_grad():
        yc = MaxPool2d(**kw)(x)
    assert torch.equal(ya, yb) and torch.equal(ya, yc) and torch.equal(a.grad, b.grad)
    assert yb.is_contiguous() and yc.is_contiguous() and b.grad.is_contiguous()


def test_channels_last_max_pool_under_vmap_and_grad():
    """The batched engine vmaps a functional call of K stacked models: the same losses and gradients as torch's
    pool under vmap, with autograd outside it and with torch.func.grad inside."""
    from torch.func import functional_call, grad, stack_module_state, vmap

    from flare.models.pool import MaxPool2d

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(196, 10))
    ours = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), MaxPool2d(2), nn.Flatten(), nn.Linear(196, 10))
    ours.load_state_dict(net.state_dict())
    params, bufs = stack_module_state([net, net, net])
    x, y = torch.randn(3, 8, 1, 14, 14), torch.randint(0, 10, (3, 8))

    def loss(m):
        return lambda p, b, xx, yy: F.cross_entropy(functional_call(m, (p, b), (xx,)), yy)

    grads = []
    for m in (net, ours):
        p = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
        vmap(loss(m))(p, bufs, x, y).sum().backward()
        grads.append(({k: v.grad for k, v in p.items()}, vmap(grad(loss(m)))(params, bufs, x, y)))
    for k in params:
        assert torch.equal(grads[0][0][k], grads[1][0][k]) and torch.equal(grads[0][1][k], grads[1][1][k])


def test_small_networks_pool_through_flare_max_pool():
    from flare.models.pool import MaxPool2d

    for name in ("cnn", "simple-cnn", "cnn_mnist_dense", "cnn_dense", "cnn_coboost"):
        pools = [m for m in create_model(name, 1, 10, 1.0).modules() if isinstance(m, nn.MaxPool2d)]
        assert pools and all(type(m) is MaxPool2d for m in pools), name
