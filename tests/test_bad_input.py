"""Every bad input a user can give is one paragraph on stderr naming the input and the fix, and exit code 2 —
never a traceback. One row per input: the ones the reliability issue found, then those handled before."""
import json
import os
import subprocess
import sys
import tarfile

import pytest
import torch

from conftest import copy_of_finished_run
from flare.cli import main
from flare.models import create_model
from flare.rundir import read_jsonl
from flare_paper.cli import add_command


def cli(argv, capsys):
    """`flare ARGV`, with the `paper` command its entry point adds where flare_paper is installed."""
    try:
        rc = main(argv, commands=[add_command])
    except SystemExit as e:  # argparse's own errors exit through SystemExit
        rc = e.code
    err = capsys.readouterr().err
    return rc, err


def _garbage_tar(tmp_path):
    p = tmp_path / "broken.tar.gz"
    p.write_bytes(b"\x1f\x8b\x08\x00 this is not a gzip stream")
    return str(p)


def _misplaced_tar(tiny_folder, tmp_path):
    """A real archive whose images sit in images/a/ instead of train/<class>/."""
    p = tmp_path / "misplaced.tar.gz"
    with tarfile.open(p, "w:gz") as tar:
        for i, f in enumerate(sorted((tiny_folder / "train" / "class0").iterdir())[:3]):
            tar.add(f, arcname=f"images/a/{i}.png")
    return str(p)


def _finished_run(tiny, tmp_path, capsys):
    def make(d):
        assert main(["run", "--preset", "etf-anneal", *tiny, "rounds=1", "--out", str(d), "--quiet"]) == 0
        capsys.readouterr()

    return str(copy_of_finished_run("etf-anneal-1-round", tmp_path / "done", make))


def _paper(tmp_path, *args):
    """`flare paper` at smoke scale into tmp_path/paper, which a refused command must leave absent."""
    return ["paper", "--scale", "smoke", "--out", str(tmp_path / "paper"), "--quiet", *args, "device=cpu"]


def _unfinished_run(tiny, tmp_path, capsys):
    """A finished run whose state.json says it is still running (as after a kill)."""
    d = _finished_run(tiny, tmp_path, capsys)
    state = json.loads((tmp_path / "done" / "state.json").read_text())
    (tmp_path / "done" / "state.json").write_text(json.dumps({**state, "status": "running"}))
    return d


def _edited_run(tiny, tmp_path, capsys):
    """A finished run whose config.yaml was then edited by hand (another model width)."""
    d = _finished_run(tiny, tmp_path, capsys)
    cfg = tmp_path / "done" / "config.yaml"
    cfg.write_text(cfg.read_text().replace("width: 0.25", "width: 0.5"))
    return d


# clients of different architectures (docs/heterogeneous.md): refused before anything is written
ARCHITECTURE_ROWS = [
    ("per-client architectures of the wrong length", lambda t, p, f, c: ["run", *t, "model.clients=[cnn,wrn16_1]"],
     "model.clients: invalid configuration: model.clients lists 2 architectures for num_clients=3"),
    ("model.clients naming a client that does not exist", lambda t, p, f, c:
     ["run", *t, "model.clients={5: wrn16_1}"], "model.clients names client 5, but the clients are 0 … 2"),
    ("model.mix not summing to num_clients", lambda t, p, f, c: ["run", *t, "model.mix={cnn: 2, wrn16_1: 2}"],
     "model.mix: invalid configuration: model.mix deals 4 clients (cnn: 2, wrn16_1: 2), num_clients=3"),
    ("model.mix naming an unknown model", lambda t, p, f, c: ["run", *t, "model.mix={cnn: 2, wrn16_2: 1}"],
     "model.mix.wrn16_2: invalid configuration: unknown model 'wrn16_2' for model.mix (did you mean wrn16_1?)"),
    ("model.clients and model.mix both set", lambda t, p, f, c:
     ["run", *t, "model.clients=[cnn,wrn16_1,cnn]", "model.mix={cnn: 3}"],
     "model.mix: invalid configuration: model.clients and model.mix both say which client runs what"),
    ("fedavg in eval.rules with mixed clients", lambda t, p, f, c:
     ["run", *t, "model.clients=[cnn,wrn16_1,cnn]", "model.feature_dim=8", "eval.rules=[primary,fedavg]"],
     "eval.rules: server strategy 'fedavg' cannot fuse clients of different architectures (2 × cnn, 1 × wrn16_1)"),
    ("otfusion as server.primary with mixed clients", lambda t, p, f, c:
     ["run", *t, "model.clients={1: wrn16_1}", "model.feature_dim=8", "server.primary=otfusion"],
     "server.primary: server strategy 'otfusion' cannot fuse clients of different architectures"),
    ("encoders of different d without model.feature_dim", lambda t, p, f, c:
     ["run", *t, "model.clients=[cnn,wrn16_1,cnn]"], "model.feature_dim: the run's architectures end in different "
                                                     "feature dimensions (wrn16_1: d = 16, cnn: d = 32)"),
]

