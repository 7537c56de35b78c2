"""Clients of different architectures (`model.clients`) over FLARE's Flower protocol, driven in-process with the
engine stand-in of test_flower_protocol.py: each node trains its own client's network from that architecture's
seeded init, the server gates and scores each upload as its client's architecture, the numbers are `flare run`'s,
and the saved predictor rebuilds every client's network."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("flwr")

from flwr.supercore.task_identity import TaskIdentity  # noqa: E402
from test_flower_protocol import Nodes, rounds_of, strip  # noqa: E402  (the engine stand-in)

from flare.config import load_config  # noqa: E402
from flare.flower.client_app import handle_train  # noqa: E402
from flare.flower.predictor import load_predictor, save_predictor  # noqa: E402
from flare.flower.server import FederationSettings, Reply, ServerSession, run_federation  # noqa: E402
from flare.flower.server_app import make_exchange  # noqa: E402
from flare.loop import gate_uploads  # noqa: E402
from flare.models import create_model  # noqa: E402
from flare.rundir import RunDir, read_jsonl  # noqa: E402
from flare.runner import Run  # noqa: E402
from flare.server.strategy import ModelPredictor  # noqa: E402
from flare.data.prepare import prepare_data  # noqa: E402
from flare.setup import ServerSetup  # noqa: E402

FMNIST = Path("/usr/share/datasets/fashion-mnist")
pytestmark = pytest.mark.skipif(not (FMNIST / "train-images-idx3-ubyte.gz").exists(),
                                reason="Fashion-MNIST (Debian's dataset-fashion-mnist) is not installed")
ARCHS = ["cnn", "wrn16_1", "cnn_dense"]


@pytest.fixture
def mixed(tmp_path):
    """A tiny Fashion-MNIST run of three clients, each of its own architecture, projected to one d = 16."""
    return ["dataset.name=fmnist", f"dataset.root={FMNIST}", f"dataset.cache_dir={tmp_path / 'cache'}",
            "dataset.train_subset=150", "dataset.test_subset=100", f"model.clients=[{','.join(ARCHS)}]",
            "model.feature_dim=16", "model.width=0.125", "num_clients=3", "rounds=2", "batch_size=16",
            "partition.alpha=0.5", "device=cpu", "test_batch_size=50"]


class Grid:
    """Flower's grid as the ServerApp's `make_exchange` uses it, each message answered by the ClientApp's handler
    of its node (what the ServerApp reads of a reply: its source node, its error, its content)."""

    def __init__(self, nodes: Nodes):
        self.nodes, self.sent = nodes, []

    def send_and_receive(self, msgs, timeout):
        self.sent += [sorted(m.content.keys()) for m in msgs]
        return [SimpleNamespace(metadata=SimpleNamespace(src_node_id=m.metadata.dst_node_id), has_error=lambda: False,
                                content=handle_train(m.content, self.nodes.ctx[m.metadata.dst_node_id]))
                for m in msgs]


def test_a_mixed_federation_reproduces_flare_run_and_its_predictor(mixed, tmp_path, monkeypatch):
    for attr in ("_task_id", "_run_id", "_node_id"):  # Flower's Message wants the identity a ServerApp process has
        monkeypatch.setattr(TaskIdentity, attr, 1)
    cfg = load_config(None, "fafi", mixed)
    assert cfg.mixed_architectures
    Run(cfg, tmp_path / "inproc", quiet=True).execute()
    nodes = Nodes()
    grid, fed = Grid(nodes), FederationSettings(preset="fafi", overrides=" ".join(mixed), out_dir=str(tmp_path / "fed"))
    run_federation(cfg, fed, make_exchange(grid, 60.0), nodes.ids, log=lambda m: None)  # per-round messages
    # the first message carries what the primary strategy's initialize sends (every architecture's init, each node
    # takes its own); later ones carry none
    assert grid.sent == [["init", "task"]] * 3 + [["task"]] * 3
    a, b = rounds_of(tmp_path / "inproc"), rounds_of(tmp_path / "fed")
    assert [r["round"] for r in b] == [0, 1] and all(r["clients"] == [0, 1, 2] for r in b)
    assert [strip(r) for r in a] == [strip(r) for r in b]
    assert all(0 <= r[k] <= 1 for r in b for k in ("acc_feature", "acc_output"))
    ca, cb = ([{k: v for k, v in r.items() if k != "seconds"} for r in read_jsonl(d / "metrics.jsonl")
               if r["kind"] == "client"] for d in (tmp_path / "inproc", tmp_path / "fed"))
    assert ca == cb and len(cb) == 6 and all(r["num_samples"] > 0 for r in cb)
    part = json.loads((tmp_path / "fed" / "partition.json").read_text())
    assert [c["model"] for c in part["clients"]] == ARCHS

    info = json.loads((tmp_path / "fed" / "predictor.json").read_text())
    assert info["rule"] == "feature" and [m["name"] for m in info["models"].values()] == ARCHS
    pred = load_predictor(tmp_path / "fed")  # each client state into its own architecture
    data, _ = prepare_data(cfg)
    acc = int((pred.predict(data.test_x) == data.test_y).sum()) / len(data.test_y)
    assert acc == pytest.approx(b[-1]["acc_feature"], abs=1e-9)


def test_an_upload_of_another_architecture_is_rejected_by_the_gate(mixed, tmp_path):
    """A reply that decodes (the transport's `train`) but holds another client architecture's network is turned away
    by the loop's gate, which says so, and its node is dropped."""
    ov = [o for o in mixed if not o.startswith("rounds=")] + ["rounds=1"]
    fed = FederationSettings(preset="fafi", overrides=" ".join(ov), out_dir=str(tmp_path / "gate"), min_clients=2)
    s = ServerSession(fed.load_config(), fed, log=lambda m: None)
    try:
        sent = s.setup.initial_message()  # one seeded init per client architecture, beside the anchors' seed
        assert sorted({k.split("/")[0] for k in sent}) == ["anchor_seed", "init", "init-1", "init-2"]
        inits = [s.setup.client_init(i).state_dict() for i in range(3)]
        assert inits[0].keys() != inits[1].keys()

        def reply(node, cid, state):
            meta = {"client": cid, "num-samples": 10, "class-histogram": [1] * 10,
                    "records": json.dumps([{"client": cid, "round": 0}])}
            return Reply(node, meta=meta, state={k: v.detach().cpu().clone() for k, v in state.items()})

        # client 1 runs wrn16_1 but uploads a cnn (client 0's architecture); client 2 uploads its own
        replies = [reply(10, 0, inits[0]), reply(11, 1, inits[0]), reply(12, 2, inits[2])]
        s.send, s.nodes = (lambda task, init, nodes, session: replies), [10, 11, 12]
        s.train(0, 1, {})
        assert [u.client for u in s.received] == [0, 1, 2] and not s.events  # each reply decodes
        uploads, _, roll = gate_uploads(s.setup, s, 0, s.setup.scored(0), [], s._warn)
        assert [u.client for u in uploads] == [0, 2] and s.nodes == [10, 12] and roll["missing_clients"] == [1]
        (ev,) = s.events
        assert ev["kind"] == "rejected" and ev["client"] == 1
        why = " ".join(ev["reasons"])
        assert why.startswith("it holds a cnn network, but client 1 runs wrn16_1") and "missing" in why, why
    finally:
        s.close()


def test_the_predictor_of_a_model_building_primary_is_its_architectures_or_declined(mixed, tmp_path):
    """A strategy's one model (FedDF's student: the server architecture, here `server.model=cnn_coboost`, which no
    client runs) is saved and rebuilt as that architecture; K models in one ModuleList (what BN recalibration
    builds) are declined with the reason."""
    cfg = load_config(None, "fafi", mixed + ["dataset.public_size=30", "server.primary=feddf",
                                             "server.model=cnn_coboost"])
    meta = ServerSetup.build(cfg).meta
    student = create_model("cnn_coboost", meta.in_channels, meta.num_classes, 0.125, head=cfg.head, feature_dim=16)
    record, w = {"round": 1, "acc": 0.5}, torch.ones(3) / 3
    out = RunDir(tmp_path / "p")
    out.path.mkdir()
    saved = save_predictor(out, cfg, meta, [], w, None, record, 16, {"feddf": ModelPredictor(student)})
    assert saved == out.path / "predictor.pt"
    info = json.loads((out.path / "predictor.json").read_text())
    assert info["rule"] == "model" and info["model"]["name"] == "cnn_coboost" and "models" not in info
    (net,) = load_predictor(out.path).models
    assert all(torch.equal(net.state_dict()[k], v) for k, v in student.state_dict().items())
    ensemble = torch.nn.ModuleList([student, student])
    (tmp_path / "q").mkdir()
    why = save_predictor(RunDir(tmp_path / "q"), cfg, meta, [], w, None, record, 16,
                         {"feddf": ModelPredictor(ensemble)})
    assert isinstance(why, str) and "no predictor saved" in why and "feddf" in why


def test_a_federation_with_feature_dim_and_its_own_server_model_reproduces_flare_run(tiny_overrides, tiny_folder,
                                                                                     tmp_path):
    """The nodes build the clients' architecture with its projection (not server.model's), and predictor.json
    loads back with it."""
    from flare.data.datasets import load_dataset

    ov = tiny_overrides + ["rounds=1", "model.feature_dim=16", "server.model=wrn16_1"]  # d: cnn 32, wrn16_1 16
    Run(load_config(None, "fafi", ov), tmp_path / "inproc", quiet=True).execute()
    Nodes().federate(ov, tmp_path / "fed")
    (last,) = rounds_of(tmp_path / "fed")
    assert strip(last) == strip(rounds_of(tmp_path / "inproc")[-1])
    pred = load_predictor(tmp_path / "fed")
    cnn = type(create_model("cnn", 3, 4).encoder)
    assert pred.models and all(m.proj is not None and type(m.encoder) is cnn for m in pred.models)
    data = load_dataset("imagefolder", tiny_folder, cache_dir=tmp_path / "cache")
    assert float((pred.predict(data.test_x) == data.test_y).float().mean()) == pytest.approx(last["acc"], abs=1e-9)
