"""FLARE's Flower protocol driven in-process: the ClientApp's handler and the ServerApp's logic, with an
engine stand-in that can crash, silence or tamper with nodes. Fast; the real engines are in
test_flower_engine.py."""
import copy
import io
import json
import pickle
import sys

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict  # noqa: E402

from flare.config import load_config  # noqa: E402
from flare.errors import FlareError  # noqa: E402
from flare.flower.client_app import handle_query, handle_train  # noqa: E402
from flare.flower.protocol import export_partitions  # noqa: E402
from flare.flower.server import FederationSettings, Reply, run_federation  # noqa: E402
from flare.flower.records import pack_nested, record_to_state, state_to_record, unpack_nested  # noqa: E402
from flare.flower.server_app import decode_content, train_content  # noqa: E402
from flare.rundir import read_jsonl  # noqa: E402
from flare.flower import server as flower_server  # noqa: E402
from flare.fuse import fuse_runs  # noqa: E402
from flare.runner import Run  # noqa: E402
from flare import loop  # noqa: E402
from flare.server.upload import UPLOADS, load_uploads  # noqa: E402
from flare.server.rounds import primary_rule  # noqa: E402
from flare.server.strategy import Strategy, make_strategy  # noqa: E402
from flare.setup import RunSetup, run_anchors  # noqa: E402

K = 3


class Nodes:
    """Stands in for Flower's grid: node id → Context, the ClientApp's handler called directly. `crash`
    (node → first failing round) raises inside the real handler, `silent` nodes never answer (a killed or
    hung client), `tamper` edits a node's reply content before the server decodes it."""

    def __init__(self, k=K, node_config=None, cache=None):
        self.ids = [1000 + i for i in range(k)]
        self.ctx = {n: Context(run_id=1, node_id=n, node_config={"partition-id": i, "num-partitions": k,
                                                                  **(node_config or {}).get(i, {})},
                               state=RecordDict(), run_config={}) for i, n in enumerate(self.ids)}
        self.crash: dict[int, int] = {}
        self.silent: set[int] = set()
        self.tamper: dict = {}
        self.cache = cache  # (round_start, node) → reply content, to share training between tests

    def exchange(self, task, include_init, nodes, session):
        content = train_content(task, include_init, session)  # the ServerApp's very message
        out = []
        for n in nodes:
            if n in self.silent:
                continue
            try:
                if n in self.crash and task.round_start >= self.crash[n]:
                    self.ctx[n].node_config["data-path"] = "/nonexistent/client.npz"  # the real handler fails
                key = (task.round_start, task.round_end, n)
                if self.cache is not None and key in self.cache and n not in self.crash:
                    rd = copy.deepcopy(self.cache[key])
                else:
                    rd = handle_train(content, self.ctx[n])
                    if self.cache is not None and n not in self.crash:
                        self.cache[key] = copy.deepcopy(rd)
            except Exception as e:  # what Flower turns into an error reply
                out.append(Reply(n, error=f"ClientApp raised {type(e).__name__}: {e} (code 2)"))
                continue
            if n in self.tamper:
                self.tamper[n](rd)
            out.append(decode_content(n, rd))
        return out

    def talk(self, task, name, rnd, message, nodes):
        """A strategy's round after the upload: the ClientApp's query handler, called directly."""
        content = RecordDict({"task": ConfigRecord(task.to_config()),
                              "talk": ConfigRecord({"strategy": name, "round": rnd}),
                              "message": state_to_record(message)})
        return [decode_content(n, handle_query(content, self.ctx[n])) for n in nodes if n not in self.silent]

    def federate(self, ov, out, preset="fafi", **settings):
        fed = FederationSettings(preset=preset, overrides=" ".join(ov), out_dir=str(out), **settings)
        return run_federation(fed.load_config(), fed, self.exchange, list(self.ids), log=lambda m: None,
                              talk=self.talk)


def rounds_of(d):
    return [r for r in read_jsonl(d / "metrics.jsonl") if r["kind"] == "round"]


def strip(r):
    return {k: v for k, v in r.items() if not k.startswith("seconds") and k not in ("clients", "missing_clients")}


# ----------------------------------------------------------------------------------------------
# records: arrays only, no pickles


