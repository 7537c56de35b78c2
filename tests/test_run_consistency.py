"""A run directory never disagrees with itself: config.yaml is checked against the config its results were computed
with (recorded in state.json and the checkpoint) by every command that reads a run, a checkpoint that does not fit
the model is refused naming the tensor, and a refused command leaves every file of the directory byte-identical."""
import json
import shutil

import pytest
import torch
import yaml

from flare.cli import main


def cli(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.err


@pytest.fixture(scope="module")
def finished(tiny_folder, tmp_path_factory):
    """One finished 1-round FAFI run (no R-dependent schedule, so it may be extended); tests copy it."""
    base = tmp_path_factory.mktemp("consistency")
    d = base / "run"
    tiny = [f"dataset.name=imagefolder", f"dataset.root={tiny_folder}", f"dataset.cache_dir={base / 'cache'}",
            "model.name=cnn", "model.width=0.25", "num_clients=3", "rounds=1", "batch_size=16",
            "partition.alpha=0.5", "device=cpu", "test_batch_size=32"]
    assert main(["run", "--preset", "fafi", *tiny, "--out", str(d), "--quiet"]) == 0
    return d, tiny


@pytest.fixture
def run_dir(finished, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(finished[0], d)
    return d


def snapshot(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()
            and p.name != ".lock"}


def edit_config(d, **changes):
    m = yaml.safe_load((d / "config.yaml").read_text())
    for k, v in changes.items():
        node = m
        *head, last = k.split(".")
        for h in head:
            node = node[h]
        node[last] = v
    (d / "config.yaml").write_text(yaml.safe_dump(m, sort_keys=False))


def test_state_and_checkpoint_record_the_config(run_dir):
    state = json.loads((run_dir / "state.json").read_text())
    on_disk = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert state["config"] == on_disk and len(state["config_fingerprint"]) == 16
    ck = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert ck["config"] == on_disk


COMMANDS = {
    "resume": lambda d, tiny: ["run", "--resume", str(d)],
    "resume with more rounds": lambda d, tiny: ["run", "--resume", str(d), "rounds=2"],
    "rerun into the directory": lambda d, tiny: ["run", "--config", str(d / "config.yaml"), "--out", str(d)],
    "fuse": lambda d, tiny: ["fuse", str(d), "--strategies", "output"],
    "report": lambda d, tiny: ["report", str(d)],
    "compare": lambda d, tiny: ["compare", "--presets", "fafi", *tiny, "--out", str(d.parent), "--quiet"],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_an_edited_config_is_refused_and_nothing_changes(command, run_dir, finished, capsys):
    edit_config(run_dir, **{"model.width": 0.5, "lr": 0.2})
    if command == "compare":  # compare's directory for the preset is <out>/fafi
        run_dir = run_dir.rename(run_dir.parent / "fafi")
    before = snapshot(run_dir.parent)
    rc, err = cli(COMMANDS[command](run_dir, finished[1]), capsys)
    assert rc == 2, err
    assert "Traceback" not in err
    assert "disagrees with itself" in err and "model.width (0.25 → 0.5)" in err and "lr (0.05 → 0.2)" in err, err
    assert "--out NEW_DIR" in err
    assert snapshot(run_dir.parent) == before


def test_a_legitimate_extension_keeps_the_directory_consistent(run_dir, capsys):
    rc, err = cli(["run", "--resume", str(run_dir), "rounds=2", "--quiet"], capsys)
    assert rc == 0, err
    state = json.loads((run_dir / "state.json").read_text())
    assert state["config"]["rounds"] == 2 and state["rounds_done"] == 2
    assert cli(["report", str(run_dir)], capsys)[0] == 0


def test_a_run_without_a_recorded_config_is_still_read(run_dir, capsys):
    """Directories written before the record existed are taken as they are."""
    state = json.loads((run_dir / "state.json").read_text())
    state.pop("config"), state.pop("config_fingerprint")
    (run_dir / "state.json").write_text(json.dumps(state))
    ck = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    ck.pop("config")
    torch.save(ck, run_dir / "checkpoint.pt")
    assert cli(["report", str(run_dir)], capsys)[0] == 0


def _foreign_checkpoint(run_dir, finished, tmp_path, capsys):
    """A checkpoint and uploads of the same experiment at another width, put in by hand, the checkpoint with no
    config record of its own."""
    other = tmp_path / "wide"
    tiny = [o if not o.startswith("model.width") else "model.width=0.5" for o in finished[1]]
    assert cli(["run", "--preset", "fafi", *tiny, "--out", str(other), "--quiet"], capsys)[0] == 0
    ck = torch.load(other / "checkpoint.pt", weights_only=True)
    ck.pop("config")
    torch.save(ck, run_dir / "checkpoint.pt")
    shutil.copy(other / "uploads.pt", run_dir / "uploads.pt")


@pytest.mark.parametrize("command,says", [
    ("fuse", ["uploads.pt': the upload of client ", "does not fit the run", "'encoder.", "has shape ["]),
    ("resume with more rounds", ["does not fit the model: tensor 'encoder.", "has shape (", "the model's is ("])])
def test_a_checkpoint_that_does_not_fit_names_the_tensor(command, says, run_dir, finished, tmp_path, capsys):
    """What a command reads of the clients (fuse: the uploads; a resume: the checkpoint) is refused, naming the
    tensor, when it does not fit the run's model."""
    _foreign_checkpoint(run_dir, finished, tmp_path, capsys)
    before = snapshot(run_dir)
    rc, err = cli(COMMANDS[command](run_dir, finished[1]) + ["--quiet"] * (command != "fuse"), capsys)
    assert rc == 2 and "Traceback" not in err, err
    assert all(s in err for s in says), err
    assert snapshot(run_dir) == before


def test_a_checkpoint_of_another_config_is_refused(run_dir, finished, tmp_path, capsys):
    other = tmp_path / "other"
    tiny = [o if not o.startswith("model.width") else "model.width=0.5" for o in finished[1]]
    assert cli(["run", "--preset", "fafi", *tiny, "--out", str(other), "--quiet"], capsys)[0] == 0
    shutil.copy(other / "checkpoint.pt", run_dir / "checkpoint.pt")
    before = snapshot(run_dir)
    rc, err = cli(COMMANDS["resume with more rounds"](run_dir, finished[1]) + ["--quiet"], capsys)
    assert rc == 2 and "recorded in checkpoint.pt" in err and "model.width (0.5 → 0.25)" in err, err
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("argv,names", [
    (["compare", "--presets", "fafi,,fedavg"], "--presets: 'fafi,,fedavg' has an empty element (position 2)"),
    (["compare", "--presets", "fafi,fedavg", "--seeds", "1,,2"], "--seeds: '1,,2' has an empty element"),
    (["compare", "--presets", "fafi,fedavg", "--seeds", "1,x"], "--seeds: '1,x': 'x' is not a valid element"),
    (["fuse", "RUN", "--strategies", "feature,"], "--strategies: 'feature,' has an empty element (position 2)"),
    (["parts", "--plugin", ""], "--plugin: a plugin module name is empty"),
    (["parts", "--plugin", "no_such_flare_plugin"], "--plugin: plugin module 'no_such_flare_plugin' cannot be found"),
    (["parts", "--plugin", "flare_refusing_plugin"],
     "--plugin: plugin module 'flare_refusing_plugin' failed to import: device: this plugin needs a GPU"),
])
def test_list_and_plugin_messages(argv, names, run_dir, tmp_path, capsys):
    argv = [str(run_dir) if a == "RUN" else a for a in argv]
    if argv[0] == "compare":
        argv += ["--out", str(tmp_path / "cmp"), "--quiet"]
    rc, err = cli(argv, capsys)
    assert rc == 2 and "Traceback" not in err, err
    assert names in err, err
    assert err.count("Fix:") == 1, err
    assert not (tmp_path / "cmp").exists()


def test_speed_fast_says_it_set_eval_every(tiny_overrides, tmp_path, capsys):
    rc, err = cli(["run", "--preset", "server-protos", *tiny_overrides, "server.protos_flow=reference", "speed=fast",
                   "--out", str(tmp_path / "r")], capsys)
    assert rc == 2 and "speed=fast sets eval.every=5" in err, err
    assert not (tmp_path / "r").exists()
