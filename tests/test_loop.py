"""The server's round loop is one function (flare/loop.py) that every transport runs, `Upload`s are made in one
module, and the uploads the server scored are written to the run directory, where `flare fuse` reads them."""
import ast
import json
from pathlib import Path

import pytest
import torch

import flare.fuse
import flare.runner
from flare.config import load_config
from flare.errors import FlareError
from flare.durable import read_jsonl
from flare.fuse import fuse_runs
from flare.runner import Run
from flare import loop
from flare.server.protos import ServerPrototypes
from flare.server.strategy import Scorer, ServerProtocol, Strategy
from flare.server.upload import UPLOADS, load_uploads
from flare.setup import ServerSetup
from conftest import finished_fedavg_run

SRC = Path(__file__).resolve().parents[1] / "src" / "flare"


def calls(name: str) -> dict[str, int]:
    """module path → how many calls to a function or method called `name` it makes."""
    out = {}
    for p in sorted(SRC.rglob("*.py")):
        n = sum(1 for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.Call) and (
            getattr(node.func, "id", None) == name or getattr(node.func, "attr", None) == name))
        if n:
            out[str(p.relative_to(SRC))] = n
    return out


def test_one_loop_every_transport_calls():
    """The in-process runner, the Flower server and `flare fuse` each call the loop once; only the loop evaluates
    uploads, carries the server's state into the next round and writes the uploads."""
    assert calls("run_rounds") == {"runner.py": 1, "flower/server.py": 1, "fuse.py": 1}
    for step in ("evaluate", "carry", "save_uploads", "runaway_warnings"):
        assert calls(step) == {"loop.py": 1}, step


def test_one_gate_in_the_loop():
    """The upload gate (`validate_upload`, through `why_rejected`) and the quorum run in the loop and nowhere else:
    no transport checks uploads on its own (flare fuse asks the loop's gate once more only to know whether a saved
    upload's weights can be loaded to compute a statistic)."""
    assert calls("validate_upload") == {"loop.py": 1}
    assert calls("why_rejected") == {"loop.py": 1, "fuse.py": 1}
    assert calls("gate_uploads") == {"loop.py": 1}
    assert [p.name for p in SRC.rglob("*.py") if "valid upload(s)" in p.read_text()] == ["loop.py"]  # the quorum


def test_one_module_makes_uploads():
    """`Upload(...)` appears only in server/upload.py: every transport hands the loop the same thing."""
    assert calls("Upload") == {"server/upload.py": 2}


@pytest.fixture
def spied(monkeypatch):
    """The loop, wrapped where each transport calls it: the transports that called it, in order."""
    seen = []

    def spy(server, clients, *args, **kw):
        seen.append(type(clients).__name__)
        return loop.run_rounds(server, clients, *args, **kw)

    for module in (flare.runner, flare.fuse):
        monkeypatch.setattr(module, "run_rounds", spy)
    return seen


def test_fuse_scores_the_uploads_the_server_received_extras_included(tiny_overrides, tmp_path, spied, monkeypatch):
    """A run writes the uploads of its last evaluated round (weights as the clients left them, and the statistics
    FedProto asked for); `flare fuse` scores them through the same loop without computing a statistic again, and
    reproduces the run's own accuracy."""
    cfg = load_config(None, "fafi", tiny_overrides + ["eval.rules=[primary,fedproto]"])
    out = tmp_path / "run"
    Run(cfg, out, quiet=True).execute()
    r, server_state, uploads = load_uploads(out / UPLOADS, "cpu")
    assert r == cfg.rounds - 1 and server_state == {}
    clients = torch.load(out / "checkpoint.pt", weights_only=True)["clients"]
    for u in uploads:
        assert set(u.extras) == {"fedproto/class_sums", "fedproto/class_counts"}
        assert all(torch.equal(v, clients[u.client]["model"][k]) for k, v in u.state.items())

    def no_statistics(*a, **kw):
        raise AssertionError("fuse computed statistics the server had received")

    monkeypatch.setattr(flare.fuse, "client_extras", no_statistics)
    fuse_runs([str(out)], "fedproto")
    last = read_jsonl(out / "metrics.jsonl")[-1]
    assert [f["acc"] for f in read_jsonl(out / "fuse.jsonl")] == [last["acc_fedproto"]]
    assert spied == ["InProcess", "SavedUploads"]