def _yaml(p, name, text):
    (p / name).write_text(text)
    return str(p / name)


def _encoder_state(p, name, spoil=None):
    """A cnn encoder's state dict that fits the tiny runs' model (width 0.25, 3 channels), saved to p/name; `spoil`:
    a tensor name whose first value becomes NaN."""
    state = create_model("cnn", 3, 2, 0.25).encoder.state_dict()
    if spoil:
        state[spoil].view(-1)[0] = float("nan")
    torch.save(state, p / name)
    return str(p / name)


def _federate(t):
    """`flare federate` with the tiny overrides (it takes no --quiet) and a workdir that must stay unmade."""
    return ["federate", *[o for o in t if o != "--quiet"]]


# refused before any file is written or any process started: one paragraph, the key, the fix, no --out
BEFORE_WRITING_ROWS = [
    ("a command-line mapping with a duplicate key", lambda t, p, f, c:
     ["run", *t, "model.clients={0: cnn, 0: wrn16_1}"],
     "model.clients: override 'model.clients={0: cnn, 0: wrn16_1}' sets the key 0 twice"),
    ("a config file giving client 0 as 0 and as '0'", lambda t, p, f, c:
     ["run", "--config", _yaml(p, "c.yaml", "model:\n  clients:\n    0: cnn\n    '0': wrn16_1\n"), *t],
     "model.clients.0: invalid configuration: model.clients gives client 0 twice (as 0 and '0')"),
    ("a timm ViT asserting on its input size as model.name", lambda t, p, f, c:
     ["run", *t, "model.name=timm/vit_tiny_patch16_224", "model.width=1"],
     "model.name: model timm/vit_tiny_patch16_224 cannot take the dataset's 3×"),
    ("a timm Swin asserting on its input size as a model.clients entry", lambda t, p, f, c:
     ["run", *t, "model.width=1", "model.feature_dim=8", "model.clients={1: timm/swin_tiny_patch4_window7_224}"],
     "model.clients.1.name: model timm/swin_tiny_patch4_window7_224 cannot take the dataset's 3×"),
    ("a timm ViT asserting on its input size as server.model", lambda t, p, f, c:
     ["run", *t, "model.feature_dim=8", "server.model={name: timm/vit_tiny_patch16_224, width: 1}"],
     "server.model.name: model timm/vit_tiny_patch16_224@1 cannot take the dataset's 3×"),
    ("a timm model.clients entry under a model.width it cannot take", lambda t, p, f, c:
     ["run", *t, "model.feature_dim=8", "model.clients={1: timm/resnet18}"],
     "model.clients.1.width: timm/resnet18 has the width its name gives; model.clients.1.width=0.25 cannot scale it. "
     "Fix: set model.clients.1.width=1"),
    ("an absurd model.feature_dim", lambda t, p, f, c: ["run", *t, "model.feature_dim=100000000000000"],
     "model.feature_dim=100000000000000: Input should be less than or equal to 65536"),
    ("an absurd model.width", lambda t, p, f, c: ["run", *t, "model.width=1000000"],
     "model.width=1000000: Input should be less than or equal to 16"),
    ("an absurd width of a model.clients entry", lambda t, p, f, c:
     ["run", *t, "model.clients={1: {name: cnn, width: 100000}}"], "model.clients.1.width=100000: Input should be"),
    ("an absurd num_clients", lambda t, p, f, c: ["run", *t, "num_clients=100000000000000"],
     "num_clients=100000000000000: Input should be less than or equal to 1048576"),
    ("an absurd loss.bank_size", lambda t, p, f, c: ["run", *t, "loss.bank_size=100000000000000"],
     "loss.bank_size=100000000000000: Input should be less than or equal to 1048576"),
    ("a boolean model.feature_dim", lambda t, p, f, c: ["run", *t, "model.feature_dim=true"],
     "model.feature_dim: invalid configuration: model.feature_dim=True: a boolean is not an integer"),
    ("a boolean rounds", lambda t, p, f, c: ["run", *t, "rounds=true"],
     "rounds: invalid configuration: rounds=True: a boolean is not an integer"),
    ("a boolean num_clients in a config file", lambda t, p, f, c:
     ["run", *[o for o in t if not o.startswith("num_clients=")], "--config",
      _yaml(p, "k.yaml", "num_clients: true\n")],
     "num_clients: invalid configuration: num_clients=True: a boolean is not an integer"),
    ("a boolean lr", lambda t, p, f, c: ["run", *t, "lr=yes"], "lr=True: a boolean is not a number"),
    ("a boolean option of a part", lambda t, p, f, c:
     ["run", *t, "dataset.public_size=20", "eval.rules=[primary,feddf]", "server.strategies.feddf.steps=true"],
     "server.strategies.feddf.steps=True: a boolean is not an integer"),
    ("a checkpoint holding a NaN weight", lambda t, p, f, c:
     ["run", *t, f"model.checkpoint={_encoder_state(p, 'nan.pt', 'body.0.weight')}"],
     "model.checkpoint: checkpoint {p}/nan.pt holds non-finite values (NaN or Inf) in tensor 'body.0.weight'"),
    ("a checkpoint holding a NaN BatchNorm running_var", lambda t, p, f, c:
     ["run", *t, f"model.checkpoint={_encoder_state(p, 'var.pt', 'body.1.running_var')}"],
     "holds non-finite values (NaN or Inf) in tensor 'body.1.running_var' (1 of"),
    ("a model.clients entry's checkpoint that is not there", lambda t, p, f, c:
     ["run", *t, "model.clients={1: {name: cnn, checkpoint: /nonexistent/c.pt}}"],
     "model.clients.1.checkpoint: checkpoint /nonexistent/c.pt is not a file"),
    ("a model.clients entry's checkpoint holding NaN", lambda t, p, f, c:
     ["run", *t, f"model.clients={{2: {{name: cnn, checkpoint: {_encoder_state(p, 'n2.pt', 'body.0.weight')}}}}}"],
     "model.clients.2.checkpoint: checkpoint {p}/n2.pt holds non-finite values"),
    ("server.model's checkpoint that does not fit", lambda t, p, f, c:
     ["run", *t, "model.feature_dim=8", f"server.model={{name: wrn16_1, checkpoint: {_encoder_state(p, 's.pt')}}}"],
     "server.model.checkpoint: checkpoint {p}/s.pt (an encoder's state) does not fit the model"),
    ("federate with a checkpoint of another architecture", lambda t, p, f, c:
     [*_federate(t), f"model.checkpoint={_encoder_state(p, 'other.pt')}", "model.name=wrn16_1",
      "--out", str(p / "out"), "--workdir", str(p / "wd")],
     "model.checkpoint: checkpoint {p}/other.pt (an encoder's state) does not fit the model"),
]