def test_state_records_round_trip_exactly():
    state = {"w": torch.randn(3, 4), "n": torch.tensor(7), "b": torch.arange(5, dtype=torch.int64),
             "t": torch.randn(4, 3).T,  # non-contiguous
             "c": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), "h": torch.randn(3).half(),
             "f": torch.tensor([True, False])}
    back = record_to_state(state_to_record(state))
    for k, v in state.items():
        assert back[k].shape == v.shape and back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_nested_state_round_trips_with_int_keys_tuples_and_scalars():
    obj = {"model": {"w": torch.randn(2, 2)}, "optimizer": {"state": {0: {"momentum_buffer": torch.ones(3)}},
                                                             "param_groups": [{"lr": 0.05, "params": [0],
                                                                               "nesterov": False, "foreach": None}]},
           "epochs_done": 3, "pair": (1.5, "x"), "nan": float("nan")}
    arrays, skel = pack_nested(obj)
    back = unpack_nested(arrays, skel)
    assert torch.equal(back["model"]["w"], obj["model"]["w"])
    assert list(back["optimizer"]["state"]) == [0]
    assert torch.equal(back["optimizer"]["state"][0]["momentum_buffer"], torch.ones(3))
    assert back["optimizer"]["param_groups"] == obj["optimizer"]["param_groups"]
    assert back["pair"] == (1.5, "x") and back["epochs_done"] == 3 and np.isnan(back["nan"])


class _Canary:
    path = None

    def __reduce__(self):
        return (open, (self.path, "w"))


def pickled_array(tmp_path):
    """An Array whose bytes are an .npy of dtype object: loading it with pickles allowed would run code."""
    _Canary.path = str(tmp_path / "pwned")
    buf = io.BytesIO()
    np.save(buf, np.array([_Canary()], dtype=object), allow_pickle=True)
    return Array(dtype="float32", shape=(1,), stype="numpy.ndarray", data=buf.getvalue())


def test_an_object_array_is_never_unpickled(tmp_path):
    rec = ArrayRecord()
    rec["x"] = pickled_array(tmp_path)
    with pytest.raises(ValueError):
        record_to_state(rec)
    assert not (tmp_path / "pwned").exists()


# ----------------------------------------------------------------------------------------------
# the same numbers as `flare run`


@pytest.mark.plots
def test_federation_reproduces_flare_run_bit_for_bit(tiny_overrides, tmp_path, monkeypatch):
    """The federation runs the round loop over its grid transport (flare/loop.py), and records what `flare run`
    records: the rounds, the clients' logs, the partition and the uploads the server scored (uploads.pt), which
    `flare fuse` then scores as it scores `flare run`'s."""
    Run(load_config(None, "fafi", tiny_overrides), tmp_path / "inproc", quiet=True).execute()
    transports = []
    monkeypatch.setattr(flower_server, "run_rounds", lambda server, clients, *a, **kw: (
        transports.append(type(clients).__name__), loop.run_rounds(server, clients, *a, **kw))[1])
    Nodes().federate(tiny_overrides, tmp_path / "fed")  # per-round snapshots
    assert transports == ["ServerSession"]
    (ra, sa, ua), (rb, sb, ub) = (load_uploads(tmp_path / d / UPLOADS, "cpu") for d in ("inproc", "fed"))
    assert ra == rb and sa == sb and [u.client for u in ua] == [u.client for u in ub]
    for x, y in zip(ua, ub):
        assert x.num_samples == y.num_samples and x.state.keys() == y.state.keys()
        assert all(torch.equal(x.state[k], y.state[k].to(x.state[k].dtype)) for k in x.state)
    for d in ("inproc", "fed"):
        fuse_runs([str(tmp_path / d)], "fedavg")
    assert ([f["acc"] for f in read_jsonl(tmp_path / "fed" / "fuse.jsonl")]
            == [f["acc"] for f in read_jsonl(tmp_path / "inproc" / "fuse.jsonl")]
            == [rounds_of(tmp_path / "fed")[-1]["acc_fedavg"]])
    a, b = rounds_of(tmp_path / "inproc"), rounds_of(tmp_path / "fed")
    assert [strip(r) for r in a] == [strip(r) for r in b]
    ca = [{k: v for k, v in r.items() if k != "seconds"} for r in read_jsonl(tmp_path / "inproc" / "metrics.jsonl")
          if r["kind"] == "client"]
    cb = [{k: v for k, v in r.items() if k != "seconds"} for r in read_jsonl(tmp_path / "fed" / "metrics.jsonl")
          if r["kind"] == "client"]
    assert ca == cb
    pa = json.loads((tmp_path / "inproc" / "partition.json").read_text())
    pb = json.loads((tmp_path / "fed" / "partition.json").read_text())
    pb.pop("source")
    assert pa == pb
    for f in ("config.yaml", "summary.md", "state.json", "plots/accuracy.png", "federation.json", "predictor.pt",
              "predictor.json"):
        assert (tmp_path / "fed" / f).exists(), f
    assert (tmp_path / "fed" / "config.yaml").read_text() == (tmp_path / "inproc" / "config.yaml").read_text()
    assert json.loads((tmp_path / "fed" / "state.json").read_text())["status"] == "finished"


