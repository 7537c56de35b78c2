"""The protocols (flare/protocols/*.yaml, layered by config/load.py): protocol=reference sets every item its overlay
names, a key the preset, file or override sets wins, clean changes nothing, and every item really changes the
computation it names (BN at evaluation, input scaling, baselines, progress, Plan B, precision, drop_last,
partitions)."""
import hashlib
import math
from importlib import resources

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from flare.client.plan import progress_at, run_progress
from flare.client.terms.align import align_target
from flare.config import build_config, list_presets, load_config, preset_mapping
from flare.config import load as config_load
from flare.config.load import key_default
from flare.config.protocol import ITEM_KEYS, protocol_label
from flare.errors import FlareError
from flare.records import get_key, set_key
from flare.registry import PROGRESS, STRATEGIES
from flare.rundir import read_jsonl
from flare.runner import Run
from flare.server.evaluator import evaluate_predictors
from flare.server.fusion import ClientOutputs
from flare.server.rules import FeatureRule, OutputRule, fedavg_model, fuse_outputs
from flare.server.strategy import ServerContext, make_strategy
from flare.backend import amp_dtype_for
from flare.data.prepare import DataMeta
from flare.setup import RunSetup, ServerSetup, make_augment, normalizer
from flare.server.protos import train_global_prototypes
from conftest import make_partition

REFERENCE = yaml.safe_load((resources.files("flare") / "protocols" / "reference.yaml").read_text())


def _get(cfg, key):
    """The value a run reads for `key`; a strategy's option through the strategy (its default when unset)."""
    if key.startswith("server.strategies."):
        _, _, name, option = key.split(".")
        return getattr(STRATEGIES.get(name).options_in(cfg), option)
    v = cfg
    for p in key.split("."):
        v = getattr(v, p)
    return v


def _overlay_for(overlay: dict, cfg: dict) -> dict:
    """The file's items for a resolved config, read here on their own: the plain keys, then each `when` branch
    that matches the config's value of its key, in order."""
    out = {k: v for k, v in overlay.items() if k != "when"}
    for key, by_value in overlay.get("when", {}).items():
        out.update(_overlay_for(by_value.get(get_key(cfg, key), {}), cfg))
    return out


# ----------------------------------------------------------------------------------------------
# the overlay and its layering


def test_the_items_are_the_overlay_files_keys_and_clean_changes_nothing():
    assert ITEM_KEYS[:2] == ("eval.bn", "augment.input_scaling") and len(ITEM_KEYS) == 12
    assert set(ITEM_KEYS) == {k for k in REFERENCE if k != "when"}  # every item has a value in the file's body
    default = load_config(None, "fafi", [])
    assert default.protocol == "clean"
    for key in ITEM_KEYS:  # the clean value of an item is its default, and the reference one differs for most
        assert _get(default, key) == key_default(key) is not None, key
    assert [k for k in ITEM_KEYS if REFERENCE[k] == key_default(k)] == ["server.strategies.output.ensemble",
                                                                           "progress", "drop_last", "partition.rng"]
    assert load_config(None, "fafi", ["protocol=clean"]).model_dump() == {**default.model_dump(), "protocol": "clean"}
    assert protocol_label(default.model_dump(mode="json")) == "clean"


@pytest.mark.parametrize("kind", ["dirichlet", "dirichlet-fafi", "iid", "shards"])
def test_reference_is_the_overlay_layered_under_each_preset(kind):
    """For every method preset: protocol=reference resolves to the clean config with the overlay's items (read
    from the file here, their `when` branches matched against the clean config) written under the preset — a key
    the preset sets itself (FedETF's logit ensemble) wins — and is labelled `reference` plus what the preset
    pins."""
    compared = 0
    for preset in list_presets():
        try:
            clean = load_config(None, preset, [f"partition.kind={kind}"])
        except FlareError:  # a preset that refuses this partition (none today) refuses it under either protocol
            continue
        ref = load_config(None, preset, ["protocol=reference", f"partition.kind={kind}"])
        items = {k: v for k, v in _overlay_for(REFERENCE, clean.model_dump(mode="json")).items()
                 if get_key(preset_mapping(preset), k) is None}
        explicit = {"partition": {"kind": kind}}
        for k, v in items.items():
            set_key(explicit, k, v)
        assert ref.model_dump() == {**load_config(None, preset, explicit).model_dump(), "protocol": "reference"}
        for k in ITEM_KEYS:
            assert _get(ref, k) == items.get(k, _get(clean, k)), (preset, k)
        pinned = [k for k in ITEM_KEYS if k not in items and _get(ref, k) != _overlay_for(REFERENCE, ref.model_dump(
            mode="json")).get(k)]  # what the preset pins away from the protocol, which the label names
        assert protocol_label(ref.model_dump(mode="json")) == "reference" + "".join(
            f", {k}={get_key(ref.model_dump(mode='json'), k)}" for k in pinned)
        compared += 1
    assert compared == len(list_presets())


