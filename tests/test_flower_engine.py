"""FLARE's Flower apps on Flower's real engines, as real processes on 127.0.0.1:

* the simulation runtime (a SuperLink with --simulation, Ray backend) through `flwr run`, against
  `flare run` on the same config and seed;
* a loopback deployment — a SuperLink and three SuperNodes, started, run and stopped by the test —
  with a real round, then a SuperNode killed with SIGKILL mid-round (min_clients met) and the federation
  run again without it (min_clients not met);
* a loopback deployment whose nodes send broken uploads.

Each test bounds its own time and stops every process it started (in a finally).
"""
import json
import os
import signal

import pytest

pytest.importorskip("flwr")
pytestmark = pytest.mark.usefixtures("default_torch_threads")

from flare.config import load_config  # noqa: E402
from flare.flower.protocol import export_partitions  # noqa: E402
from flare.flower.federation import LocalFederation, app_dir  # noqa: E402
from flare.rundir import read_jsonl  # noqa: E402
from flare.runner import Run  # noqa: E402

K = 3


def rounds_of(d):
    return [r for r in read_jsonl(d / "metrics.jsonl") if r["kind"] == "round"]


def strip(r):
    return {k: v for k, v in r.items() if not k.startswith("seconds") and k not in ("clients", "missing_clients")}


def run_config(ov, out, **kw):
    return {"preset": "fafi", "overrides": " ".join(ov), "out-dir": str(out), **kw}


def assert_all_stopped(fed: LocalFederation):
    for name, p in fed.procs:
        assert p.poll() is not None, f"{name} still running"
        assert not fed.group_alive(p), f"{name}'s process group still has members"
    assert fed._alive(fed._seen) == [], "processes started below the federation survived stop()"


PLUGIN = ["plugins=[flare_demo_plugin]", "loss.terms.demo_center.weight=0.5", "align.anchors=etf",
          "lam.learner=demo_constant", "eval.rules=[primary,output,demo_counts,fens]",
          "server.strategies.fens.rounds=3"]


@pytest.mark.long
def test_flwr_run_simulation_reproduces_flare_run(tiny_overrides, tmp_path):
    """With a plugin's loss term, λ provider and client-statistics strategy (tests/plugins): the Ray workers import
    it from the config, and each part leaves its own number in the records. FENS's rounds after the upload travel as
    `query` messages and give flare run's numbers too."""
    pytest.importorskip("ray")
    import torch

    tiny_overrides = tiny_overrides + PLUGIN
    Run(load_config(None, "fafi", tiny_overrides), tmp_path / "inproc", quiet=True).execute()
    # Ray sets OMP_NUM_THREADS to the CPUs a client asks for: give each simulated client as many threads as
    # this process uses, so that the float reductions run in the same order and the numbers are identical
    # (with 1 CPU per client they differ in the 7th digit; see docs/federation.md).
    cpus = max(1, min(torch.get_num_threads(), os.cpu_count() or 1))
    fed = LocalFederation(tmp_path / "sim", simulation=True)
    try:
        fed.start()
        res = fed.run(app_dir(), run_config(tiny_overrides, tmp_path / "fed"),
                      {"num-supernodes": K, "client-resources-num-cpus": cpus}, timeout=420)
    finally:
        fed.stop()
    assert_all_stopped(fed)
    assert res.returncode == 0, res.stdout[-3000:]
    state = json.loads((tmp_path / "fed" / "state.json").read_text())
    assert state["status"] == "finished", res.stdout[-3000:]
    a, b = rounds_of(tmp_path / "inproc"), rounds_of(tmp_path / "fed")
    assert [r["round"] for r in b] == [0, 1]
    assert [strip(r) for r in a] == [strip(r) for r in b]
    assert all(r["demo_counts.samples"] > 0 for r in b)
    assert b[-1]["fens.rounds"] == 3 and "acc_fens" in b[-1]
    clients = [r for r in read_jsonl(tmp_path / "fed" / "metrics.jsonl") if r["kind"] == "client"]
    assert clients and all(r["term_demo_center"] > 0 and r["lambda"] == pytest.approx(0.4242) for r in clients)


