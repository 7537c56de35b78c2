"""A run directory nothing can corrupt: one writer at a time (a lock the OS releases when the writer dies), and a
resume that validates metrics.jsonl against the checkpoint before trusting it. Each corruption case ends with
exactly the metrics of the same run uninterrupted."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import run_interrupted
from flare.cli import main
from flare.config import load_config
from flare.errors import FlareError
from flare.rundir import read_jsonl
from flare.runner import Run


def _overrides(tiny_folder, tmp_path, extra=()):
    return [f"dataset.name=imagefolder", f"dataset.root={tiny_folder}", f"dataset.cache_dir={tmp_path / 'cache'}",
            "model.name=cnn", "model.width=0.25", "num_clients=3", "partition.alpha=0.5", "device=cpu",
            "test_batch_size=32", "batch_size=16", *extra]


def _no_timing(recs):
    return [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in recs]


def _same_as_uninterrupted(cfg, d, tmp_path):
    ref = tmp_path / "reference"
    if not ref.exists():
        Run(cfg, ref, quiet=True).execute()
    assert _no_timing(read_jsonl(d / "metrics.jsonl")) == _no_timing(read_jsonl(ref / "metrics.jsonl"))
    assert json.loads((d / "state.json").read_text())["status"] == "finished"


@pytest.fixture
def cfg(tiny_folder, tmp_path):
    return load_config(None, "flare", _overrides(tiny_folder, tmp_path, ["rounds=4"]))


def test_unfinished_run_with_a_log_cut_mid_line(cfg, tmp_path, monkeypatch):
    d = tmp_path / "run"
    run_interrupted(cfg, d, monkeypatch, at_round=3)
    text = (d / "metrics.jsonl").read_bytes()
    (d / "metrics.jsonl").write_bytes(text[: int(len(text) * 0.4)])  # rounds 2–3 gone, a line torn in round 1
    with pytest.warns(UserWarning, match="torn"):
        Run(cfg, d, quiet=True).execute()
    state = json.loads((d / "state.json").read_text())
    assert any("rebuilt from the checkpoint" in w for w in state["warnings"])
    _same_as_uninterrupted(cfg, d, tmp_path)


def test_finished_run_with_a_log_cut_mid_line_is_revalidated(cfg, tmp_path, capsys):
    d = tmp_path / "run"
    ov = []
    Run(cfg, d, quiet=True).execute()
    text = (d / "metrics.jsonl").read_bytes()
    (d / "metrics.jsonl").write_bytes(text[: int(len(text) * 0.7)])
    (d / "config.yaml").read_text()
    with pytest.warns(UserWarning):
        assert main(["run", "--config", str(d / "config.yaml"), "--out", str(d), "--quiet", *ov]) == 0
    out = capsys.readouterr().out
    final = float(re.search(r"final acc \(feature\) = ([\d.]+)%", out).group(1))
    summary = (d / "summary.md").read_text()
    assert re.search(rf"\| feature \(primary\) \| {final:.2f} \|", summary), (out, summary)
    assert "disagrees with checkpoint.pt" in summary  # the warning is part of the run's record
    _same_as_uninterrupted(cfg, d, tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_unreadable_checkpoint_falls_back_to_the_previous_one(damage, cfg, tmp_path, monkeypatch):
    d = tmp_path / "run"
    run_interrupted(cfg, d, monkeypatch, at_round=3)
    assert (d / "checkpoint.prev.pt").exists()
    ck = (d / "checkpoint.pt").read_bytes()
    (d / "checkpoint.pt").write_bytes(ck[: len(ck) // 2] if damage == "truncated" else b"")
    with pytest.warns(UserWarning, match="resuming from checkpoint.prev.pt"):
        Run(cfg, d, quiet=True).execute()
    _same_as_uninterrupted(cfg, d, tmp_path)


def test_no_readable_checkpoint_at_all_starts_over(cfg, tmp_path, monkeypatch):
    d = tmp_path / "run"
    run_interrupted(cfg, d, monkeypatch, at_round=1)  # one round done: no previous checkpoint yet
    assert not (d / "checkpoint.prev.pt").exists()
    (d / "checkpoint.pt").write_bytes(b"")
    with pytest.warns(UserWarning, match="starts again from round 1"):
        Run(cfg, d, quiet=True).execute()
    _same_as_uninterrupted(cfg, d, tmp_path)


def test_finished_run_whose_checkpoint_is_gone_keeps_its_complete_log(cfg, tmp_path):
    d = tmp_path / "run"
    Run(cfg, d, quiet=True).execute()
    before = (d / "metrics.jsonl").read_text()
    (d / "checkpoint.pt").write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="log is complete"):
        Run(cfg, d, quiet=True).execute()
    assert (d / "metrics.jsonl").read_text() == before  # nothing recomputed


def test_more_rounds_extend_a_finished_run_where_nothing_depends_on_R(tiny_folder, tmp_path, capsys):
    ov = _overrides(tiny_folder, tmp_path)
    d = tmp_path / "run"
    assert main(["run", "--preset", "fafi", *ov, "rounds=2", "--out", str(d), "--quiet"]) == 0
    assert main(["run", "--resume", str(d), "rounds=3", "--quiet"]) == 0
    ref = tmp_path / "ref"
    Run(load_config(None, "fafi", ov + ["rounds=3"]), ref, quiet=True).execute()
    # the rounds trained before the extension keep the progress p = e/(R·E) they were logged with (R was 2);
    # nothing of fafi depends on it, so every other number is the 3-round run's
    got, want = _no_timing(read_jsonl(d / "metrics.jsonl")), _no_timing(read_jsonl(ref / "metrics.jsonl"))
    assert [r.pop("progress", None) for r in got[:8]] != [r.pop("progress", None) for r in want[:8]]
    assert got == want
    assert "rounds: 3" in (d / "config.yaml").read_text()


def test_a_different_experiment_in_the_directory_is_refused(cfg, tmp_path):
    d = tmp_path / "run"
    Run(cfg, d, quiet=True).execute()
    with pytest.raises(FlareError) as e:
        Run(cfg.model_copy(update={"lr": 0.01}), d, quiet=True).execute()
    assert e.value.key == "--out" and "lr" in e.value.message


# `flare run` whose clients stop at the start of round 1 (round 0 checkpointed, the lock held) until the process is
# killed, having touched the file argv[1]: the test kills it mid-run at a known point instead of racing a timer.
_BLOCKED_AT_ROUND_1 = """
import pathlib, sys, time
marker, sys.argv = sys.argv[1], ["flare", *sys.argv[2:]]
from flare.cli import main
import flare.client.trainer as trainer
real = trainer.Client.train_round
def blocked(self, ctx, round_idx, on_step=None):
    if round_idx == 1:
        pathlib.Path(marker).touch()
        time.sleep(3600)
    return real(self, ctx, round_idx, on_step)