def test_fuse_refuses_a_run_without_saved_uploads(tiny_overrides, tmp_path):
    cfg = load_config(None, "fedavg", tiny_overrides + ["rounds=1"])
    out = tmp_path / "run"
    Run(cfg, out, quiet=True).execute()
    (out / UPLOADS).unlink()
    with pytest.raises(FlareError, match="has no uploads.pt"):
        fuse_runs([str(out)], "fedavg")


class RoundCounter(ServerProtocol):
    """A protocol of the test's own: it keeps a count the server folds each evaluated round, and sends it."""

    def __init__(self):
        self.sent_at: list[tuple[int, float]] = []

    def initial_state(self, anchors):
        return {"count": torch.zeros(())}

    def configure_train(self, rnd, carried):
        self.sent_at.append((rnd, float(carried["count"])))
        return {"count": carried["count"]}

    def fold(self, r, uploads, anchors, kept):
        return {}, {"count": kept["count"] + len(uploads)}, {"counted": float(len(uploads))}


def test_the_two_roles_and_the_server_composes_its_protocols(tiny_overrides, tmp_path, monkeypatch):
    """A strategy plays two roles with no hook in common: the protocol (what the clients receive, what the server
    keeps and folds) and the scorer (the predictor). Plan B's global prototypes are a protocol and no scorer. The
    server composes its protocols: one added beside the global prototypes and the primary has its state kept from
    round to round, sent before each round, saved with the uploads and logged, while Plan B's reference flow keeps
    its G beside it."""
    assert not set(vars(ServerProtocol)) & set(vars(Scorer)) - {"__module__", "__doc__", "__dict__", "__weakref__",
                                                                 "__qualname__", "__firstlineno__",
                                                                 "__static_attributes__"}
    assert issubclass(Strategy, ServerProtocol) and issubclass(Strategy, Scorer)
    assert issubclass(ServerPrototypes, ServerProtocol) and not issubclass(ServerPrototypes, Scorer)
    counter = RoundCounter()
    real = ServerSetup.protocols
    monkeypatch.setattr(ServerSetup, "protocols", lambda self: real(self) + [counter])
    cfg = load_config(None, "server-protos", tiny_overrides + ["rounds=3", "server.protos_flow=reference"])
    out = tmp_path / "run"
    Run(cfg, out, quiet=True).execute()
    K, evaluated = cfg.num_clients, [r["round"] for r in read_jsonl(out / "metrics.jsonl")
                                 if r["kind"] == "round" and r.get("evaluated", True)]
    assert evaluated == [0, 1, 2]
    assert counter.sent_at == [(r, K * r) for r in range(3)]
    r, server_state, _ = load_uploads(out / UPLOADS, "cpu")
    assert r == 2 and float(server_state["count"]) == 2 * K and server_state["G"].dim() == 2
    rounds = [x for x in read_jsonl(out / "metrics.jsonl") if x["kind"] == "round"]
    assert [x["counted"] for x in rounds] == [K] * 3 and all("server_loss_last" in x for x in rounds)


def _misshapen(upload):
    """`upload` with its first tensor one row too many (a client of another width, say)."""
    name, t = next(iter(upload.state.items()))
    upload.state = {**upload.state, name: torch.zeros(t.shape[0] + 1, *t.shape[1:], dtype=t.dtype)}
    return upload


