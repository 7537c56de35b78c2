"""The server's round loop is one function (flare/loop.py) that every transport runs, `Upload`s are made in one
module, and the uploads the server scored are written to the run directory, where `flare fuse` reads them."""
import ast
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
from flare.server.upload import UPLOADS, load_uploads

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
