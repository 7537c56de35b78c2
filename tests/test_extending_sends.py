"""docs/extending.md's strategy that sends as well as scores (tests/plugins/flare_sending_plugin.py): it registers,
its checks refuse the configs its clients would not train under, `flare run` with it sends what it says (the
clients' prototypes and align loss follow its targets, not the anchors the default run aligns to) and records its
accuracy, and a Flower federation runs the same hooks into the same records."""
import json
import re
import shlex
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flare.cli import main
from flare.config import build_config, load_config
from flare.errors import FlareError
from flare.registry import STRATEGIES
from flare.rundir import read_jsonl
from flare.server.upload import UPLOADS, load_uploads

import flare_sending_plugin as plugin

ROOT = Path(__file__).resolve().parents[1]
SEED = 3  # the targets' seed the runs set (not the option's default, so the option is seen to arrive)


def docs_command() -> list[str]:
    """The `flare run` line of the page's section, as argv after `flare`."""
    page = (ROOT / "docs" / "extending.md").read_text()
    section = page[page.index("### A strategy that sends as well as scores"):]
    (line,) = re.findall(r"^flare run .*$", section, re.M)
    return shlex.split(line)[1:]


def records(d: Path, kind: str) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in read_jsonl(d / "metrics.jsonl")
            if r["kind"] == kind]


def test_the_plugin_registers_and_refuses_what_its_clients_would_not_train_under():
    assert STRATEGIES.get("own_targets") is plugin.OwnTargets
    ok = {"plugins": ["flare_sending_plugin"], "align": {"anchors": "etf"}, "server": {"primary": "own_targets"}}
    build_config(ok)
    refused = [({**ok, "align": {"anchors": "none"}}, "align.anchors"),
               ({**ok, "server": {"primary": "feature"}, "eval": {"rules": ["primary", "own_targets"]}},
                "server.primary"),
               ({**ok, "server": {"primary": "own_targets", "protos": "trainable", "protos_flow": "reference"}},
                "server.protos_flow"),
               ({**ok, "server": {"primary": "own_targets", "strategies": {"own_targets": {"seed": -1}}}},
                "server.strategies.own_targets.seed")]
    for cfg, key in refused:
        with pytest.raises(FlareError) as e:
            build_config(cfg)
        assert e.value.key == key, (key, e.value.message)


def test_the_targets_are_orthonormal_seeded_and_refuse_too_narrow_a_model():
    T = plugin.orthonormal_targets(4, 32, SEED)
    assert torch.allclose(T @ T.T, torch.eye(4), atol=1e-6)
    assert torch.equal(T, plugin.orthonormal_targets(4, 32, SEED))
    assert not torch.allclose(T, plugin.orthonormal_targets(4, 32, SEED + 1))
    with pytest.raises(FlareError) as e:
        plugin.orthonormal_targets(10, 8, SEED)
    assert e.value.key == "model.width"


@pytest.fixture
def overrides(tiny_overrides):
    """The tiny runs: three local epochs a round, enough for the features to learn the sent targets."""
    return tiny_overrides + ["local_epochs=3", f"server.strategies.own_targets.seed={SEED}"]