# (id, argv builder (tiny overrides, tmp_path, tiny_folder, capsys) -> argv, what stderr must name)
ROWS = [
    # --- found by the reliability issue ---------------------------------------------------------
    ("out is a file", lambda t, p, f, c: (p / "f").write_text("x") and
     ["run", *t, "--out", str(p / "f")], "is a file"),
    ("out under a non-directory", lambda t, p, f, c: ["run", *t, "--out", "/dev/null/run"], "/dev/null/run"),
    ("out under /proc", lambda t, p, f, c: ["run", *t, "--out", "/proc/flare-no/run"], "/proc/flare-no/run"),
    ("config of binary bytes", lambda t, p, f, c: (p / "b.yaml").write_bytes(bytes(range(256))) and
     ["run", "--config", str(p / "b.yaml"), *t], "not a text file"),
    ("config is a directory", lambda t, p, f, c: ["run", "--config", str(p), *t], "is a directory"),
    ("compare --preset (prefix of --presets)", lambda t, p, f, c:
     ["compare", "--presets", "fedavg,ensemble", "--preset", "fafi", *t], "--preset"),
    ("run --pre (abbreviation)", lambda t, p, f, c: ["run", "--pre", "fafi", *t], "--pre"),
    ("resume with an override that cannot apply", lambda t, p, f, c:
     ["run", "--resume", _finished_run(t, p, c), "lr=0.1"], "lr"),
    ("resume with more rounds of an annealed method", lambda t, p, f, c:
     ["run", "--resume", _finished_run(t, p, c), "rounds=3"], "align.schedule=linear"),
    ("resume with another --out", lambda t, p, f, c:
     ["run", "--resume", _finished_run(t, p, c), "--out", str(p / "elsewhere")], "--out"),
    ("train subset larger than the dataset", lambda t, p, f, c: ["run", *t, "dataset.train_subset=100000"],
     "dataset.train_subset"),
    ("test subset larger than the dataset", lambda t, p, f, c: ["run", *t, "dataset.test_subset=100000"],
     "dataset.test_subset"),
    ("archive with a wrong layout", lambda t, p, f, c:
     ["run", *t, f"dataset.root={_misplaced_tar(f, p)}"], "images/a/"),
    ("cache_dir is a file", lambda t, p, f, c: (p / "cachefile").write_text("x") and
     ["run", *t, f"dataset.cache_dir={p / 'cachefile'}"], "dataset.cache_dir"),
    ("cache_dir cannot be created", lambda t, p, f, c: ["run", *t, "dataset.cache_dir=/proc/flare-cache"],
     "dataset.cache_dir"),
    # --- handled before -------------------------------------------------------------------------
    ("unknown key", lambda t, p, f, c: ["run", *t, "num_client=3"], "num_clients"),
    ("wrong type", lambda t, p, f, c: ["run", *t, "rounds=abc"], "rounds"),
    ("alpha 0", lambda t, p, f, c: ["run", *t, "partition.alpha=0"], "partition.alpha"),
    ("no clients", lambda t, p, f, c: ["run", *t, "num_clients=0"], "num_clients"),
    ("more clients than samples", lambda t, p, f, c: ["run", *t, "num_clients=500"], "num_clients"),
    ("missing dataset", lambda t, p, f, c: ["run", "rounds=1", "dataset.name=cifar10", "--out", str(p / "r")],
     "dataset.root"),
    ("unreadable archive", lambda t, p, f, c: ["run", *t, f"dataset.root={_garbage_tar(p)}"], "broken.tar.gz"),
    ("unknown preset", lambda t, p, f, c: ["run", "--preset", "fafii", *t], "fafi"),
    ("entropy rule bounds reversed", lambda t, p, f, c:
     ["run", *t, "align.lambda_min=5", "align.lambda_max=1"], "align.lambda_min"),
    ("SGDR period 0", lambda t, p, f, c: ["run", *t, "lr_schedule.t0=0"], "lr_schedule.t0"),
    ("unknown schedule", lambda t, p, f, c: ["run", *t, "align.schedule=exponential"], "align.schedule"),
    ("public slice too large", lambda t, p, f, c: ["run", *t, "dataset.public_size=500"], "dataset.public_size"),
    ("ETF with d < C − 1", lambda t, p, f, c: ["run", *t, "align.anchors=etf", "model.width=0.01"],
     "align.anchors"),
    ("override without =", lambda t, p, f, c: ["run", *t, "rounds"], "rounds"),
    ("renamed key", lambda t, p, f, c: ["run", "--preset", "flare", *t, "lam.lambda_max=5"],
     "lam.valve_threshold"),
    ("λ learner without anchors", lambda t, p, f, c: ["run", *t, "lam.learner=decoupled"], "align.anchors"),
    ("report on a missing path", lambda t, p, f, c: ["report", str(p / "missing")], "missing"),
    ("sweep file missing", lambda t, p, f, c: ["sweep", "--config", str(p / "nope.yaml")], "nope.yaml"),
    ("paper with an unknown dataset", lambda t, p, f, c: ["paper", "--scale", "smoke", "--datasets", "imagenet",
                                                          "--dry-run"], "--datasets"),
    ("lr-probe with no batches", lambda t, p, f, c: ["lr-probe", *t, "--batches", "0"], "--batches"),
    ("compare with no presets", lambda t, p, f, c: ["compare", "--presets", ",", *t], "--presets"),
    ("resume a directory that is not a run", lambda t, p, f, c: ["run", "--resume", str(p)], "--resume"),
    # --- numbers a reviewer trusts, and the defects found on the way ------------------------------
    ("empty --out", lambda t, p, f, c: ["run", *t, "--out", ""], "--out"),
    ("config with a duplicate key", lambda t, p, f, c: (p / "d.yaml").write_text("rounds: 1\nseed: 2\nrounds: 5\n")
     and ["run", "--config", str(p / "d.yaml"), *t], "duplicate key 'rounds'"),
    ("unknown cpu_isa", lambda t, p, f, c: ["run", *t, "cpu_isa=avx9000"], "cpu_isa"),
    ("unknown evaluation rule", lambda t, p, f, c: ["run", *t, "eval.rules=[feature,bogus]"], "eval.rules"),
    ("prototype rule for a plain classifier", lambda t, p, f, c:
     ["run", "--preset", "fedavg", *t, "eval.rules=[iffi]"], "eval.rules"),
    ("eval.every with Plan B's carried G", lambda t, p, f, c:
     ["run", "--preset", "server-protos", *t, "server.protos_flow=reference", "eval.every=2"], "eval.every"),
    ("compare baseline not compared", lambda t, p, f, c:
     ["compare", "--presets", "fedavg,ensemble", "--baseline", "fafi", *t], "--baseline"),
    ("report baseline of no run", lambda t, p, f, c:
     ["report", _finished_run(t, p, c), "--baseline", "nosuch", "--out", str(p / "rep")], "--baseline"),
    # --- a run directory that never disagrees with itself (more in test_run_consistency.py) ------------------
    ("resume a run whose config.yaml was edited", lambda t, p, f, c:
     ["run", "--resume", _edited_run(t, p, c)], "disagrees with itself"),
    ("fuse a run whose config.yaml was edited", lambda t, p, f, c:
     ["fuse", _edited_run(t, p, c), "--strategies", "output"], "model.width (0.25 → 0.5)"),
    ("report a run whose config.yaml was edited", lambda t, p, f, c: ["report", _edited_run(t, p, c)],
     "recorded in state.json"),
    ("an empty element in --presets", lambda t, p, f, c: ["compare", "--presets", "fafi,,fedavg", *t],
     "--presets: 'fafi,,fedavg' has an empty element"),
    ("an empty element in --seeds", lambda t, p, f, c: ["compare", "--presets", "fafi", "--seeds", "1,", *t],
     "--seeds: '1,' has an empty element"),
    ("an empty --plugin", lambda t, p, f, c: ["parts", "--plugin", ""], "--plugin: a plugin module name is empty"),
    # --- plugins and registered parts (tests/plugins/) ------------------------------------------------
    ("unknown plugin module", lambda t, p, f, c: ["run", *t, "plugins=[no_such_flare_plugin]"],
     "plugins: plugin module 'no_such_flare_plugin' cannot be found"),
    ("plugin raising on import", lambda t, p, f, c: ["run", *t, "plugins=[flare_broken_plugin]"],
     "plugins: plugin module 'flare_broken_plugin' raised on import: RuntimeError"),
    ("plugin given as a file path", lambda t, p, f, c: ["run", *t, "plugins=[./my_methods.py]"],
     "plugins: plugin './my_methods.py' looks like a file path"),
    ("a part name nobody registered", lambda t, p, f, c: ["run", *t, "align.surgery=pcgradd"],
     "unknown gradient surgery 'pcgradd' for align.surgery (did you mean pcgrad?)"),
    ("a timm name timm does not have", lambda t, p, f, c: ["run", *t, "model.name=timm/resnt18", "model.width=1"],
     "unknown model 'timm/resnt18' for model.name (did you mean timm/resnet18"),
    ("a timm model whose downsampling outgrows the images", lambda t, p, f, c:
     ["run", *t, "model.name=timm/convnext_atto", "model.width=1"],
     "model timm/convnext_atto cannot take the dataset's 3×"),
    ("a checkpoint that does not fit", lambda t, p, f, c: torch.save(
        {"encoder.body.0.weight": torch.zeros(16, 3, 3, 3)}, p / "w.pt") or ["run", *t, f"model.checkpoint={p}/w.pt"],
     "w.pt does not fit the model: tensor 'encoder.body.0.weight' has shape (16, 3, 3, 3) there, the model's is "
     "(8, 3, 3, 3)"),
    ("a checkpoint that is not there", lambda t, p, f, c: ["run", *t, "model.checkpoint=/nonexistent/init.pt"],
     "model.checkpoint: checkpoint /nonexistent/init.pt is not a file"),
    # --- server strategies and `flare fuse` -----------------------------------------------------------
    ("fuse with a strategy nobody registered", lambda t, p, f, c:
     ["fuse", _finished_run(t, p, c), "--strategies", "feature,fedavgg"],
     "unknown server strategy 'fedavgg' (did you mean fedavg"),
    ("fuse on an unfinished run", lambda t, p, f, c: ["fuse", _unfinished_run(t, p, c), "--strategies", "feature"],
     "is not finished (status: running)"),
    ("fuse at a round other than the last", lambda t, p, f, c:
     ["fuse", _finished_run(t, p, c), "--strategies", "feature", "--round", "0"],
     "only the states after the last round (1) are saved"),
    ("fuse with an override", lambda t, p, f, c: ["fuse", _finished_run(t, p, c), "--strategies", "feature",
                                                  "lr=0.1"], "takes only server-strategy options as overrides"),
    ("a primary strategy nobody registered", lambda t, p, f, c: ["run", *t, "server.primary=bogus"],
     "unknown server strategy 'bogus' for server.primary"),
    ("a server that distils on public data without dataset.public_size", lambda t, p, f, c:
     ["run", *t, "eval.rules=[primary,feddf]"],
     "dataset.public_size: server strategy 'feddf' trains on the server's unlabeled public slice"),
    ("fuse with a strategy the run cannot serve (no public slice)", lambda t, p, f, c:
     ["fuse", _finished_run(t, p, c), "--strategies", "bnrecal"],
     "dataset.public_size: server strategy 'bnrecal' trains on the server's unlabeled public slice"),
    ("client statistics that do not match the strategy's declaration", lambda t, p, f, c:
     ["run", *t, "plugins=[flare_demo_plugin]", "eval.rules=[primary,demo_counts]",
      "server.strategies.demo_counts.bad_shape=true"],
     "server.strategies.demo_counts: server strategy 'demo_counts' computed client statistics that do not match"),
    ("a plugin option of the wrong type", lambda t, p, f, c: ["run", *t, "plugins=[flare_demo_plugin]",
                                                              "loss.terms.demo_center.weight=heavy"],
     "loss.terms.demo_center.weight"),
    # --- `flare paper`: every option checked before the first run (nothing is run or written) ----------------
    ("paper with a strategy nobody registered", lambda t, p, f, c:
     _paper(p, "--strategies", "output,fedavgg"), "--strategies: unknown server strategy 'fedavgg'"),
    ("paper --dry-run with a strategy nobody registered", lambda t, p, f, c:
     _paper(p, "--strategies", "nosuch", "--dry-run"), "--strategies: unknown server strategy 'nosuch'"),
    ("paper with a misspelt plugin strategy", lambda t, p, f, c:
     _paper(p, "--strategies", "demo_countz", "--dry-run", "plugins=[flare_demo_plugin]"),
     "--strategies: unknown server strategy 'demo_countz' (did you mean demo_counts"),
    ("paper with a strategy Table 1's runs cannot serve", lambda t, p, f, c:
     _paper(p, "--strategies", "feddf"), "--strategies: server strategy 'feddf' cannot fuse Table 1's run"),
    ("paper --dry-run with a strategy Table 1's runs cannot serve", lambda t, p, f, c:
     _paper(p, "--strategies", "output,bnrecal", "--dry-run"), "--strategies: server strategy 'bnrecal' cannot fuse"),
    ("paper with an empty strategy", lambda t, p, f, c: _paper(p, "--strategies", "output,,fedproto"),
     "--strategies: 'output,,fedproto' has an empty element"),
    ("paper with a baseline no experiment runs", lambda t, p, f, c: _paper(p, "--baseline", "nosuch"),
     "--baseline: --baseline nosuch is not among the methods these experiments run"),
    ("paper --dry-run with a baseline outside the selected experiments", lambda t, p, f, c:
     _paper(p, "--only", "ablation", "--baseline", "fedavg", "--dry-run"), "--baseline fedavg is not among"),
    ("paper with an unknown experiment", lambda t, p, f, c: _paper(p, "--only", "table1,tabel2"),
     "--only: --only names unknown experiments: tabel2"),
    ("paper --dry-run with an empty experiment", lambda t, p, f, c:
     _paper(p, "--only", "table1,,ablation", "--dry-run"), "--only: 'table1,,ablation' has an empty element"),
    ("paper with an unknown protocol", lambda t, p, f, c: _paper(p, "--protocol", "clean,dirty"),
     "--protocol: --protocol clean,dirty: unknown protocol(s) dirty"),
    ("paper --dry-run with an empty protocol", lambda t, p, f, c:
     _paper(p, "--protocol", "clean,,reference", "--dry-run"), "--protocol: 'clean,,reference' has an empty element"),
    ("paper with an empty dataset", lambda t, p, f, c: _paper(p, "--datasets", "fmnist,,cifar10"),
     "--datasets: 'fmnist,,cifar10' has an empty element"),
    ("paper --dry-run with an unknown dataset", lambda t, p, f, c: _paper(p, "--datasets", "imagenet", "--dry-run"),
     "--datasets: unknown dataset 'imagenet'"),
    ("paper with a seed that is no integer", lambda t, p, f, c: _paper(p, "--seeds", "1,x"),
     "--seeds: '1,x': 'x' is not a valid element"),
    ("paper --dry-run with an empty seed", lambda t, p, f, c: _paper(p, "--seeds", "1,,2", "--dry-run"),
     "--seeds: '1,,2' has an empty element"),
    ("paper with a data root for an unknown dataset", lambda t, p, f, c:
     _paper(p, "--data-root", "imagenet=/data/imagenet"), "--data-root 'imagenet=/data/imagenet' names the unknown"),
    ("paper --dry-run with a data root without a path", lambda t, p, f, c:
     _paper(p, "--data-root", "cifar10=", "--dry-run"), "--data-root 'cifar10=' is not of the form NAME=PATH"),
    ("paper with a dataset given two roots", lambda t, p, f, c:
     _paper(p, "--data-root", "cifar10=/a", "--data-root", "cifar10=/b"), "--data-root gives 'cifar10' twice"),
    ("paper with no workers", lambda t, p, f, c: _paper(p, "--workers", "0"), "--workers: --workers 0"),
    ("paper with an empty --out", lambda t, p, f, c: ["paper", "--scale", "smoke", "--out", "", "--quiet"],
     "--out: --out is empty"),
    # --- a strategy whose output cannot be scored (tests/plugins/flare_bad_strategies.py): no accuracy for it
    ("run: a strategy whose predictor() is not a predictor", lambda t, p, f, c:
     ["run", *t, "plugins=[flare_bad_strategies]", "eval.rules=[primary,bad_not_predictor]"],
     "server.strategies.bad_not_predictor: server strategy 'bad_not_predictor' (plugin module "
     "'flare_bad_strategies') in round 1: predictor() returned Tensor"),
    ("run: a strategy scoring batch x (classes - 1)", lambda t, p, f, c:
     ["run", *t, "plugins=[flare_bad_strategies]", "eval.rules=[primary,bad_shape]"],
     "server strategy 'bad_shape' (plugin module 'flare_bad_strategies') in round 1: its predictor's scores have "
     "shape"),
    ("run: a strategy scoring NaN", lambda t, p, f, c:
     ["run", *t, "plugins=[flare_bad_strategies]", "eval.rules=[primary,bad_nan]"],
     "server.strategies.bad_nan: server strategy 'bad_nan' (plugin module 'flare_bad_strategies') in round 1: "
     "its predictor's scores hold"),
    ("fuse: a strategy whose predictor() is not a predictor", lambda t, p, f, c:
     ["fuse", _finished_run(t, p, c), "--strategies", "bad_not_predictor", "--plugin", "flare_bad_strategies"],
     "server.strategies.bad_not_predictor: server strategy 'bad_not_predictor' (plugin module "
     "'flare_bad_strategies') in round 1: predictor() returned Tensor"),
    ("fuse: a strategy scoring batch x (classes - 1)", lambda t, p, f, c:
     ["fuse", _finished_run(t, p, c), "--strategies", "bad_shape", "--plugin", "flare_bad_strategies"],
     "server.strategies.bad_shape: server strategy 'bad_shape' (plugin module 'flare_bad_strategies') in round 1: "
     "its predictor's scores have shape"),
    ("fuse: a strategy scoring NaN", lambda t, p, f, c:
     ["fuse", _finished_run(t, p, c), "--strategies", "bad_nan", "--plugin", "flare_bad_strategies"],
     "server.strategies.bad_nan: server strategy 'bad_nan' (plugin module 'flare_bad_strategies') in round 1: "
     "its predictor's scores hold"),
    *ARCHITECTURE_ROWS,
    *BEFORE_WRITING_ROWS,
]
# rows refused before the run directory exists: one paragraph, and no --out written (nor a federation's workdir)
NOTHING_WRITTEN = {r[0] for r in [*ARCHITECTURE_ROWS, *BEFORE_WRITING_ROWS]}
# rows whose strategy must leave no accuracy behind: no acc_<name> in metrics.jsonl, no fuse.jsonl record, not
# in summary.md
REFUSED_STRATEGY = {r[0]: r[2].split("server strategy '")[1].split("'")[0] for r in ROWS if
                    r[0].startswith(("run: a strategy", "fuse: a strategy"))}