def test_upload_once_gives_the_final_round_and_the_predictor_reproduces_it(tiny_overrides, tiny_folder, tmp_path):
    from flare.data.datasets import load_dataset
    from flare.flower.predictor import load_predictor

    Run(load_config(None, "fafi", tiny_overrides), tmp_path / "inproc", quiet=True).execute()
    Nodes().federate(tiny_overrides, tmp_path / "fed", upload="once")
    (last,) = rounds_of(tmp_path / "fed")
    assert last["round"] == 1 and strip(last) == strip(rounds_of(tmp_path / "inproc")[-1])
    info = json.loads((tmp_path / "fed" / "predictor.json").read_text())
    assert info["rule"] == "feature" and info["clients"] == [0, 1, 2] and info["accuracy"] == last["acc"]
    pred = load_predictor(tmp_path / "fed")
    data = load_dataset("imagefolder", tiny_folder, cache_dir=tmp_path / "cache")
    acc = float((pred.predict(data.test_x) == data.test_y).float().mean())
    assert acc == pytest.approx(last["acc_feature"], abs=1e-9)


def test_nodes_reading_their_own_files_train_the_same_upload(tiny_overrides, tmp_path):
    cfg = load_config(None, "fafi", tiny_overrides + ["rounds=1"])
    files = export_partitions(cfg, tmp_path / "data")
    ov = tiny_overrides + ["rounds=1"]
    Nodes().federate(ov, tmp_path / "a", upload="once")
    Nodes(node_config={i: {"data-path": str(files[i])} for i in range(K)}).federate(ov, tmp_path / "b", upload="once")
    assert [strip(r) for r in rounds_of(tmp_path / "a")] == [strip(r) for r in rounds_of(tmp_path / "b")]


def test_a_node_without_partition_id_or_with_another_k_fails_clearly(tiny_overrides, tmp_path):
    nodes = Nodes()
    nodes.ctx[1001].node_config.pop("partition-id")
    nodes.ctx[1002].node_config["num-partitions"] = 7
    with pytest.raises(FlareError):
        nodes.federate(tiny_overrides + ["rounds=1"], tmp_path / "x", upload="once")
    fed = json.loads((tmp_path / "x" / "federation.json").read_text())
    reasons = " ".join(" ".join(e["reasons"]) for e in fed["events"])
    assert "partition-id" in reasons and "num-partitions=7" in reasons


# ----------------------------------------------------------------------------------------------
# failures: crashed, killed (silent) and timed-out clients


@pytest.fixture(scope="module")
def shared_cache():
    return {}


@pytest.fixture
def one_round(tiny_overrides):
    return tiny_overrides + ["rounds=1"]


def test_crashed_client_with_min_clients_met_proceeds_and_records_who_was_missing(one_round, tmp_path,
                                                                                  shared_cache):
    nodes = Nodes(cache=shared_cache)
    nodes.crash[1002] = 0
    s = nodes.federate(one_round, tmp_path / "run", upload="once", min_clients=2)
    assert 0 <= s["acc"] <= 1
    (rec,) = rounds_of(tmp_path / "run")
    assert rec["clients"] == [0, 1] and rec["missing_clients"] == [2]
    fed = json.loads((tmp_path / "run" / "federation.json").read_text())
    assert fed["status"] == "finished"
    (ev,) = fed["events"]
    assert ev["kind"] == "missing" and ev["node"] == 1002 and "data-path" in ev["reasons"][0]
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert any("node 1002 is missing" in w for w in state["warnings"])
    assert "is missing" in (tmp_path / "run" / "summary.md").read_text()
    assert json.loads((tmp_path / "run" / "predictor.json").read_text())["clients"] == [0, 1]
    part = json.loads((tmp_path / "run" / "partition.json").read_text())
    assert part["clients"][2].get("missing") is True