def test_flare_run_sends_the_targets_and_scores_by_them(overrides, tmp_path):
    """The page's command against itself without `server.primary=own_targets`, on one seed: the clients of the
    own_targets run start from and align to the sent targets, the default's do not; the nearest-target accuracy
    is recorded every round, and is better than chance once the clients have trained against the targets. The
    batched engine's clients receive the same (its records are the sequential engine's, to float tolerance), and
    `flare fuse` scores the saved uploads as the run did."""
    argv = docs_command()
    default = [a for a in argv if a != "server.primary=own_targets"]
    assert default != argv
    for name, cmd in (("own", argv), ("default", default), ("batched", [*argv, "client_engine=batched"])):
        assert main([cmd[0], "--out", str(tmp_path / name), "--quiet", *cmd[1:], *overrides]) == 0
    own, base = records(tmp_path / "own", "round"), records(tmp_path / "default", "round")
    assert len(own) == len(base) == 2
    assert all(r["primary"] == "own_targets" and r["acc"] == r["acc_own_targets"] for r in own)
    assert all("acc_own_targets" not in r for r in base)
    assert own[-1]["acc_own_targets"] >= 0.75  # 4 classes, 32 test images: chance is 0.25

    # what the clients uploaded: prototypes along the targets in the own_targets run only
    _, _, uploads = load_uploads(tmp_path / "own" / UPLOADS, "cpu")
    _, _, default_uploads = load_uploads(tmp_path / "default" / UPLOADS, "cpu")
    C, d = uploads[0].state["head.prototypes"].shape
    T = plugin.orthonormal_targets(C, d, SEED)
    for ups, near in ((uploads, True), (default_uploads, False)):
        for u in ups:
            cos = F.cosine_similarity(u.state["head.prototypes"].float(), T, dim=1)
            assert bool((cos > 0.99).all()) == near, (near, cos)

    # what the clients trained on: the align loss is the distance to the target received, ~0 only for the sent one
    own_clients, base_clients = records(tmp_path / "own", "client"), records(tmp_path / "default", "client")
    assert len(own_clients) == len(base_clients) == 6
    assert all(r["align_loss"] < 1e-2 for r in own_clients), [r["align_loss"] for r in own_clients]
    assert all(r["align_loss"] > 0.1 for r in base_clients), [r["align_loss"] for r in base_clients]
    assert all(a != b for a, b in zip(own_clients, base_clients))
    batched = records(tmp_path / "batched", "client")
    assert len(batched) == 6
    for a, b in zip(own_clients, batched):
        for k in ("base_loss", "align_loss"):
            assert a[k] == pytest.approx(b[k], rel=1e-4), k
    assert [r["acc_own_targets"] for r in records(tmp_path / "batched", "round")] == [r["acc_own_targets"] for r in own]

    # `flare fuse` draws the same targets from the seed and scores the saved uploads as the run did
    assert main(["fuse", str(tmp_path / "own"), "--strategies", "own_targets"]) == 0
    (fused,) = read_jsonl(tmp_path / "own" / "fuse.jsonl")
    assert fused["strategy"] == "own_targets" and fused["acc"] == own[-1]["acc_own_targets"]


def test_a_flower_federation_sends_the_same_and_writes_the_same_records(overrides, tmp_path):
    """The Flower loopback (tests/test_flower_protocol.py's engine stand-in): the nodes take the initial prototypes
    and each round's target from the server's messages, and the federation's round and client records are
    `flare run`'s; no predictor.pt, since the nearest-target scorer is code."""
    pytest.importorskip("flwr")
    from test_flower_protocol import Nodes, strip

    ov = overrides + ["plugins=[flare_sending_plugin]", "align.anchors=etf", "server.primary=own_targets"]
    from flare.runner import Run
    Run(load_config(None, "fafi", ov), tmp_path / "inproc", quiet=True).execute()
    nodes, sent = Nodes(), []
    real = nodes.exchange
    nodes.exchange = lambda task, init, ids, session: sent.append(session.setup.train_message(task.round_start)) or \
        real(task, init, ids, session)
    nodes.federate(ov, tmp_path / "fed")
    assert [sorted(m) for m in sent] == [["align_target"]] * 2
    assert all(torch.equal(m["align_target"], sent[0]["align_target"]) for m in sent)  # the same targets each round
    a, b = records(tmp_path / "inproc", "round"), records(tmp_path / "fed", "round")
    assert len(a) == 2 and all("acc_own_targets" in r for r in b)
    assert [strip(r) for r in a] == [strip(r) for r in b]
    assert records(tmp_path / "inproc", "client") == records(tmp_path / "fed", "client")
    assert not (tmp_path / "fed" / "predictor.pt").exists()
    state = json.loads((tmp_path / "fed" / "state.json").read_text())
    assert any("no predictor saved" in w and "own_targets" in w for w in state["warnings"]), state["warnings"]