@pytest.mark.parametrize("name,build,names", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_exit_2_with_a_message_naming_it(name, build, names, tiny_overrides, tiny_folder, tmp_path,
                                                       capsys):
    tiny = [o for o in tiny_overrides if not o.startswith("rounds=")] + ["rounds=1", "--quiet"]
    argv = build(tiny, tmp_path, tiny_folder, capsys)
    if "--out" not in argv and argv[0] in ("run", "compare") and "--resume" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    rc, err = cli(argv, capsys)
    assert rc == 2, (name, err)
    assert "Traceback" not in err, err
    assert names.replace("{p}", str(tmp_path)) in err, (name, err)
    assert "Fix:" in err or "fix" in err.lower(), err
    if name in NOTHING_WRITTEN:
        assert "\n\n" not in err.strip() and not (tmp_path / "out").exists(), err
        assert not (tmp_path / "wd").exists() and "Traceback" not in err, err
    if argv[0] == "paper":  # refused before the first run: nothing trained, nothing written
        assert not (tmp_path / "paper").exists() and not list(tmp_path.rglob("metrics.jsonl"))
    if name in REFUSED_STRATEGY:
        refused = REFUSED_STRATEGY[name]
        for f in [*tmp_path.rglob("metrics.jsonl"), *tmp_path.rglob("fuse.jsonl")]:
            recs = read_jsonl(f)
            assert not any(f"acc_{refused}" in r or r.get("strategy") == refused for r in recs), (f, recs)
        for f in tmp_path.rglob("summary.md"):
            assert refused not in f.read_text(), f


def test_device_cuda_without_a_gpu(tiny_overrides, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    rc, err = cli(["run", *tiny_overrides, "device=cuda", "--out", str(tmp_path / "r"), "--quiet"], capsys)
    assert rc == 2 and "device" in err and "Traceback" not in err


def test_a_real_process_prints_no_traceback(tmp_path):
    """The same, through the installed entry point in a fresh interpreter (what a user sees)."""
    (tmp_path / "b.yaml").write_bytes(bytes(range(256)))
    r = subprocess.run([sys.executable, "-m", "flare.cli", "run", "--config", str(tmp_path / "b.yaml")],
                       capture_output=True, text=True, env=dict(os.environ, FLARE_QUIET="1"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and str(tmp_path / "b.yaml") in r.stderr


def test_a_run_that_failed_in_its_first_round_does_not_lock_its_directory(tiny_overrides, tmp_path, capsys):
    """A run that failed before its first round ended (here: a strategy scoring NaN in round 1) leaves config.yaml,
    partition.json and an empty metrics.jsonl; the corrected command, a different config, runs into the same --out."""
    out = str(tmp_path / "out")
    rc, err = cli(["run", *tiny_overrides, "rounds=1", "plugins=[flare_bad_strategies]",
                   "eval.rules=[primary,bad_nan]", "--out", out, "--quiet"], capsys)
    assert rc == 2 and (tmp_path / "out" / "config.yaml").exists(), err
    rc, err = cli(["run", *tiny_overrides, "rounds=1", "--out", out, "--quiet"], capsys)
    assert rc == 0, err
    assert "bad_nan" not in (tmp_path / "out" / "config.yaml").read_text()
    assert [r["round"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if r.get("kind") == "round"] == [0]


def test_a_run_with_a_round_still_refuses_another_experiment(tiny, tmp_path, capsys):
    d = _finished_run(tiny, tmp_path, capsys)
    rc, err = cli(["run", "--preset", "etf-anneal", *tiny, "rounds=1", "lr=0.1", "--out", d, "--quiet"], capsys)
    assert rc == 2 and "holds a different experiment (keys differ: " in err and " lr)" in err, err


@pytest.fixture
def tiny(tiny_overrides):
    return [o for o in tiny_overrides if not o.startswith("rounds=")]


@pytest.mark.parametrize("command", ["fuse", "report"])
def test_an_edited_partition_json_is_refused_and_nothing_rewritten(command, tiny, tmp_path, capsys):
    """partition.json (who ran what on which classes) is fingerprinted in state.json like config.yaml: an edited one
    is refused by every command that reads the run, and summary.md is not rewritten from it."""
    d = tmp_path / "done"
    _finished_run(tiny, tmp_path, capsys)
    part = json.loads((d / "partition.json").read_text())
    part["clients"][1]["model"] = "wrn16_1"
    (d / "partition.json").write_text(json.dumps(part, indent=1))
    before = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    argv = ["fuse", str(d), "--strategies", "output"] if command == "fuse" else ["report", str(d)]
    rc, err = cli(argv, capsys)
    assert rc == 2 and "Traceback" not in err, err
    assert f"run directory '{d}' disagrees with itself: its partition.json is not the one its run wrote" in err, err
    assert "Fix: restore partition.json" in err, err
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()} == before


def test_lr_probe_probes_the_clients_own_architecture(tiny, capsys):
    mixed = [*tiny, "model.clients={1: wrn16_1}", "model.feature_dim=8"]
    for client, name in ((1, "wrn16_1"), (0, "cnn")):
        assert main(["lr-probe", *mixed, "--client", str(client), "--iters", "2", "--batches", "1"]) == 0
        head = capsys.readouterr().out.splitlines()[0]
        assert f"client {client} (" in head and f"), {name} (width 0.25)" in head, head


def test_one_layout_from_different_checkpoints_is_one_architecture(tiny, tmp_path, capsys):
    """An architecture, for fusion rules, is the layout (name, width, options), not the init: FedAvg fuses clients
    of one layout whatever checkpoints they start from, and refuses clients of different layouts naming them. The
    finished run is then fused after its checkpoint file has moved: fuse reads the run's own uploads.pt."""
    ck = _encoder_state(tmp_path, "init.pt")
    one = ["--preset", "fedavg", *tiny, "rounds=1", f"model.clients={{0: {{name: cnn, checkpoint: {ck}}}}}"]
    rc, err = cli(["run", *one, "--out", str(tmp_path / "r"), "--quiet"], capsys)
    assert rc == 0, err
    assert "acc_fedavg" in read_jsonl(tmp_path / "r" / "metrics.jsonl")[-1]
    rc, err = cli(["run", "--preset", "fedavg", *tiny, "rounds=1", "model.clients={0: {name: cnn, width: 0.5}}",
                   "model.feature_dim=8", "--out", str(tmp_path / "m"), "--quiet"], capsys)
    assert rc == 2 and "cannot fuse clients of different architectures (1 × cnn@0.5, 2 × cnn)" in err, err
    os.rename(ck, tmp_path / "moved.pt")
    rc, err = cli(["fuse", str(tmp_path / "r"), "--strategies", "output"], capsys)
    assert rc == 0, err
    assert [f["strategy"] for f in read_jsonl(tmp_path / "r" / "fuse.jsonl")] == ["output"]