def test_crashed_client_below_min_clients_is_a_clear_failure(one_round, tmp_path, shared_cache):
    nodes = Nodes(cache=shared_cache)
    nodes.crash[1002] = 0
    with pytest.raises(FlareError) as e:
        nodes.federate(one_round, tmp_path / "run", upload="once", min_clients=3)
    msg = e.value.render()
    assert "fewer than min_clients=3" in msg and "[2]" in msg
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert state["status"] == "failed" and "min_clients=3" in state["error"]
    assert json.loads((tmp_path / "run" / "federation.json").read_text())["status"] == "failed"


def test_killed_client_that_never_answers_is_missing(one_round, tmp_path, shared_cache):
    nodes = Nodes(cache=shared_cache)
    nodes.silent.add(1000)
    nodes.federate(one_round, tmp_path / "run", upload="once", min_clients=2, timeout=5.0)
    (rec,) = rounds_of(tmp_path / "run")
    assert rec["missing_clients"] == [0]
    (ev,) = json.loads((tmp_path / "run" / "federation.json").read_text())["events"]
    assert ev["kind"] == "missing" and "no reply within 5 s" in ev["reasons"][0]
    nodes = Nodes(cache=shared_cache)
    nodes.silent.update({1000, 1001})
    with pytest.raises(FlareError, match="fewer than min_clients=2"):
        nodes.federate(one_round, tmp_path / "run2", upload="once", min_clients=2, timeout=5.0)


def test_client_lost_mid_run_is_dropped_from_later_rounds(tiny_overrides, tmp_path):
    nodes = Nodes()
    nodes.crash[1001] = 1
    nodes.federate(tiny_overrides, tmp_path / "run", min_clients=2)  # per-round
    r0, r1 = rounds_of(tmp_path / "run")
    assert r0["clients"] == [0, 1, 2] and r0["missing_clients"] == []
    assert r1["clients"] == [0, 2] and r1["missing_clients"] == [1]
    (ev,) = json.loads((tmp_path / "run" / "federation.json").read_text())["events"]
    assert ev["client"] == 1 and ev["round"] == 1


def test_too_few_nodes_connected_is_a_clear_failure(one_round, tmp_path):
    fed = FederationSettings(preset="fafi", overrides=" ".join(one_round), out_dir=str(tmp_path / "run"))
    with pytest.raises(FlareError, match="only 1 node"):
        run_federation(fed.load_config(), fed, Nodes().exchange, [1000], log=lambda m: None)


# ----------------------------------------------------------------------------------------------
# untrusted uploads: each kind of malformed upload is rejected with a reason and never aggregated


def _set_array(name, fn):
    def tamper(rd):
        st = record_to_state(rd.array_records["upload"])
        st[name] = fn(st[name])
        rd["upload"] = state_to_record(st)
    return tamper


def _set_meta(**kv):
    def tamper(rd):
        m = dict(rd.config_records["meta"])
        m.update(kv)
        rd["meta"] = ConfigRecord(m)
    return tamper


def _wrong_class_count(rd):
    st = record_to_state(rd.array_records["upload"])
    st["head.prototypes"] = torch.randn(st["head.prototypes"].shape[0] + 1, st["head.prototypes"].shape[1])
    rd["upload"] = state_to_record(st)
    m = dict(rd.config_records["meta"])
    m["class-histogram"] = list(m["class-histogram"]) + [0]
    rd["meta"] = ConfigRecord(m)


def _nan(t):
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


