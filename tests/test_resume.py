"""Durability: a run killed at any instant resumes from its last complete round and ends with exactly the
metrics of the same run uninterrupted (CPU, same seed)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import run_interrupted
from flare.cli import main
from flare.config import load_config
from flare.rundir import read_jsonl
from flare.runner import Run




def _no_timing(recs):
    return [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in recs]


def _overrides(tiny_folder, tmp_path, extra=()):
    return [f"dataset.name=imagefolder", f"dataset.root={tiny_folder}", f"dataset.cache_dir={tmp_path / 'cache'}",
            "model.name=cnn", "model.width=0.25", "num_clients=3", "partition.alpha=0.5", "device=cpu",
            "test_batch_size=32", *extra]


def _state(d):
    try:
        return json.loads((d / "state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


@pytest.mark.long
def test_sigkill_mid_round_then_resume_equals_uninterrupted(tiny_folder, tmp_path):
    # FLARE's λ learner and momentum kept across rounds: every piece of client state must survive the kill.
    # Small batches and several local epochs make a round last long enough to be killed in its middle.
    ov = _overrides(tiny_folder, tmp_path, ["rounds=3", "local_epochs=3", "batch_size=4",
                                            "optim.reset_each_round=false"])
    killed = tmp_path / "killed"
    env = dict(os.environ, FLARE_QUIET="1", OMP_NUM_THREADS=str(torch.get_num_threads()),
               OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.Popen([sys.executable, "-m", "flare.cli", "run", "--preset", "flare", *ov,
                             "--out", str(killed), "--quiet"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 300
        while _state(killed).get("rounds_done", 0) < 1:
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            assert time.time() < deadline, "round 0 never finished"
            time.sleep(0.05)
        # round 1 is now in progress: wait a fraction of round 0's duration, then kill -9 in its middle
        r0 = [r for r in read_jsonl(killed / "metrics.jsonl") if r["kind"] == "round"][0]
        time.sleep(0.3 * r0["seconds"])
        st = _state(killed)
        assert proc.poll() is None and st.get("status") == "running", "the run ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    st = _state(killed)
    assert st["status"] == "running" and 1 <= st["rounds_done"] < 3
    # metrics.jsonl stays strictly parseable and holds complete rounds only: those of the checkpoint, plus
    # the next one when the kill fell between its append and its checkpoint (the resume drops it)
    lines = (killed / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    done = sorted({r["round"] for r in recs})
    assert done in (list(range(st["rounds_done"])), list(range(st["rounds_done"] + 1)))
    for rd in done:
        assert sum(1 for r in recs if r["round"] == rd and r["kind"] == "client") == 3
        assert sum(1 for r in recs if r["round"] == rd and r["kind"] == "round") == 1
    ck = torch.load(killed / "checkpoint.pt", weights_only=True)
    assert ck["rounds_done"] == st["rounds_done"] and "rng" in ck and len(ck["clients"]) == 3
    assert "s_a" in ck["clients"][0]["lam"] and ck["clients"][0]["optimizer"] is not None

    assert main(["run", "--resume", str(killed), "--quiet"]) == 0
    assert _state(killed)["status"] == "finished"

    ref = tmp_path / "ref"
    Run(load_config(None, "flare", ov), ref, quiet=True).execute()
    got, want = read_jsonl(killed / "metrics.jsonl"), read_jsonl(ref / "metrics.jsonl")
    assert [r["round"] for r in got if r["kind"] == "round"] == [0, 1, 2]
    assert _no_timing(got) == _no_timing(want)


def test_resume_trusts_the_checkpoint_and_drops_a_torn_line(tiny_folder, tmp_path, monkeypatch):
    """Killed between checkpoint.pt and state.json (state one round behind), with a torn last line in
    metrics.jsonl: the resume starts after the checkpoint's round, keeps round 0 as it was, and matches."""
    ov = _overrides(tiny_folder, tmp_path, ["rounds=3", "batch_size=16", "optim.reset_each_round=false"])
    cfg = load_config(None, "etf-anneal", ov)
    d = tmp_path / "run"
    run_interrupted(cfg, d, monkeypatch, at_round=2)
    assert _state(d)["rounds_done"] == 2
    (d / "state.json").write_text(json.dumps({"status": "running", "rounds_done": 1}))
    kept = (d / "metrics.jsonl").read_text()
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"kind": "client", "round": 2, "cli')
    Run(cfg, d, quiet=True).execute()
    after = (d / "metrics.jsonl").read_text()
    assert after.startswith(kept)  # rounds 0 and 1 were not recomputed (their timings are unchanged)

    ref = tmp_path / "ref"
    Run(cfg, ref, quiet=True).execute()
    assert _no_timing(read_jsonl(d / "metrics.jsonl")) == _no_timing(read_jsonl(ref / "metrics.jsonl"))


def test_a_run_resumed_on_another_machine_says_so(tiny_folder, tmp_path, monkeypatch):
    """state.json names the machine (CPU, torch, device) the run computed on; a run resumed on another one warns,
    naming both, and the report says where it ran."""
    cfg = load_config(None, "fedavg", _overrides(tiny_folder, tmp_path, ["rounds=2", "batch_size=16"]))
    d = tmp_path / "run"
    run_interrupted(cfg, d, monkeypatch, at_round=1)
    st = _state(d)
    here = st["backend"]["machine"]
    assert f", torch {torch.__version__}, device cpu" in here and st["rounds_done"] == 1
    st["backend"]["machine"] = "Another CPU (AVX2, no native bf16), torch 2.11.0, device cpu"
    (d / "state.json").write_text(json.dumps(st))
    Run(cfg, d, quiet=True).execute()
    st = _state(d)
    assert st["status"] == "finished" and st["backend"]["machine"] == here
    assert st["warnings"] == [f"through round 1 it ran with machine 'Another CPU (AVX2, no native bf16), torch "
                              f"2.11.0, device cpu', from then on with '{here}'"]
    assert f" — on {here}" in (d / "summary.md").read_text()


def test_finished_run_without_summary_gets_its_report(tiny_folder, tmp_path):
    ov = _overrides(tiny_folder, tmp_path, ["rounds=1", "batch_size=16"])
    cfg = load_config(None, "fafi", ov)
    d = tmp_path / "run"
    Run(cfg, d, quiet=True).execute()
    (d / "summary.md").unlink()
    before = (d / "metrics.jsonl").read_text()
    Run(cfg, d, quiet=True).execute()
    assert (d / "summary.md").exists() and (d / "metrics.jsonl").read_text() == before


def test_tensorboard_scalars(tiny_folder, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ov = _overrides(tiny_folder, tmp_path, ["rounds=2", "batch_size=16", "logging.tensorboard=true"])
    d = tmp_path / "tb"
    Run(load_config(None, "flare", ov), d, quiet=True).execute()
    acc = EventAccumulator(str(d / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for t in ("server/acc_feature", "server/acc_iffi", "server/g_protos_std", "server/inter_client_proto_std",
              "client0/lambda_raw", "client0/lambda_eff", "client2/base_loss"):
        assert t in tags, (t, sorted(tags))
    assert [e.step for e in acc.Scalars("server/acc_feature")] == [0, 1]