@pytest.mark.long
@pytest.mark.plots
def test_loopback_deployment_real_round_then_a_node_killed_mid_round(tiny_overrides, tmp_path):
    """docs/federation.md, "Failures", on a real deployment: a round with every node; then a SuperNode killed with
    SIGKILL while it trains, which the run waits out (`timeout`) and records as missing, finishing on the others
    (min_clients met); then the federation run again without it and min_clients not met: a recorded failure."""
    import threading
    import time

    cfg = load_config(None, "fafi", tiny_overrides)
    files = export_partitions(cfg, tmp_path / "data")
    nodes = [{"partition-id": 0, "num-partitions": K, "data-path": str(files[0])},  # its own local file
             {"partition-id": 1, "num-partitions": K}, {"partition-id": 2, "num-partitions": K}]
    Run(cfg, tmp_path / "inproc", quiet=True).execute()
    # local work long enough that the kill lands mid-round (about 4 s of training here) and short enough that the
    # live nodes reply well inside the timeout, which the run then waits out for the killed one (the test's cost:
    # keep it a few times the training, no more)
    slow = [o for o in tiny_overrides if not o.startswith(("batch_size=", "rounds="))] + [
        "batch_size=8", "rounds=1", "local_epochs=2"]
    fed = LocalFederation(tmp_path / "fed", node_configs=nodes)
    result = {}
    try:
        fed.start()
        assert fed.port and all(p.poll() is None for _, p in fed.procs)
        # 1. a real round: every node trains R×E epochs and uploads once
        res = fed.run(app_dir(), run_config(tiny_overrides, tmp_path / "run", upload="once"), timeout=300,
                      log_name="run-ok")
        assert res.returncode == 0, res.stdout[-3000:]
        out = tmp_path / "run"
        for f in ("config.yaml", "partition.json", "metrics.jsonl", "state.json", "summary.md", "federation.json",
                  "predictor.pt", "predictor.json", "plots/accuracy.png"):
            assert (out / f).exists(), f
        assert json.loads((out / "state.json").read_text())["status"] == "finished"
        (last,) = rounds_of(out)
        assert last["clients"] == [0, 1, 2]
        assert strip(last) == strip(rounds_of(tmp_path / "inproc")[-1])  # same numbers as flare run
        assert sorted(json.loads((out / "federation.json").read_text())["nodes"].values()) == [0, 1, 2]

        # 2. a node killed while it trains; min_clients=2 is met: the run waits out the timeout for it, records it
        # as missing and finishes on the others
        def tasks():  # the train messages node 2 has received
            return fed.log_text("supernode-2").lower().count("receiving: train")

        n_train = tasks()  # step 1's
        t = threading.Thread(target=lambda: result.update(res=fed.run(
            app_dir(), run_config(slow, tmp_path / "killed", upload="once", timeout=45.0,
                                  **{"min-clients": 2, "wait-nodes": 30.0}), timeout=400, log_name="killed")))
        t.start()
        deadline = time.time() + 240
        while tasks() <= n_train:  # until node 2 has received this run's task
            assert t.is_alive() and time.time() < deadline, fed.log_text("supernode-2")[-2000:]
            time.sleep(0.2)
        time.sleep(1.0)
        state = json.loads((tmp_path / "killed" / "state.json").read_text())
        assert state["status"] == "running" and state["rounds_done"] == 0  # the round is in progress
        os.killpg(fed.node_procs[2].pid, signal.SIGKILL)  # node 2 and everything it started: a crashed client
        fed.node_procs[2].wait(timeout=10)
        t.join(timeout=400)
        assert not t.is_alive()
        out = tmp_path / "killed"
        state = json.loads((out / "state.json").read_text())
        assert state["status"] == "finished", result["res"].stdout[-3000:]
        (last,) = rounds_of(out)
        assert last["clients"] == [0, 1] and last["missing_clients"] == [2]
        assert any("missing" in w for w in state["warnings"])
        (ev,) = json.loads((out / "federation.json").read_text())["events"]
        assert ev["kind"] == "missing" and "no reply within 45 s" in ev["reasons"][0]

        # 3. the federation again without node 2 and min_clients=3: a clear failure, recorded in the run directory
        res = fed.run(app_dir(), run_config(tiny_overrides, tmp_path / "run-unmet", upload="once", timeout=30.0,
                                            **{"min-clients": 3, "wait-nodes": 5.0}), timeout=300,
                      log_name="run-unmet")
        state = json.loads((tmp_path / "run-unmet" / "state.json").read_text())
        assert state["status"] == "failed"
        assert "min_clients=3" in state["error"] or "fewer than min_clients=3" in state["error"]
        assert "min_clients=3" in res.stdout  # the ServerApp's log says why
    finally:
        fed.stop()
    assert_all_stopped(fed)


@pytest.mark.long
def test_loopback_broken_uploads_are_rejected(tiny_overrides, tmp_path):
    """docs/federation.md, "Untrusted uploads", on a real deployment: nodes that send a wrong shape, NaN weights or
    a missing tensor are rejected with the reason and never aggregated; with min-clients met the run finishes on
    the others."""
    ov = [o for o in tiny_overrides if not o.startswith("num_clients=")] + ["num_clients=4"]
    faults = [None, "wrong-shape", "nan", "missing-key"]
    nodes = [{"partition-id": i, "num-partitions": 4, **({"fault": f} if f else {})} for i, f in enumerate(faults)]
    fed = LocalFederation(tmp_path / "fed", node_configs=nodes)
    try:
        fed.start()
        res = fed.run(app_dir(), run_config(ov, tmp_path / "drill", upload="once", **{"min-clients": 1}),
                      timeout=300, log_name="drill")
        out = tmp_path / "drill"
        assert json.loads((out / "state.json").read_text())["status"] == "finished", res.stdout[-3000:]
        (last,) = rounds_of(out)
        assert last["clients"] == [0] and last["missing_clients"] == [1, 2, 3]
        events = {e["client"]: e for e in json.loads((out / "federation.json").read_text())["events"]}
        assert {c: e["kind"] for c, e in events.items()} == {1: "rejected", 2: "rejected", 3: "rejected"}
        assert "has shape" in " ".join(events[1]["reasons"])
        assert "non-finite" in " ".join(events[2]["reasons"])
        assert "missing 1 tensor" in " ".join(events[3]["reasons"])
    finally:
        fed.stop()
    assert_all_stopped(fed)