@pytest.mark.parametrize("preset, extra, expect", [  # the dependent items, as docs/reproduction.md states them
    ("fafi", ["partition.kind=dirichlet-fafi"], {"progress": "round-reset", "drop_last": True, "partition.rng": "legacy",
                                                 "server.strategies.output.ensemble": "softmax"}),
    ("ensemble", [], {"server.strategies.output.ensemble": "logits", "progress": "epoch", "drop_last": False}),
    ("flare", ["partition.kind=dirichlet-fafi"], {"progress": "epoch-end", "drop_last": True}),
    ("uw-anneal-linear", ["partition.kind=dirichlet-fafi"], {"progress": "epoch"}),
    ("fedetf", [], {"server.strategies.output.ensemble": "logits"}),
    ("fafi", ["partition.kind=shards"], {"partition.rng": "generator"}),
    ("fafi", ["partition.kind=iid"], {"partition.rng": "legacy"}),
])
def test_reference_values_that_depend_on_another_key(preset, extra, expect):
    cfg = load_config(None, preset, ["protocol=reference", *extra])
    assert {k: _get(cfg, k) for k in expect} == expect


def test_an_overlay_value_is_used_and_its_when_branches_follow_their_key(monkeypatch):
    overlay = {"eval.bn": "batch", "amp": "bf16",
               "when": {"dataset.name": {"svhn": {"amp": "off", "when": {"seed": {3: {"eval.bn": "running"}}}}}}}
    monkeypatch.setattr(config_load, "parsed_protocols", lambda: {"reference": overlay})

    def items(*ov):
        cfg = load_config(None, "fafi", ["protocol=reference", *ov])
        return cfg.eval.bn, cfg.amp, cfg.augment.input_scaling

    assert items() == ("batch", "bf16", "dataset")  # a key the overlay leaves alone keeps its default
    assert items("dataset.name=svhn") == ("batch", "off", "dataset")
    assert items("dataset.name=svhn", "seed=3") == ("running", "off", "dataset")
    assert items("seed=3") == ("batch", "bf16", "dataset")  # a nested branch only inside its parent's
    assert load_config(None, "fafi", ["amp=auto"]).amp == "auto"  # clean: no overlay at all