MALFORMED = {
    "wrong shape": (_set_array("encoder.body.0.weight", lambda t: torch.zeros(t.shape[0] + 1, *t.shape[1:])),
                    "encoder.body.0.weight' has shape"),
    "wrong dtype": (_set_array("encoder.body.4.weight", lambda t: t.double()), "dtype torch.float64"),
    "int where float": (_set_array("encoder.body.1.running_mean", lambda t: t.to(torch.int32)), "dtype torch.int32"),
    "nan weights": (_set_array("encoder.body.8.weight", _nan), "non-finite"),
    "inf prototypes": (_set_array("head.prototypes", lambda t: t.fill_(float("inf"))), "non-finite"),
    "class count": (_wrong_class_count, "class histogram is not 4"),
    "prototype class count": (_set_array("head.prototypes", lambda t: torch.randn(t.shape[0] + 1, t.shape[1])),
                              "prototypes have 5 classes, the run has 4"),
    "negative samples": (_set_meta(**{"num-samples": -3}), "sample count"),
    "histogram mismatch": (_set_meta(**{"num-samples": 999}), "sums to"),
    "impostor id": (_set_meta(client=0), "already answered"),
    "bad logs": (_set_meta(records="{not json"), "not JSON"),
    "missing tensor": (lambda rd: rd.array_records["upload"].pop("encoder.body.9.bias"), "missing 1 tensor"),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_malformed_upload_is_rejected_and_never_aggregated(kind, one_round, tmp_path, shared_cache, monkeypatch):
    import flare.setup as server  # the Flower server evaluates through setup.ServerSetup, as every run does

    seen = []
    real = server.ServerSetup.evaluate

    def spy(self, r, uploads, models, *a, **k):
        seen.append([(u.client, {n: t.clone() for n, t in u.state.items()}) for u in uploads])
        return real(self, r, uploads, models, *a, **k)

    monkeypatch.setattr(server.ServerSetup, "evaluate", spy)
    tamper, reason = MALFORMED[kind]
    nodes = Nodes(cache=shared_cache)
    nodes.tamper[1002] = tamper
    nodes.federate(one_round, tmp_path / "run", upload="once", min_clients=2)
    (ev,) = json.loads((tmp_path / "run" / "federation.json").read_text())["events"]
    assert ev["kind"] == "rejected" and ev["node"] == 1002
    assert any(reason in r for r in ev["reasons"]), ev["reasons"]
    (uploads,) = seen
    assert [c for c, _ in uploads] == [0, 1]
    for _, st in uploads:
        assert all(torch.isfinite(t).all() for t in st.values() if t.is_floating_point())
    (rec,) = rounds_of(tmp_path / "run")
    assert rec["clients"] == [0, 1] and rec["missing_clients"] == [2]


def test_pickled_upload_is_rejected_without_running_it(one_round, tmp_path, shared_cache):
    def tamper(rd):
        rd.array_records["upload"]["encoder.body.0.weight"] = pickled_array(tmp_path)

    nodes = Nodes(cache=shared_cache)
    nodes.tamper[1001] = tamper
    nodes.federate(one_round, tmp_path / "run", upload="once", min_clients=2)
    (ev,) = json.loads((tmp_path / "run" / "federation.json").read_text())["events"]
    assert ev["node"] == 1001 and "could not be decoded" in ev["reasons"][0]
    assert not (tmp_path / "pwned").exists()


def test_a_federation_decodes_every_peer_message_without_unpickling(tiny_overrides, tmp_path, monkeypatch):
    """Two rounds, a message per round: the clients decode the server's task and initial states and their own
    carried state, the server decodes every reply, all with Python's unpickler replaced by a tripwire (numpy's
    unpickling of an object array trips it: the control). The wire format carrying a pickle anywhere (a state,
    the carried skeleton, torch.load of bytes) fails here, however the decoder was written; an object array
    where a number belongs is refused by the tests above."""
    tripped = []

    def tripwire(*a, **k):
        tripped.append(a)
        raise pickle.UnpicklingError("a peer's bytes reached the unpickler")

    class TrippingUnpickler(pickle.Unpickler):  # a class: modules imported later subclass pickle.Unpickler
        def __init__(self, *a, **k):
            tripwire(*a, **k)

    for name in ("load", "loads"):
        monkeypatch.setattr(pickle, name, tripwire)
    monkeypatch.setattr(pickle, "Unpickler", TrippingUnpickler)
    with pytest.raises(pickle.UnpicklingError):  # the control: numpy unpickles through these names
        np.load(io.BytesIO(pickled_array(tmp_path).data), allow_pickle=True)
    assert len(tripped) == 1 and not (tmp_path / "pwned").exists()
    tripped.clear()
    decoded = {"carry": 0, "replies": 0}
    real_unpack, real_decode = unpack_nested, decode_content

    def count(key, fn):
        def wrapped(*a, **k):
            decoded[key] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr("flare.flower.client_app.unpack_nested", count("carry", real_unpack))
    monkeypatch.setattr(sys.modules[__name__], "decode_content", count("replies", real_decode))
    Nodes().federate(tiny_overrides + ["rounds=2"], tmp_path / "run", upload="per-round", min_clients=K)
    assert tripped == []
    assert decoded == {"carry": K, "replies": 2 * K}  # round 2 resumed every client from its carried state
    assert [r["clients"] for r in rounds_of(tmp_path / "run")] == [[0, 1, 2]] * 2


def test_export_partitions_cli_and_a_server_without_a_test_set(tiny_overrides, tmp_path):
    from flare.cli import main

    ov = tiny_overrides + ["rounds=1"]
    assert main(["federate", "--export-partitions", str(tmp_path / "data"), "--preset", "fafi", *ov]) == 0
    files = [tmp_path / "data" / f"client-{i}.npz" for i in range(K)]
    assert all(f.exists() for f in files) and (tmp_path / "data" / "dataset-meta.json").exists()
    # the server cannot read the dataset (another machine): it trains, validates and saves, but scores nothing
    ov_server = [o for o in ov if not o.startswith("dataset.root=")] + [f"dataset.root={tmp_path / 'nowhere'}"]
    nodes = Nodes(node_config={i: {"data-path": str(files[i])} for i in range(K)})
    s = nodes.federate(ov_server, tmp_path / "run", upload="once",
                       dataset_meta=str(tmp_path / "data" / "dataset-meta.json"))
    assert s["acc"] is None
    (rec,) = rounds_of(tmp_path / "run")
    assert rec["clients"] == [0, 1, 2] and "acc_feature" not in rec and "g_protos_std" in rec
    assert (tmp_path / "run" / "predictor.pt").exists()
    assert any("no dataset" in w for w in json.loads((tmp_path / "run" / "state.json").read_text())["warnings"])


def test_the_app_directory_is_the_packaged_one_and_flower_accepts_it():
    from pathlib import Path

    from flwr.cli.config_utils import load_and_validate

    from flare.flower.federation import app_dir

    d = app_dir()
    repo_link = Path(__file__).resolve().parents[1] / "flower-app"
    assert (repo_link / "pyproject.toml").read_text() == (d / "pyproject.toml").read_text()
    config, _warnings = load_and_validate(Path(d) / "pyproject.toml")
    comps = config["tool"]["flwr"]["app"]["components"]
    assert comps == {"serverapp": "flare.flower.server_app:app", "clientapp": "flare.flower.client_app:app"}
    from flare.flower.server import FederationSettings

    assert set(config["tool"]["flwr"]["app"]["config"]) == set(FederationSettings.KEYS)


def test_reference_protocol_federation_reproduces_flare_run_and_its_predictor(tiny_overrides, tiny_folder, tmp_path):
    """protocol=reference through Flower: the baselines' plain view, the reference input scaling, parameters-only
    FedAvg with client 0's buffers — the same numbers as `flare run`, and a predictor that reproduces them."""
    from flare.data.datasets import load_dataset
    from flare.flower.predictor import load_predictor

    ov = tiny_overrides + ["protocol=reference"]
    Run(load_config(None, "fedavg", ov), tmp_path / "inproc", quiet=True).execute()
    Nodes().federate(ov, tmp_path / "fed", preset="fedavg", upload="once")
    (last,) = rounds_of(tmp_path / "fed")
    assert strip(last) == strip(rounds_of(tmp_path / "inproc")[-1])
    info = json.loads((tmp_path / "fed" / "predictor.json").read_text())
    assert info["rule"] == "model" and info["strategy"] == "fedavg" and info["states"] == ["model"]  # the averaged one
    assert info["mean"] == [0.0] and info["std"] == [1.0]  # [0, 1]: x/255
    pred = load_predictor(tmp_path / "fed")
    data = load_dataset("imagefolder", tiny_folder, cache_dir=tmp_path / "cache")
    assert float((pred.predict(data.test_x) == data.test_y).float().mean()) == pytest.approx(last["acc"], abs=1e-9)


def test_plan_b_reference_over_flower_reproduces_flare_run(tiny_overrides, tmp_path):
    """The server's G travels in every train message (`sent`) and the nodes align to it: the federation's round
    records (server_g_std, the accuracies) are `flare run`'s, round after round."""
    ov = tiny_overrides + ["server.protos_flow=reference", "server.server_epochs=2", "rounds=3"]
    Run(load_config(None, "server-protos", ov), tmp_path / "inproc", quiet=True).execute()
    nodes = Nodes()
    sent = []
    real = nodes.exchange
    nodes.exchange = lambda task, init, ids, session: sent.append(session.setup.train_message(task.round_start)) or \
        real(task, init, ids, session)
    nodes.federate(ov, tmp_path / "fed", preset="server-protos")
    fed, inproc = rounds_of(tmp_path / "fed"), rounds_of(tmp_path / "inproc")
    assert len(fed) == len(inproc) == 3 and all("server_g_std" in r for r in fed)
    assert [strip(r) for r in fed] == [strip(r) for r in inproc]
    assert [sorted(m) for m in sent] == [["align_target"]] * 3
    assert not torch.equal(sent[1]["align_target"], sent[0]["align_target"])  # round 1 sends the trained G
    with pytest.raises(FlareError) as e:  # one message cannot carry a G the later rounds' evaluations train
        Nodes().federate(ov, tmp_path / "once", preset="server-protos", upload="once")
    assert e.value.key == "upload"


def test_what_every_client_starts_from_is_the_primary_strategys_initialize(tiny_overrides, tmp_path, monkeypatch):
    """One sending hook before training: a primary that overrides `initialize` (as a plugin's would: another init,
    another anchor seed) is what the clients of both transports start from, so the federation still equals
    `flare run`, and both leave the default's numbers."""
    cfg = load_config(None, "flare", tiny_overrides)
    Run(cfg, tmp_path / "default", quiet=True).execute()
    real = Strategy.initialize

    def other(self, ctx):
        sent = real(self, ctx)
        return {k: v * 0.5 if k.startswith("init/") and v.is_floating_point() else v for k, v in sent.items()} | \
            {"anchor_seed": sent["anchor_seed"] + 1}

    monkeypatch.setattr(type(make_strategy(cfg, primary_rule(cfg))), "initialize", other)
    setup = RunSetup.build(cfg)
    model, server = setup.make_clients(lambda m: None, lambda m: None)[0].model, setup.server.client_init(0)
    assert all(torch.equal(v, 0.5 * server.state_dict()[k]) for k, v in model.state_dict().items()
               if v.is_floating_point())
    # the clients and the server both draw A from the seed sent, which is not the config's own
    A = setup.server.anchors
    assert torch.equal(setup.ctx.anchors, A)
    assert not torch.equal(A, run_anchors(cfg, A.shape[0], A.shape[1], A.device))
    Run(cfg, tmp_path / "inproc", quiet=True).execute()
    Nodes().federate(tiny_overrides, tmp_path / "fed", preset="flare")
    base, a, b = (rounds_of(tmp_path / d) for d in ("default", "inproc", "fed"))
    assert [strip(r) for r in a] == [strip(r) for r in b] != [strip(r) for r in base]


# ----------------------------------------------------------------------------------------------
# plugins over Flower: parts, client statistics (Upload.extras) and a model-owning primary's saved predictor


PLUGIN = ["plugins=[flare_demo_plugin]", "loss.terms.demo_center.weight=0.5", "align.anchors=etf",
          "lam.learner=demo_constant", "lam.options.lam=0.4242", "eval.rules=[primary,output,demo_counts]"]


def test_a_plugins_parts_run_in_the_flower_simulation_as_in_flare_run(tiny_overrides, tmp_path):
    ov = tiny_overrides + PLUGIN
    Run(load_config(None, "fafi", ov), tmp_path / "inproc", quiet=True).execute()
    Nodes().federate(ov, tmp_path / "fed")
    a, b = rounds_of(tmp_path / "inproc"), rounds_of(tmp_path / "fed")
    assert [strip(r) for r in a] == [strip(r) for r in b]
    assert all(r["demo_counts.samples"] > 0 and "acc_demo_counts" in r for r in b)  # the extras crossed the wire
    clients = [r for r in read_jsonl(tmp_path / "fed" / "metrics.jsonl") if r["kind"] == "client"]
    assert clients and all(r["term_demo_center"] > 0 and r["lambda"] == pytest.approx(0.4242) for r in clients)


def test_extras_that_break_the_declaration_are_rejected_by_the_gate(one_round, tmp_path):
    nodes = Nodes(node_config={2: {"fault": "extras-shape"}})
    nodes.federate(one_round + PLUGIN, tmp_path / "run", upload="once", min_clients=2)
    (ev,) = json.loads((tmp_path / "run" / "federation.json").read_text())["events"]
    assert ev["kind"] == "rejected" and ev["node"] == 1002
    assert any("'demo_counts/counts' has shape" in r for r in ev["reasons"]), ev["reasons"]
    (rec,) = rounds_of(tmp_path / "run")
    assert rec["clients"] == [0, 1] and rec["demo_counts.samples"] > 0


def test_a_model_owning_plugin_primary_is_saved_as_the_predictor(one_round, tiny_folder, tmp_path):
    from flare.data.datasets import load_dataset
    from flare.flower.predictor import load_predictor

    Nodes().federate(one_round + ["plugins=[flare_demo_plugin]", "server.primary=demo_pick",
                                  "server.strategies.demo_pick.client=1"], tmp_path / "fed", upload="once")
    (last,) = rounds_of(tmp_path / "fed")
    info = json.loads((tmp_path / "fed" / "predictor.json").read_text())
    assert info["rule"] == "model" and info["strategy"] == "demo_pick" and info["states"] == ["model"]
    pred = load_predictor(tmp_path / "fed")  # weights_only=True inside
    data = load_dataset("imagefolder", tiny_folder, cache_dir=tmp_path / "cache")
    acc = float((pred.predict(data.test_x) == data.test_y).float().mean())
    assert acc == pytest.approx(last["acc_demo_pick"], abs=1e-9) == pytest.approx(last["client_acc"][1], abs=1e-9)


def test_a_client_output_plugin_primary_saves_no_predictor_and_says_why(one_round, tmp_path):
    Nodes().federate(one_round + ["plugins=[flare_demo_plugin]", "server.primary=demo_class0"], tmp_path / "fed",
                     upload="once")
    assert not (tmp_path / "fed" / "predictor.pt").exists()
    state = json.loads((tmp_path / "fed" / "state.json").read_text())
    assert any("no predictor saved" in w and "demo_class0" in w for w in state["warnings"])


def test_a_plugins_model_dataset_and_partition_in_the_flower_simulation(tmp_path):
    """Every kind of plugin part at once over Flower: the demo dataset (4 blobs, no files), its MLP, its
    round-robin partition, loss term, λ provider and a client-statistics strategy; the same records as flare run."""
    ov = ["plugins=[flare_demo_plugin]", "device=cpu", "num_clients=3", "rounds=1", "batch_size=16",
          "test_batch_size=32", "dataset.name=demo_blobs", "dataset.options.n_train=96", "model.name=demo_mlp",
          "model.options.hidden=16", "partition.kind=demo_round_robin", "loss.terms.demo_center.weight=0.5",
          "align.anchors=etf", "lam.learner=demo_constant", "eval.rules=[primary,demo_counts]"]
    Run(load_config(None, "fafi", ov), tmp_path / "inproc", quiet=True).execute()
    Nodes().federate(ov, tmp_path / "fed")
    a, b = rounds_of(tmp_path / "inproc"), rounds_of(tmp_path / "fed")
    assert [strip(r) for r in a] == [strip(r) for r in b]
    assert b[-1]["demo_counts.samples"] == 96.0  # round-robin over the demo dataset's 96 samples, via the extras
    clients = [r for r in read_jsonl(tmp_path / "fed" / "metrics.jsonl") if r["kind"] == "client"]
    assert [r["num_samples"] for r in clients] == [32, 32, 32]
    assert all(r["term_demo_center"] > 0 and r["lambda"] == pytest.approx(0.4242) for r in clients)