trainer.Client.train_round = blocked
sys.exit(main(sys.argv[1:]))
"""


def _spawn(ov, out, blocked_marker=None):
    env = dict(os.environ, FLARE_QUIET="1", OMP_NUM_THREADS=str(torch.get_num_threads()), OMP_WAIT_POLICY="PASSIVE")
    cmd = ["-m", "flare.cli"] if blocked_marker is None else ["-c", _BLOCKED_AT_ROUND_1, str(blocked_marker)]
    return subprocess.Popen([sys.executable, *cmd, "run", "--preset", "fafi", *ov, "--out", str(out),
                             "--quiet"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.long
def test_a_second_writer_is_refused_while_the_first_runs_and_not_after_it_was_killed(tiny_folder, tmp_path):
    ov = _overrides(tiny_folder, tmp_path, ["rounds=3", "optim.reset_each_round=false"])
    d = tmp_path / "run"
    first = _spawn(ov, d, blocked_marker=tmp_path / "in-round-1")
    try:
        deadline = time.time() + 300
        while not (tmp_path / "in-round-1").exists():  # the first process holds the lock and is mid-run
            assert first.poll() is None, first.communicate()[1][-2000:]
            assert time.time() < deadline
            time.sleep(0.05)
        second = _spawn(ov, d)
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2, err
        assert f"process {first.pid}" in err and "in use" in err and "Traceback" not in err
        assert first.poll() is None  # the refusal did not disturb the first writer
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    # the OS released the dead writer's lock: the same command resumes and finishes
    third = _spawn(ov, d)
    _, err = third.communicate(timeout=600)
    assert third.returncode == 0, err
    recs = read_jsonl(d / "metrics.jsonl")
    assert sum(r["kind"] == "round" for r in recs) == 3 and sum(r["kind"] == "client" for r in recs) == 9
    _same_as_uninterrupted(load_config(None, "fafi", ov), d, tmp_path)


def test_a_key_added_since_and_left_empty_is_no_difference():
    """A run directory made before `plugins` existed is the same experiment as a config that leaves it empty."""
    from flare.records import config_differences
    assert config_differences({"seed": 1}, {"seed": 1, "plugins": [], "server": {"strategies": {}}}) == []
    assert config_differences({"seed": 1}, {"seed": 1, "eval": {"rules": None}}) == []
    assert config_differences({"seed": 1}, {"seed": 1, "plugins": ["m"]}) == ["plugins"]
    assert config_differences({"seed": 1}, {"seed": 1, "rounds": 0}) == ["rounds"]


def _strip_key(d, section, key):
    """Make `d` look as if it were written before `section.key` existed: config.yaml, state.json and both
    checkpoints lose it."""
    import yaml
    cfg_file = d / "config.yaml"
    m = yaml.safe_load(cfg_file.read_text())
    del m[section][key]
    cfg_file.write_text(yaml.safe_dump(m, sort_keys=False))
    state = json.loads((d / "state.json").read_text())
    del state["config"][section][key]
    state.pop("config_fingerprint", None)
    state.get("files", {}).pop("config.yaml", None)
    (d / "state.json").write_text(json.dumps(state))
    for name in ("checkpoint.pt", "checkpoint.prev.pt"):
        if (d / name).exists():
            ck = torch.load(d / name, weights_only=False)
            ck.get("config", {}).get(section, {}).pop(key, None)
            torch.save(ck, d / name)


def _old_strategy_keys(d):
    """Make `d` look as if it were written before the output and fedavg rules' options moved into their strategies:
    config.yaml, state.json and both checkpoints hold `server.ensemble` and `server.fedavg_buffers` (defaults
    included, as every recorded config did) and no options of those two rules."""
    import yaml

    def old(m):
        server = m["server"]
        table = server.get("strategies", {})
        server["ensemble"] = table.pop("output", {}).get("ensemble", "softmax")
        server["fedavg_buffers"] = table.pop("fedavg", {}).get("buffers", "average")
        return m
    cfg_file = d / "config.yaml"
    cfg_file.write_text(yaml.safe_dump(old(yaml.safe_load(cfg_file.read_text())), sort_keys=False))
    state = json.loads((d / "state.json").read_text())
    old(state["config"])
    state.pop("config_fingerprint", None)
    (d / "state.json").write_text(json.dumps(state))
    for name in ("checkpoint.pt", "checkpoint.prev.pt"):
        if (d / name).exists():
            ck = torch.load(d / name, weights_only=False)
            old(ck["config"])
            torch.save(ck, d / name)


def test_a_run_recorded_with_the_old_server_keys_resumes_and_fuses(tiny_folder, tmp_path, monkeypatch):
    """A run directory written when the ensemble mode and FedAvg's buffers were top-level server keys is the same
    experiment as the config that sets them as the rules' options: it resumes to exactly the uninterrupted run's
    numbers, `flare fuse` scores it as the run did, and moving an option off the recorded value is refused."""
    cfg = load_config(None, "fafi", _overrides(tiny_folder, tmp_path, [
        "rounds=3", "server.strategies.output.ensemble=logits", "server.strategies.fedavg.buffers=first"]))
    d = tmp_path / "run"
    run_interrupted(cfg, d, monkeypatch, at_round=2)
    _old_strategy_keys(d)
    assert "ensemble: logits" in (d / "config.yaml").read_text()
    with pytest.raises(FlareError) as e:
        Run(load_config(None, "fafi", _overrides(tiny_folder, tmp_path, [
            "rounds=3", "server.strategies.output.ensemble=logits"])), d, quiet=True).execute()
    assert e.value.key == "--out" and "server.strategies.fedavg.buffers" in e.value.message
    Run(cfg, d, quiet=True).execute()
    _same_as_uninterrupted(cfg, d, tmp_path)
    _old_strategy_keys(d)
    assert main(["fuse", str(d), "--strategies", "output,fedavg"]) == 0
    fused = {r["strategy"]: r["acc"] for r in read_jsonl(d / "fuse.jsonl")}
    last = [r for r in read_jsonl(d / "metrics.jsonl") if r["kind"] == "round"][-1]
    assert fused == {"output": last["acc_output"], "fedavg": last["acc_fedavg"]}


def test_a_run_recorded_before_an_option_existed_resumes_where_the_option_is_at_its_default(
        cfg, tmp_path, monkeypatch):
    """A new option defaults to the old behaviour, so a half-finished run whose records lack it is the same
    experiment and resumes to exactly the uninterrupted run's numbers; moving the option off its default is
    another experiment and is refused, naming the key."""
    d = tmp_path / "run"
    run_interrupted(cfg, d, monkeypatch, at_round=2)
    _strip_key(d, "augment", "schedule")
    with pytest.raises(FlareError) as e:
        moved = cfg.model_copy(update={"augment": cfg.augment.model_copy(update={"schedule": "chunked"})})
        Run(moved, d, quiet=True).execute()
    assert e.value.key == "--out" and "augment.schedule" in e.value.message
    Run(cfg, d, quiet=True).execute()
    _same_as_uninterrupted(cfg, d, tmp_path)