def test_an_in_process_upload_that_does_not_fit_is_turned_away_by_the_loop(tiny_overrides, tmp_path, monkeypatch):
    """In process, client 1's round-2 upload of the wrong shape is rejected by the loop's gate with the tensor named
    (a warning), never scored, and the quorum (every client of an in-process run) ends the run: a FlareError that
    names who, the first round's records kept."""
    real, scored = flare.runner.InProcess.uploads, []
    monkeypatch.setattr(flare.runner.InProcess, "uploads", lambda self, r, sc: [
        _misshapen(u) if r == 1 and u.client == 1 else u for u in real(self, r, sc)])
    real_eval = ServerSetup.evaluate
    monkeypatch.setattr(ServerSetup, "evaluate", lambda self, r, uploads, *a, **kw: (
        scored.append((r, [u.client for u in uploads])), real_eval(self, r, uploads, *a, **kw))[1])
    out = tmp_path / "run"
    with pytest.raises(FlareError, match=r"round 2: 2 valid upload\(s\).*missing or rejected: \[1\]") as e:
        with pytest.warns(UserWarning, match=r"round 2: client 1 upload rejected: '.*' has shape"):
            Run(load_config(None, "fedavg", tiny_overrides), out, quiet=True).execute()
    assert "Fix:" in e.value.render()
    assert scored == [(0, [0, 1, 2])]
    assert [r["round"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "round"] == [0]


def test_a_saved_upload_that_does_not_fit_is_turned_away_by_the_loop(tiny_overrides, tmp_path):
    """Over saved uploads, the loop's gate turns a misshapen upload away, and the quorum (every saved upload) refuses
    the fuse naming the tensor, before anything is scored or written."""
    run = finished_fedavg_run(tiny_overrides, tmp_path / "run")
    saved = torch.load(run / UPLOADS, weights_only=True)
    up = saved["uploads"][1]
    name, t = next(iter(up["state"].items()))
    up["state"][name] = torch.zeros(t.shape[0] + 1, *t.shape[1:], dtype=t.dtype)
    torch.save(saved, run / UPLOADS)
    with pytest.raises(FlareError, match=f"the upload of client 1 does not fit the run \\('{name}' has shape"):
        fuse_runs([str(run)], "fedavg")
    assert not (run / "fuse.jsonl").exists()


@pytest.mark.parametrize("transport", ["InProcess", "SavedUploads", "ServerSession"])
def test_no_transport_bypasses_the_gate(transport, tiny_overrides, tmp_path, monkeypatch):
    """The gate's verdict, replaced by the test's own (client 1 is turned away), holds for every transport: a
    transport that scored its uploads without the loop's gate would let client 1 through."""
    real = loop.why_rejected
    monkeypatch.setattr(loop, "why_rejected", lambda server, u, scored: (
        ["the test turns client 1 away"] if u.client == 1 else real(server, u, scored)))
    ov = tiny_overrides + ["rounds=1"]
    if transport == "ServerSession":
        pytest.importorskip("flwr")
        from test_flower_protocol import Nodes, rounds_of

        Nodes().federate(ov, tmp_path / "fed", upload="once", min_clients=2)
        (rec,) = rounds_of(tmp_path / "fed")
        assert rec["clients"] == [0, 2] and rec["missing_clients"] == [1]
        (ev,) = json.loads((tmp_path / "fed" / "federation.json").read_text())["events"]
        assert ev["kind"] == "rejected" and ev["client"] == 1 and ev["reasons"] == ["the test turns client 1 away"]
        return
    if transport == "InProcess":
        with pytest.raises(FlareError, match=r"missing or rejected: \[1\]"), pytest.warns(UserWarning):
            Run(load_config(None, "fedavg", ov), tmp_path / "run", quiet=True).execute()
        return
    monkeypatch.setattr(loop, "why_rejected", real)  # the run itself passes
    run = finished_fedavg_run(tiny_overrides, tmp_path / "run")
    monkeypatch.setattr(loop, "why_rejected", lambda server, u, scored: (
        ["the test turns client 1 away"] if u.client == 1 else real(server, u, scored)))
    with pytest.raises(FlareError, match=r"client 1 does not fit the run \(the test turns client 1 away\)"):
        fuse_runs([str(run)], "fedavg")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_the_gate_counts_every_non_finite_value_and_passes_a_finite_tensor_whose_sum_overflows(dtype):
    """The gate's finiteness check looks at a tensor's sum first: a finite sum passes at once, anything else is
    counted value by value, so an overflowing sum of finite values is no reason to turn an upload away."""
    from flare.server.upload import check_tensors
    big = torch.full((64,), torch.finfo(dtype).max / 2, dtype=dtype)  # every value finite, their sum is not
    assert not torch.isfinite(big.sum())
    shapes = {"w": ((64,), dtype)}
    assert check_tensors("state", {"w": big}, shapes) == []
    bad = big.clone()
    bad[[3, 9]], bad[20] = float("nan"), float("-inf")
    assert check_tensors("state", {"w": bad}, shapes) == ["'w' holds 3 non-finite value(s)"]
    ok = torch.randn(64).to(dtype)
    ok[5] = float("inf")
    assert check_tensors("state", {"w": ok}, shapes) == ["'w' holds 1 non-finite value(s)"]