def test_an_item_set_by_the_file_or_an_override_wins(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("protocol: reference\neval: {bn: running}\n")
    cfg = load_config(f, "fafi", ["amp=bf16"])
    assert cfg.eval.bn == "running" and cfg.amp == "bf16"          # file and override win
    assert cfg.augment.input_scaling == "reference"                # the rest follows the protocol
    assert protocol_label(cfg.model_dump(mode="json")) == "reference, eval.bn=running, amp=bf16"
    # a clean config with one item flipped is labelled so
    assert protocol_label(load_config(None, "fafi", ["eval.bn=batch"]).model_dump(mode="json")) == \
        "clean, eval.bn=batch"
    # a config from before the switch (no protocol, no items) is clean
    assert protocol_label({"seed": 1}) == "clean"


def test_a_written_config_round_trips():
    cfg = load_config(None, "flare", ["protocol=reference", "partition.kind=dirichlet-fafi"])
    again = build_config(cfg.model_dump(mode="json"))
    assert again == cfg
    # its config.yaml holds every item: switching the protocol back keeps them (and labels the difference)
    flipped = build_config({**cfg.model_dump(mode="json"), "protocol": "clean"})
    assert flipped.eval.bn == "batch" and protocol_label(flipped.model_dump(mode="json")).startswith("clean, eval.bn")


@pytest.mark.parametrize("ov, key", [
    (["protocol=referenc"], "protocol"),
    (["protocol=[reference]"], "protocol"),
    (["partition.kind=shards", "partition.rng=legacy"], "partition.rng"),
    (["eval.bn=train"], "eval.bn"),
    (["progress=round"], "progress"),
    (["protocol=reference", "partition.kind=[dirichlet]"], "partition.kind"),
])
def test_bad_protocol_input_names_the_key(ov, key):
    with pytest.raises(FlareError) as e:
        load_config(None, "fafi", ov)
    assert e.value.key == key


def test_plan_b_reference_needs_anchors():
    with pytest.raises(FlareError) as e:
        load_config(None, "fafi", ["server.protos=trainable", "server.protos_flow=reference"])
    assert e.value.key == "align.anchors"


# ----------------------------------------------------------------------------------------------
# partitions (docs/method.md#partitions, docs/reproduction.md#partitions)

CIFAR10 = np.repeat(np.arange(10), 5000)
SVHN = np.repeat(np.arange(10), [4948, 13861, 10585, 8497, 7458, 6882, 5727, 5595, 5045, 4659])


def test_official_partition_matches_the_notes_counts():
    p = make_partition(CIFAR10, 5, "dirichlet-fafi", 1, alpha=0.05, rng="legacy")
    assert p.sizes == [30000, 6972, 5894, 24217, 15612]
    h = p.histogram()
    assert {c: int(h[1, c]) for c in np.flatnonzero(h[1])} == {3: 5000, 6: 106, 8: 1866}
    assert {c: int(h[3, c]) for c in np.flatnonzero(h[3])} == {1: 5000, 3: 63, 4: 4111, 5: 5000, 6: 43, 7: 5000,
                                                               9: 5000}
    assert [round(e, 3) for e in p.entropies()] == [2.585, 0.945, 0.676, 2.353, 1.794]
    # overlapping across clients, never within one; capped at the class size
    assert sum(p.sizes) == 82695 > len(CIFAR10)
    assert all(len(set(ix.tolist())) == len(ix) for ix in p.client_indices)
    assert h.max() == 5000
    for alpha, sizes in ((0.1, [25047, 6905, 20723, 25839, 20002]), (0.3, [19508, 31826, 35794, 22984, 25735]),
                         (0.5, [39296, 32237, 30057, 36893, 20405])):
        assert make_partition(CIFAR10, 5, "dirichlet-fafi", 1, alpha=alpha, rng="legacy").sizes == sizes
    assert make_partition(SVHN, 5, "dirichlet-fafi", 114514, alpha=0.05, rng="legacy").sizes == \
        [242, 6553, 13419, 35090, 26348]


def test_legacy_card_dealer_matches_the_notes_counts_and_entropies():
    p = make_partition(CIFAR10, 5, "dirichlet", 1, alpha=0.05, rng="legacy")
    assert p.sizes == [15274, 13309, 4729, 9738, 6950]
    assert [round(e, 4) for e in p.entropies()] == [1.9079, 1.7997, 0.6091, 1.1689, 1.7245]  # the notes' V9 log
    h = p.histogram()
    assert {c: int(h[2, c]) for c in np.flatnonzero(h[2])} == {1: 1, 2: 69, 5: 514, 6: 4144, 8: 1}
    assert sorted(np.concatenate(p.client_indices).tolist()) == list(range(len(CIFAR10)))  # every sample once
    assert make_partition(SVHN, 5, "dirichlet", 114514, alpha=0.05, rng="legacy").sizes == \
        [2152, 10838, 11948, 28400, 19919]
    c100 = make_partition(np.repeat(np.arange(100), 500), 5, "dirichlet", 1, alpha=0.05, rng="legacy")
    lam = [round(0.1 + e / math.log2(100) * 19.9, 2) for e in c100.entropies()]
    assert lam == [13.51, 14.01, 14.36, 14.17, 14.90]  # the notes' CIFAR-100 warm-start λ (λ_max = 20)


def test_default_partitions_are_unchanged():
    """The generator partitions of before the protocol switch, pinned (sha1 of the concatenated indices)."""
    for kind, sizes, digest in (("dirichlet", [13714, 3519, 19489, 2437, 10841], "027a6b857a8408ef"),
                                ("iid", [10000] * 5, "b9257e8717d8a956"), ("shards", [10000] * 5, "92bb0875570012fd")):
        p = make_partition(CIFAR10, 5, kind, 1, alpha=0.05)
        assert p.sizes == sizes
        assert hashlib.sha1(np.concatenate(p.client_indices).tobytes()).hexdigest()[:16] == digest


# ----------------------------------------------------------------------------------------------
# evaluation: BN mode, ensemble, FedAvg buffers


class _BNNet(nn.Module):
    """feature = BN(conv(x)) pooled; running statistics set far from any batch's."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 3)
        self.prototypes = nn.Parameter(torch.randn(3, 8))
        with torch.no_grad():
            self.bn.running_mean.fill_(5.0)
            self.bn.running_var.fill_(0.01)

    def forward(self, x):
        f = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        return f, self.fc(f)


def evaluate(models, w, G, x, y, norm, *, rules, **kw):
    """The built-in rules by name over the models, through their strategies (softmax ensemble, averaged buffers)."""
    cfg = load_config(None, "fafi", ["server.strategies.output.ensemble=softmax", "server.strategies.fedavg.buffers=average"])
    preds = {n: make_strategy(cfg, n).predictor(ServerContext(0, [], models, w, G, None)) for n in rules}
    return evaluate_predictors(models, preds, x, y, norm, **kw)


def test_batch_bn_changes_feature_rules_only_and_keeps_running_statistics():
    models = [_BNNet(0), _BNNet(1)]
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (96, 3, 6, 6), generator=g, dtype=torch.uint8)
    y = torch.randint(0, 3, (96,), generator=g)
    G = torch.randn(3, 8, generator=g)
    w = torch.tensor([0.5, 0.5])

    def norm(u):
        return u.float() / 255

    kw = dict(rules=("feature", "iffi", "iffi_reference", "output", "fedavg"), batch_size=8)
    run = evaluate(models, w, G, x, y, norm, **kw)
    seen = []  # the running mean every eval-mode BN pass normalised with
    hooks = [m.bn.register_forward_pre_hook(lambda mod, inp: seen.append(None if mod.training else
                                                                        mod.running_mean.clone())) for m in models]
    bat = evaluate(models, w, G, x, y, norm, bn="batch", shuffle_seed=3, **kw)
    for h in hooks:
        h.remove()
    evals = [v for v in seen if v is not None]
    # per batch and client: an eval pass, a train pass, a train noise pass; plus the FedAvg copy's eval pass
    assert len(evals) == 3 * 12 and len(seen) == 3 * 2 * 12 + 12
    assert all(torch.equal(v, torch.full((8,), 5.0)) for v in evals)  # never a previous batch's statistics
    # running stats at 5 / 0.01 push every feature through the same ReLU corner: feature fusion degenerates
    assert run["acc_feature"] != bat["acc_feature"]
    # those keep the clients' own running statistics in every batch (a train-mode pass must not leak into the next
    # batch's eval-mode pass): 12 batches of 8 would move them far from 5 / 0.01
    assert (run["acc_output"], run["acc_fedavg"], run["client_acc"]) == \
        (bat["acc_output"], bat["acc_fedavg"], bat["client_acc"])
    for m, b in zip(models, before):
        assert not m.training
        for k, v in m.state_dict().items():
            assert torch.equal(v, b[k]), k  # buffers (num_batches_tracked too) restored bit for bit
    # the batch pass really used per-batch statistics: equal to a hand-made train-mode forward on the same batches
    order = torch.randperm(96, generator=torch.Generator().manual_seed(3))
    correct = 0
    for s in range(0, 96, 8):
        ix = order[s:s + 8]
        feats = []
        for m in models:
            m.train()
            feats.append(m(norm(x[ix]))[0])
            m.eval()
        h = 0.5 * feats[0] + 0.5 * feats[1]
        scores = FeatureRule.scores(ClientOutputs(torch.stack(feats), None), w, G, "softmax")
        correct += int((scores.argmax(1) == y[ix]).sum())
        assert torch.equal(scores,
                           torch.nn.functional.normalize(h, dim=1) @ G.T)
    for m, b in zip(models, before):
        m.load_state_dict(b)
    assert bat["acc_feature"] == correct / 96


def test_logit_sum_ensemble_is_the_weighted_sum_of_raw_logits():
    logits = torch.tensor([[[2.0, 0.0, -1.0]], [[0.0, 12.0, 0.0]]])  # K=2, B=1, C=3
    w = torch.tensor([0.75, 0.25])
    assert torch.allclose(fuse_outputs(logits, w, "logits"), torch.tensor([[1.5, 3.0, -0.75]]))
    soft = fuse_outputs(logits, w, "softmax")
    assert torch.allclose(soft, 0.75 * logits[0].softmax(-1) + 0.25 * logits[1].softmax(-1))
    # a confident client dominates a sum of raw logits, not a sum of probabilities
    assert soft.argmax(1).item() == 0 and fuse_outputs(logits, w, "logits").argmax(1).item() == 1
    scores = OutputRule.scores(ClientOutputs(None, logits), w, None, "logits")
    assert torch.equal(scores, fuse_outputs(logits, w, "logits"))


def test_fedavg_first_keeps_client_zero_buffers_and_averages_parameters():
    a, b = _BNNet(0), _BNNet(1)
    with torch.no_grad():
        b.bn.running_mean.fill_(-3.0)
        b.bn.num_batches_tracked.fill_(7)
    w = torch.tensor([0.25, 0.75])
    first = fedavg_model([a, b], w, "first")
    avg = fedavg_model([a, b], w, "average")
    assert torch.equal(first.bn.running_mean, a.bn.running_mean)
    assert torch.equal(first.bn.running_var, a.bn.running_var)
    assert torch.allclose(avg.bn.running_mean, torch.full((8,), 0.25 * 5.0 - 0.75 * 3.0))
    for name in ("conv.weight", "bn.weight", "fc.bias", "prototypes"):
        want = 0.25 * a.state_dict()[name] + 0.75 * b.state_dict()[name]
        assert torch.allclose(first.state_dict()[name], want), name


# ----------------------------------------------------------------------------------------------
# inputs and precision

META = DataMeta("cifar10", list("abcdefghij"), 3, 16, [0.49, 0.48, 0.45], [0.25, 0.24, 0.26])


@pytest.mark.parametrize("ds, train, test", [
    ("cifar10", (-1.0, 1.0), (0.0, 1.0)), ("fmnist", (-1.0, 1.0), (0.0, 1.0)),
    ("svhn", (-3.0, 1.0), (-1.0, 1.0)), ("cifar100", (-9.295, 5.905), (-1.8975, 2.0253)),
])
def test_reference_input_scaling(ds, train, test):
    x = torch.zeros(64, 3, 16, 16, dtype=torch.uint8)
    x[:, :, :8] = 255  # every image holds black and white
    cfg = load_config(None, "fafi", ["protocol=reference", f"dataset.name={ds}"])
    aug = make_augment(cfg, META, torch.device("cpu"))
    t = normalizer(cfg, META)(x)
    assert test[0] - 0.01 <= t.min() and t.max() <= test[1] + 0.01
    assert t.min() < test[0] + 0.01 and t.max() > test[1] - 0.01
    lo, hi = [], []
    for s in range(8):
        torch.manual_seed(s)
        v = aug.single_view(x)
        lo.append(float(v.min()))
        hi.append(float(v.max()))
    assert train[0] - 0.01 <= min(lo) and max(hi) <= train[1] + 0.01
    # the colour jitter alone: when it fires, the double-normalised datasets are clamped to [0, 1] before the
    # augmentation's Normalize (torchvision's and kornia's tensor jitter clamp); when it does not, they keep the
    # dataset transform's range (SVHN [-1, 1], CIFAR-100 ≈ [-1.9, 2.0]) and are normalised again
    aug.policy = nn.Sequential(*[m for m in aug.policy if type(m).__name__ == "ColorJitter"])
    m0, s0 = aug.mean, aug.std
    for p_fire, clamped in ((1.0, True), (0.0, ds in ("cifar10", "fmnist"))):
        aug.policy[0].p = p_fire
        u = aug.single_view(x) * s0 + m0  # undo the augmentation's Normalize
        assert (float(u.min()) >= -1e-5 and float(u.max()) <= 1 + 1e-5) == clamped, (ds, p_fire)


def test_clean_scaling_is_the_dataset_statistics_for_training_and_test():
    cfg = load_config(None, "fafi", ["dataset.name=cifar10"])
    x = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    want = (x.float() / 255 - torch.tensor(META.mean)[:, None, None]) / torch.tensor(META.std)[:, None, None]
    assert torch.allclose(normalizer(cfg, META)(x), want, atol=1e-6)


def test_reference_precision_is_fp32_even_on_a_gpu():
    assert amp_dtype_for(load_config(None, "fafi", ["protocol=reference"]), torch.device("cuda")) is None
    assert amp_dtype_for(load_config(None, "fafi", ["amp=bf16"]), torch.device("cuda")) == torch.bfloat16


# ----------------------------------------------------------------------------------------------
# training: baselines' inputs, progress, drop_last, Plan B (tiny runs)


def _records(d, kind):
    return [r for r in read_jsonl(d / "metrics.jsonl") if r["kind"] == kind]


def test_plain_baselines_never_augment(tiny_overrides):
    calls = {}
    for mode in ("plain", "augmented"):
        setup = RunSetup.build(load_config(None, "fedavg", tiny_overrides + [f"loss.ce_input={mode}", "rounds=1"]))
        aug = setup.ctx.augment
        calls[mode] = 0

        def counted(x, aug=aug, mode=mode):
            calls[mode] += 1
            return aug(x)

        setup.ctx.augment = counted
        c = setup.make_clients(lambda m: None, lambda m: None)[0]
        assert c.train_round(setup.ctx, 0)["steps"] >= 1
    assert calls["plain"] == 0 and calls["augmented"] > 0


def test_round_reset_keeps_lambda_constant_with_one_epoch_and_the_v8_target_at_p0(tiny_overrides, tmp_path):
    ov = tiny_overrides + ["rounds=3"]
    ref = Run(load_config(None, "etf-anneal", ov + ["progress=round-reset"]), tmp_path / "rr", quiet=True)
    ref.execute()
    lams = {r["lambda"] for r in _records(tmp_path / "rr", "client")}
    assert lams == {5.0}  # the notes' first batch: λ ≡ λ0 when E = 1
    Run(load_config(None, "etf-anneal", ov), tmp_path / "ep", quiet=True).execute()
    assert sorted({round(r["lambda"], 6) for r in _records(tmp_path / "ep", "client")}, reverse=True) == \
        [5.0, round(5 * 2 / 3, 6), round(5 / 3, 6)]
    # V8: the target's progress restarts every round: j/E with j the epoch in the round (E = 1: always P⁰)
    cfg = load_config(None, "progressive", ov + ["protocol=reference", "local_epochs=2"])
    setup = RunSetup.build(cfg)
    p = run_progress(cfg)
    assert progress_at(p, cfg, 0, 0, 1, 4)[1] == 0.0 and progress_at(p, cfg, 1, 0, 1, 5)[1] == 0.5  # round 2 of 3
    P0, A = setup.make_clients(lambda m: None, lambda m: None)[0].initial_prototypes, setup.server.anchors
    assert torch.equal(align_target(A, "progressive", 0.0, P0), P0)
    e1 = load_config(None, "progressive", ov + ["protocol=reference"])
    for done in range(3):
        assert progress_at(run_progress(e1), e1, 0, 0, 1, done)[1] == 0.0


def test_epoch_end_progress_logs_s_equal_one_minus_r_plus_one_over_r(tiny_overrides, tmp_path):
    cfg = load_config(None, "flare", tiny_overrides + ["rounds=4", "progress=epoch-end"])
    Run(cfg, tmp_path / "f", quiet=True).execute()
    s = {r["round"]: round(r["s_p"], 6) for r in _records(tmp_path / "f", "client") if r["client"] == 0}
    assert s == {r: round(1 - (r + 1) / 4, 6) for r in range(4)}  # V12's logged s(p) in the notes


def test_drop_last_drops_the_incomplete_batch_and_a_tiny_client_trains_nothing(tiny_overrides, tmp_path):
    cfg = load_config(None, "fafi", tiny_overrides + ["drop_last=true", "batch_size=16", "rounds=1"])
    setup = RunSetup.build(cfg)
    warned = []
    clients = setup.make_clients(warned.append, lambda m: None)
    for c in clients:
        assert c.steps_per_epoch == c.num_samples // 16
    small = [c for c in clients if c.num_samples < 16]
    big = next(c for c in clients if c.num_samples >= 16 and c.num_samples % 16)
    assert big.train_round(setup.ctx, 0)["steps"] == big.num_samples // 16
    if small:
        before = {k: v.clone() for k, v in small[0].model.state_dict().items()}
        assert small[0].train_round(setup.ctx, 0)["steps"] == 0
        assert all(torch.equal(v, before[k]) for k, v in small[0].model.state_dict().items())
        assert any("drop_last" in w for w in warned)


def test_plan_b_reference_starts_at_the_anchors_keeps_g_and_predicts_with_the_mean(tiny_overrides, tmp_path):
    ov = tiny_overrides + ["server.server_epochs=2", "rounds=2"]
    cfg = load_config(None, "server-protos", ov + ["server.protos_flow=reference"])
    setup = RunSetup.build(cfg)
    A = setup.server.anchors
    C = A.shape[0]  # the anchors by their definition: a simplex ETF, unit rows at pairwise cosine −1/(C−1)
    assert torch.allclose(A @ A.T, (C * torch.eye(C) - torch.ones(C, C)) / (C - 1), atol=1e-5)
    setup.ctx.received = setup.server.train_message(0)
    assert torch.equal(setup.ctx.received["align_target"], A)           # round 0: G = A, the clients' target
    assert setup.ctx.align_anchors is setup.ctx.received["align_target"]
    clients = setup.make_clients(lambda m: None, lambda m: None)
    for c in clients:
        c.train_round(setup.ctx, 0)
    protos = [c.upload().prototypes for c in clients]
    ev = setup.server.evaluate(0, [c.upload() for c in clients], [c.model for c in clients])
    setup.server.carry(ev)
    # Started at A, G can have moved no farther than Adam's steps allow: step t moves a coordinate by at most
    # lr·sqrt(Σ_i a_i²/b_i) (Cauchy–Schwarz on m̂_t/√v̂_t, a and b the bias-corrected weights of g_i in m̂ and v̂).
    (b1, b2), steps = (0.9, 0.999), cfg.server.server_epochs * len(protos)
    reach = cfg.server.server_lr * sum(
        math.sqrt(sum(((1 - b1) * b1 ** (t - i) / (1 - b1 ** t)) ** 2 / ((1 - b2) * b2 ** (t - i) / (1 - b2 ** t))
                      for i in range(1, t + 1))) for t in range(1, steps + 1))
    mean = torch.stack([p.float() for p in protos]).mean(0)
    assert (ev.kept["G"] - A).abs().max() <= reach + 1e-6
    assert (mean - A).abs().max() > 2 * reach  # so a G started at the clients' mean could not pass the line above
    assert torch.allclose(ev.G, mean)                                   # the prediction uses the plain mean
    setup.ctx.received = setup.server.train_message(1)
    assert torch.equal(setup.ctx.received["align_target"], ev.kept["G"])  # the next round aligns to the trained G
    ev2 = setup.server.evaluate(1, [c.upload() for c in clients], [c.model for c in clients])  # from the carried G
    fresh, _ = train_global_prototypes(protos, cfg.server, setup.server.anchors, init=setup.server.anchors)
    cont, _ = train_global_prototypes(protos, cfg.server, setup.server.anchors, init=ev.kept["G"])
    assert torch.allclose(ev2.kept["G"], cont) and not torch.allclose(ev2.kept["G"], fresh)  # G persists
    spec = RunSetup.build(load_config(None, "server-protos", ov))
    spec.ctx.received = spec.server.train_message(0)
    assert spec.ctx.received == {} and spec.ctx.align_anchors is spec.ctx.anchors  # spec: no G sent


def test_what_the_clients_receive_is_the_primary_strategys_configure_train(tiny_overrides, monkeypatch):
    """One sending hook: a primary that overrides `configure_train` (as a plugin's would) is what every client
    aligns to, round by round; another scored strategy's hook is not asked."""
    cfg = load_config(None, "flare", tiny_overrides + ["server.primary=feature", "eval.rules=[feature,output]"])
    setup = RunSetup.build(cfg)
    A = setup.server.anchors
    monkeypatch.setattr(FeatureRule, "configure_train",
                        lambda self, rnd, carried: {"align_target": torch.full_like(A, float(rnd))})
    monkeypatch.setattr(OutputRule, "configure_train", lambda self, rnd, carried: {"align_target": A})
    (to_anchors, *_), (to_zeros, *_) = (setup.make_clients(lambda m: None, lambda m: None) for _ in range(2))
    to_anchors.train_round(setup.ctx, 0)  # nothing sent yet: the anchors
    setup.ctx.received = setup.server.train_message(0)
    assert torch.equal(setup.ctx.align_anchors, torch.zeros_like(A))
    to_zeros.train_round(setup.ctx, 0)    # the same draws, L_align pulling towards the zeros it received
    # MSE's gradient is ∝ P − target, so the two runs part along (P − 0) − (P − A) = A, towards −A for the zeros
    moved = (to_zeros.model.prototypes - to_anchors.model.prototypes).detach().flatten()
    assert float(torch.nn.functional.cosine_similarity(moved, -A.flatten(), dim=0)) > 0.5
    setup.ctx.received = setup.server.train_message(2)
    assert torch.equal(setup.ctx.align_anchors, torch.full_like(A, 2.0))


def test_plan_b_reference_resumes_with_the_servers_g(tiny_overrides, tmp_path, monkeypatch):
    """The checkpoint carries G: a run cut after round 0 and resumed equals the uninterrupted run."""
    cfg = load_config(None, "server-protos", tiny_overrides + ["server.server_epochs=2", "rounds=3",
                                                               "server.protos_flow=reference"])
    Run(cfg, tmp_path / "whole", quiet=True).execute()
    real = ServerSetup.evaluate

    def crash_in_round_1(self, r, *args, **kw):
        if r == 1:
            raise KeyboardInterrupt
        return real(self, r, *args, **kw)

    monkeypatch.setattr(ServerSetup, "evaluate", crash_in_round_1)
    with pytest.raises(KeyboardInterrupt):
        Run(cfg, tmp_path / "cut", quiet=True).execute()
    monkeypatch.setattr(ServerSetup, "evaluate", real)
    Run(cfg, tmp_path / "cut", quiet=True).execute()

    def clean(d):
        return [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in read_jsonl(d / "metrics.jsonl")]

    assert clean(tmp_path / "cut") == clean(tmp_path / "whole")


def test_progress_is_a_registered_part_the_reference_modes_among_them():
    """`progress` names an entry of PROGRESS: the reference's round-reset is one part that states it does not span
    the run, and a plugin's progress is used, and judged, the same way."""
    assert PROGRESS.get("round-reset").spans_the_run is False and PROGRESS.get("epoch").spans_the_run is True
    anneal = {"align": {"anchors": "etf", "schedule": "linear"}, "rounds": 4, "local_epochs": 2}

    def halfway(facts, options):
        return lambda epoch, batch, steps_per_epoch, epochs_done: 0.5
    halfway.spans_the_run = False
    PROGRESS.register("halfway", halfway)
    try:
        cfg = build_config({**anneal, "progress": "halfway"})
        assert progress_at(run_progress(cfg), cfg, 1, 3, 5, 6) == (0.5, 0.5)
        assert cfg.schedule_dependencies() == []
        assert build_config({**anneal, "progress": "epoch"}).schedule_dependencies() == ["align.schedule=linear"]
    finally:
        del PROGRESS._entries["halfway"]
    with pytest.raises(FlareError, match="progress"):
        build_config({**anneal, "progress": "halfway"})

