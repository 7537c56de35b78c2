import contextlib
import io
import os
import subprocess
import sys

import pytest

from flare.cli import main
from flare.config import list_presets, load_config, parse_overrides
from flare.errors import FlareError


def test_overrides_parse_types():
    m = parse_overrides(["partition.alpha=0.1", "rounds=3", "dataset.download=true", "dataset.root=/x"])
    assert m == {"partition": {"alpha": 0.1}, "rounds": 3, "dataset": {"download": True, "root": "/x"}}


def test_layering_preset_then_file_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("rounds: 7\nlr: 0.01\n")
    cfg = load_config(f, "fedavg", ["lr=0.02"])
    assert cfg.rounds == 7 and cfg.lr == 0.02 and cfg.loss.objective == "ce" and cfg.method == "fedavg"


def test_amp_off_as_yaml_reads_it(tmp_path):
    """`off` is a YAML 1.1 boolean: the documented `amp=off` must mean "off" from the command line and a file."""
    assert load_config(None, "fafi", ["amp=off"]).amp == "off"
    f = tmp_path / "c.yaml"
    f.write_text("amp: off\n")
    assert load_config(f, "fafi", []).amp == "off"
    with pytest.raises(FlareError) as e:  # `on` has no documented meaning: still refused, naming the key
        load_config(None, "fafi", ["amp=on"])
    assert e.value.key == "amp"


@pytest.mark.parametrize("ov,key", [
    (["num_client=3"], "num_client"),
    (["rounds=abc"], "rounds"),
    (["partition.alpha=0"], "partition.alpha"),
    (["partition.alpha=-1"], "partition.alpha"),
    (["num_clients=0"], "num_clients"),
    (["device=gpu"], "device"),
    (["model.width=0"], "model.width"),
])
def test_bad_values_name_the_key(ov, key):
    with pytest.raises(FlareError) as e:
        load_config(None, "fafi", ov)
    assert e.value.key == key
    assert key in e.value.render()


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(FlareError) as e:
        load_config(None, None, ["num_client=3"])
    assert "num_clients" in e.value.render()


def test_unknown_preset():
    with pytest.raises(FlareError) as e:
        load_config(None, "fafii", [])
    assert "fafi" in e.value.render()


def test_presets_have_descriptions():
    ps = list_presets()
    assert {"fafi", "fedavg", "ensemble"} <= set(ps)
    assert all(p.get("description") for p in ps.values())


def run_cli(*args):
    """`flare ARGS` in this process (test_bad_input checks a real process): its exit code and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as e:  # argparse's own errors exit through SystemExit
            rc = e.code
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def test_cli_bad_input_exit_2_without_traceback(tmp_path):
    for args in (["run", "--preset", "fafi", "partition.alpha=0", "--out", str(tmp_path / "a")],
                 ["run", "--preset", "fafi", "bogus.key=1", "--out", str(tmp_path / "b")],
                 ["run", "--preset", "fafi", "device=cuda", "--out", str(tmp_path / "c")]
                 if not __import__("torch").cuda.is_available() else ["run", "--preset", "nope"]):
        r = run_cli(*args)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr
        assert r.stderr.startswith("flare: error:")


def test_options_and_overrides_in_any_order(tmp_path):
    """`flare run KEY=VALUE --preset NAME` is parsed like `flare run --preset NAME KEY=VALUE` (the bad value makes
    the config fail before any data is read, so both orders must reach the same config error)."""
    for args in (["run", "--preset", "entropy-lambda", "align.lambda_min=20", "rounds=1", "--out", str(tmp_path)],
                 ["run", "align.lambda_min=20", "--preset", "entropy-lambda", "rounds=1", "--out", str(tmp_path)],
                 ["run", "align.lambda_min=20", "--out", str(tmp_path), "rounds=1", "--preset", "entropy-lambda"]):
        r = run_cli(*args)
        assert r.returncode == 2 and "align.lambda_min (20.0) > align.lambda_max" in r.stderr, (args, r.stderr)
    r = run_cli("run", "rounds=1", "--bogus")
    assert r.returncode == 2 and "flare run: error: unrecognized arguments: --bogus" in r.stderr


def test_a_reader_that_went_away_ends_the_command_quietly():
    """`flare presets | head`: the pipe's read end is closed before flare writes a byte."""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    try:
        r = subprocess.run([sys.executable, "-m", "flare.cli", "presets"], stdout=write_fd, stderr=subprocess.PIPE,
                           text=True)
    finally:
        os.close(write_fd)
    assert r.returncode == 141
    assert r.stderr == ""


@pytest.mark.parametrize("ov,words", [
    (["align.surgery=pcgrad"], "align.anchors"),
    (["lam.learner=decoupled"], "align.anchors"),
    (["loss.contrast=public-bank"], "dataset.public_size"),
    (["loss.objective=ce", "align.anchors=etf"], "prototype head"),
])
def test_incompatible_parts_fail_before_running(ov, words):
    with pytest.raises(FlareError) as e:
        load_config(None, "fafi", ov)
    assert words in e.value.render()


@pytest.mark.parametrize("old, new, value", [("server.ensemble", "server.strategies.output.ensemble", "logits"),
                                             ("server.fedavg_buffers", "server.strategies.fedavg.buffers", "first")])
def test_the_built_in_rules_options_moved_into_their_strategies(old, new, value):
    """A config given with the old top-level key is refused with the line to write; a recorded config with it is
    migrated, and describes the same experiment as the config that writes the new key."""
    from flare.config import experiment_differences, migrate
    with pytest.raises(FlareError) as e:
        load_config(None, "fafi", [f"{old}={value}"])
    assert e.value.key == old and f"{new}={value}" in e.value.render()
    cfg = load_config(None, "fafi", [f"{new}={value}"])
    recorded = load_config(None, "fafi").model_dump(mode="json")
    recorded["server"].update({"ensemble": "softmax", "fedavg_buffers": "average", old.split(".")[1]: value})
    assert "ensemble" not in migrate(recorded)["server"] and recorded["server"]["ensemble"]  # a copy, moved
    assert experiment_differences(recorded, cfg) == []
    assert experiment_differences(recorded, load_config(None, "fafi")) == [new]
    assert experiment_differences(load_config(None, "fafi").model_dump(mode="json"),
                                  load_config(None, "fafi", [f"{new}={'softmax' if value == 'logits' else 'average'}"])) == []
    with pytest.raises(FlareError) as e:
        load_config(None, "fafi", [f"{new}=bogus"])
    assert e.value.key == new
