"""The model zoo (docs/models.md): timm architectures by name with a small-input stem, the literature's CIFAR
networks, and `model.checkpoint`."""
from __future__ import annotations

import sys

import pytest
import torch

from flare.cli import main
from flare.config import load_config
from flare.errors import FlareError
from flare.models import create_model, list_models, load_checkpoint, timm_zoo
from flare.registry import MODELS
from flare.data.prepare import DataMeta
from flare.setup import init_models

CIFAR_NETS = {"wrn16_1": 64, "wrn40_1": 64, "cnn_dense": 64, "cnn_coboost": 2048}
SIZES = [(1, 28), (3, 32)]  # Fashion-MNIST, CIFAR


def _step(model, channels, size, batch=2):
    """Forward + backward on a batch; returns the features."""
    feat, logits = model(torch.randn(batch, channels, size, size))
    logits.sum().backward()
    assert all(p.grad is not None for p in model.encoder.parameters() if p.requires_grad)
    return feat


def test_the_zoo_is_registered_like_any_model():
    assert set(CIFAR_NETS) <= set(list_models())
    rows = dict(MODELS.describe())
    assert any(k.startswith("timm/<") for k in rows)


@pytest.mark.parametrize("name,d", CIFAR_NETS.items())
@pytest.mark.parametrize("channels,size", SIZES)
def test_cifar_networks(name, d, channels, size):
    torch.manual_seed(0)
    m = create_model(name, channels, 10, width=0.5)
    assert m.feature_dim == d // 2
    feat = _step(m, channels, size)
    assert feat.shape == (2, d // 2) and torch.isfinite(feat).all()


def test_the_papers_cnns_refuse_images_too_small_for_them():
    create_model("cnn_dense", 3, 10)(torch.randn(1, 3, 18, 18))
    with pytest.raises(FlareError, match="at least 18×18.*got 16×16") as e:
        create_model("cnn_coboost", 3, 10)(torch.randn(1, 3, 16, 16))
    assert e.value.key == "model.name"


def test_wrn_depths_and_init():
    def convs(name):
        return sum(isinstance(x, torch.nn.Conv2d) for x in create_model(name, 3, 10).encoder.modules())
    # 1 stem + 2 per block (3 groups of (depth − 4)/6 blocks) + a 1×1 shortcut where the width changes
    assert convs("wrn16_1") == 1 + 2 * 6 + 2 and convs("wrn40_1") == 1 + 2 * 18 + 2
    bn = next(x for x in create_model("wrn16_1", 3, 10).encoder.modules() if isinstance(x, torch.nn.BatchNorm2d))
    assert torch.equal(bn.weight, torch.ones_like(bn.weight)) and torch.equal(bn.bias, torch.zeros_like(bn.bias))


@pytest.mark.parametrize("head", ["prototype", "linear", "etf"])
@pytest.mark.parametrize("name", ["wrn16_1", "timm/mobilenetv3_small_050"])
def test_every_head_on_zoo_models(name, head):
    if name.startswith("timm/"):
        pytest.importorskip("timm")
    torch.manual_seed(0)
    m = create_model(name, 3, 7, head=head)
    feat, logits = m(torch.randn(2, 3, 32, 32))
    assert feat.shape == (2, m.feature_dim) and logits.shape == (2, 7) and m.head_kind == head


# (timm name, options, spatial size of the last feature map at 32×32 with the small stem)
TIMM_FAMILIES = [
    ("resnet18", {}, 4),
    ("mobilenetv3_small_050", {}, 2),
    ("efficientnet_b0", {}, 2),
    ("vit_tiny_patch16_224", {"patch_size": 4, "depth": 2}, None),  # a patchify stem: img_size instead
]


@pytest.mark.parametrize("name,options,last", TIMM_FAMILIES, ids=[f[0] for f in TIMM_FAMILIES])
@pytest.mark.parametrize("channels,size", SIZES)
def test_timm_families_at_small_inputs(name, options, last, channels, size):
    pytest.importorskip("timm")
    options = {**options, "img_size": size} if name.startswith("vit") else options
    torch.manual_seed(0)
    m = create_model(f"timm/{name}", channels, 10, options=options)
    feat = _step(m, channels, size)
    assert feat.shape == (2, m.feature_dim) and torch.isfinite(feat).all()
    if last is not None and size == 32:
        with torch.no_grad():
            assert m.encoder.forward_features(torch.randn(1, channels, size, size)).shape[-1] == last


def test_the_small_stem_rule():
    pytest.importorskip("timm")
    small = create_model("timm/resnet18", 3, 10).encoder
    assert small.conv1.stride == (1, 1) and isinstance(small.maxpool, torch.nn.Identity)
    assert small.layer2[0].conv1.stride == (2, 2)  # the stages keep theirs
    built = create_model("timm/resnet18", 3, 10, options={"stem": "timm"}).encoder
    assert built.conv1.stride == (2, 2) and isinstance(built.maxpool, torch.nn.MaxPool2d)
    vit = create_model("timm/vit_tiny_patch16_224", 3, 10, options={"img_size": 32, "depth": 1}).encoder
    assert vit.patch_embed.proj.stride == (16, 16)  # patchify: left alone


def test_timm_names_options_and_width():
    pytest.importorskip("timm")
    assert len(timm_zoo.timm_names()) > 500 and "timm/resnet18" in MODELS and "timm/resnt18" not in MODELS
    with pytest.raises(FlareError, match=r"did you mean timm/resnet18") as e:
        MODELS.entry("timm/resnt18")
    assert e.value.key == "model.name"
    cfg = load_config(overrides=["model.name=timm/resnet18", "model.options.drop_rate=0.1"])
    assert cfg.model.options == {"stem": "small", "drop_rate": 0.1}
    with pytest.raises(FlareError, match="model.width=0.5") as e:
        create_model("timm/resnet18", 3, 10, width=0.5)
    assert e.value.key == "model.width"
    with pytest.raises(FlareError) as e:
        create_model("timm/resnet18", 3, 10, options={"pretrained": True})
    assert e.value.key == "model.options.pretrained"
    with pytest.raises(FlareError, match="could not build resnet18") as e:
        create_model("timm/resnet18", 3, 10, options={"no_such_kwarg": 1})
    assert e.value.key == "model.options"


def test_timm_names_without_timm_say_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # `import timm` raises ImportError
    timm_zoo._names.cache_clear()
    try:
        with pytest.raises(FlareError, match=r"need timm.*flare-ofl\[zoo\]"):
            create_model("timm/resnet18", 3, 10)
        assert create_model("cnn", 3, 10).feature_dim == 128  # the core does not need it
        assert any(k == "timm/<name>" for k, _ in MODELS.namespaces())
    finally:
        timm_zoo._names.cache_clear()


def test_flare_models_lists_the_zoo(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in CIFAR_NETS:
        assert name in out.split()
    assert "timm/<" in out and len(out.splitlines()) < 40  # one row for timm, not its every name


# --- model.checkpoint ---------------------------------------------------------------------------------------

META = DataMeta("tiny", ["a", "b", "c"], 3, 12, [0.5] * 3, [0.25] * 3)


def _init(seed, *extra):
    cfg = load_config(overrides=[f"seed={seed}", "model.name=wrn16_1", "model.width=0.5", *extra])
    return init_models(cfg, META, torch.device("cpu"))[0]  # the server architecture's seeded init


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_checkpoint_round_trip_gives_the_same_init(tmp_path):
    ref = _init(1)
    assert not _same(ref, _init(2))
    for i, obj in enumerate((ref.state_dict(), {"model": ref.state_dict()}, {"state_dict": ref.state_dict()})):
        torch.save(obj, tmp_path / f"{i}.pt")
        assert _same(ref, _init(2, f"model.checkpoint={tmp_path / f'{i}.pt'}"))
    # an encoder's state alone: the encoder comes from the file, the head from the seed
    torch.save(ref.encoder.state_dict(), tmp_path / "enc.pt")
    m, seeded = _init(2, f"model.checkpoint={tmp_path / 'enc.pt'}"), _init(2)
    assert _same(m.encoder, ref.encoder) and _same(m.head, seeded.head)


def test_a_checkpoint_that_does_not_fit_names_the_tensor(tmp_path):
    torch.save(create_model("wrn16_1", 3, 3, width=1.0).state_dict(), tmp_path / "wide.pt")
    with pytest.raises(FlareError, match=r"tensor 'encoder\.conv1\.weight' has shape \(16, 3, 3, 3\) there, the "
                                         r"model's is \(8, 3, 3, 3\)") as e:
        _init(1, f"model.checkpoint={tmp_path / 'wide.pt'}")
    assert e.value.key == "model.checkpoint"


@pytest.mark.parametrize("content,message", [(None, "is not a file"), (b"not a torch file", "cannot be read"),
                                             ("code", "cannot be read")])
def test_unreadable_checkpoints(tmp_path, content, message):
    p = tmp_path / "c.pt"
    if content == "code":  # a pickle that needs code to load: weights_only refuses it
        torch.save({"model": torch.nn.Linear(2, 2)}, p)
    elif content is not None:
        p.write_bytes(content)
    model = create_model("cnn", 3, 3)
    with pytest.raises(FlareError, match=message) as e:
        load_checkpoint(model, str(p))
    assert e.value.key == "model.checkpoint"


def test_a_run_with_a_timm_model_from_a_checkpoint(tiny_overrides, tmp_path, capsys):
    """`flare run` end to end with a zoo model, every client starting from a local file."""
    pytest.importorskip("timm")
    name = "timm/mobilenetv3_small_050"
    torch.save(create_model(name, 3, 4).encoder.state_dict(), tmp_path / "enc.pt")
    argv = ["run", *tiny_overrides, f"model.name={name}", "model.width=1", "rounds=1", "num_clients=2",
            f"model.checkpoint={tmp_path / 'enc.pt'}", "--out", str(tmp_path / "run"), "--quiet"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "checkpoint:" in (tmp_path / "run" / "config.yaml").read_text()


# --- the literature's sizes ---------------------------------------------------------------------------------

# Parameter counts of the reference networks at width 1 for 3×32×32 inputs and 10 classes with a linear classifier
# (the published ResNet-18 for CIFAR, WRN-16-1 and WRN-40-1 of Zagoruyko & Komodakis, DENSE's and Co-Boosting's
# CNNs): a layer added, dropped or resized anywhere changes the count.
REFERENCE_PARAMETERS = {"resnet18": 11_173_962, "wrn16_1": 175_066, "wrn40_1": 563_930, "cnn_dense": 122_570,
                        "cnn_coboost": 319_242}


@pytest.mark.parametrize("name,count", REFERENCE_PARAMETERS.items())
def test_the_zoo_has_the_references_parameter_counts(name, count):
    m = create_model(name, 3, 10, width=1.0, head="linear")
    assert sum(p.numel() for p in m.parameters()) == count
    m.eval()
    with torch.no_grad():  # and it is the network for that input: one CIFAR image in, ten logits out
        assert m(torch.zeros(1, 3, 32, 32))[1].shape == (1, 10)


# --- a run from a checkpoint ----------------------------------------------------------------------------------


def _starting_states(overrides, out, monkeypatch):
    """Every client's model at the start of its first round, in a real run (what training starts from)."""
    from flare.client.trainer import Client
    from flare.runner import Run
    seen, real = {}, Client.train_round

    def spy(self, ctx, round_idx, *a, **k):
        if round_idx == 0:
            seen[self.cid] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return real(self, ctx, round_idx, *a, **k)

    monkeypatch.setattr(Client, "train_round", spy)
    Run(load_config(None, "fafi", overrides), out, quiet=True).execute()
    monkeypatch.setattr(Client, "train_round", real)
    return seen


def test_a_run_from_a_checkpoint_trains_every_client_from_its_tensors(tiny_overrides, tmp_path, monkeypatch):
    """config.yaml naming the file is not enough: the weights each client trains from are the file's."""
    torch.manual_seed(12345)
    ckpt = create_model("cnn", 3, 4, width=0.25).state_dict()  # the tiny dataset: 3 channels, 4 classes
    torch.save(ckpt, tmp_path / "ckpt.pt")
    ov = tiny_overrides + ["rounds=1", "client_engine=sequential"]
    loaded = _starting_states(ov + [f"model.checkpoint={tmp_path / 'ckpt.pt'}"], tmp_path / "from", monkeypatch)
    seeded = _starting_states(ov, tmp_path / "seeded", monkeypatch)
    assert len(loaded) == len(seeded) == 3
    for cid, state in loaded.items():
        assert state.keys() == ckpt.keys() and all(torch.equal(state[k], ckpt[k]) for k in ckpt), cid
        assert not all(torch.equal(seeded[cid][k], ckpt[k]) for k in ckpt)  # the seeded init is another start
