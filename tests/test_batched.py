"""client_engine=batched: all clients of a round as one vmapped program, held to the sequential engine's numbers.

Tolerances (CPU, float32; docs/performance.md): the two engines compute the same math in another summation order
(grouped convolutions, batched reductions), so they agree to float rounding — about 1e-7 relative after one round.
Over a run, float noise can flip a ReLU or max-pool near a tie; the sequential engine itself then moves by up to
3e-4 relative in a loss when only its thread count changes (measured on the tiny fixture). The run-level test
therefore allows rel 1e-3 on losses and diagnostics and one test image on accuracies; the state-level test allows
rel 1e-5 on every parameter, buffer, momentum buffer and σ after two rounds.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flare.client.batched import BatchedClients
from flare.client.trainer import Client
from flare.config import load_config
from flare.errors import FlareError, TrainingDiverged
from flare.rundir import read_jsonl
from flare.runner import Run
from flare.setup import RunSetup

_NATIVE_CHILD = "FLARE_TEST_AT_NATIVE_KERNELS"  # set in the process test_compile_wraps_the_batched_step starts


def _no_timing(recs):
    return [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in recs]


def _close(a, b, rel):
    return abs(a - b) <= rel * max(abs(a), abs(b)) + 1e-7


def _tensor_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / a.double().abs().max().clamp(min=1e-12))


@pytest.mark.parametrize("preset", ["flare", "fedavg"])
def test_state_after_two_rounds_matches_sequential(preset, tiny_overrides):
    """Ragged clients (34/30/32 samples, batch 16: groups of different batch sizes, clients in different epochs at
    the same step), two local epochs, momentum kept across rounds, weight decay, a cosine lr: every parameter,
    BatchNorm buffer, momentum buffer and σ of every client, and every logged loss, match sequential training."""
    ov = tiny_overrides + ["local_epochs=2", "optim.reset_each_round=false", "optim.weight_decay=0.0005",
                           "lr_schedule.kind=cosine"]
    setup = RunSetup.build(load_config(None, preset, ov))
    seq = setup.make_clients(print, lambda m: None)
    bat = setup.make_clients(print, lambda m: None)
    sizes = [c.num_samples for c in seq]
    assert len(set(s % 16 for s in sizes)) > 1 and len(set(-(-s // 16) for s in sizes)) > 1  # really ragged
    engine = BatchedClients(bat, setup.ctx)
    for r in range(2):
        want = [c.train_round(setup.ctx, r) for c in seq]
        got = engine.train_round(r)
        for w, g in zip(want, got):
            assert w.keys() == g.keys()
            for k, v in w.items():
                if k == "seconds":
                    continue
                assert _close(v, g[k], 1e-5) if isinstance(v, float) else v == g[k], (r, w["client"], k, v, g[k])
    assert engine.calls > 2 * max(sizes) // 16
    for a, b in zip(seq, bat):
        sa, sb = a.state_dict(), b.state_dict()
        for k, v in sa["model"].items():
            assert (_tensor_rel(v, sb["model"][k]) < 1e-5) if v.is_floating_point() else torch.equal(v, sb["model"][k]), k
        ma, mb = sa["optimizer"]["state"], sb["optimizer"]["state"]
        assert ma.keys() == mb.keys() and len(ma) == len(list(a.model.parameters()))
        for i in ma:
            assert _tensor_rel(ma[i]["momentum_buffer"], mb[i]["momentum_buffer"]) < 1e-5, i
        assert sa["optimizer"]["param_groups"][0]["lr"] == sb["optimizer"]["param_groups"][0]["lr"]
        assert sa["epochs_done"] == sb["epochs_done"] == 4
        for k in ("s_l", "s_a"):
            if k in sa["lam"]:
                assert _close(float(sa["lam"][k]), float(sb["lam"][k]), 1e-5), k


@pytest.mark.parametrize("preset, extra", [("fafi", []), ("fedavg", []), ("etf-anneal", []), ("flare", []),
                                           ("etf-anneal", ["augment.input_scaling=reference",
                                                           "augment.per_image=false"]),
                                           ("uw", []), ("uw-rescaled", []), ("decoupled", ["progress=step"]),
                                           ("etf-anneal", ["progress=round-reset"]),
                                           ("fedavg", ["loss.ce_input=plain"]), ("fafi", ["drop_last=true"]),
                                           ("server-protos", ["server.protos_flow=reference",
                                                              "server.server_epochs=2"])])
def test_runs_give_the_sequential_metrics(preset, extra, tiny_overrides, tmp_path, monkeypatch):
    """Two-round runs of Table 1's methods: metrics.jsonl of both engines agree (tolerances: module docstring),
    and the batched engine really ran (no client trained through `Client.train_round`)."""
    real = Client.train_round
    calls = {"n": 0}

    def spy(self, *a, **k):
        calls["n"] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(Client, "train_round", spy)
    recs = {}
    for engine in ("sequential", "batched"):
        calls["n"] = 0
        run = Run(load_config(None, preset, tiny_overrides + extra + [f"client_engine={engine}"]), tmp_path / engine,
                  quiet=True)
        run.execute()
        assert calls["n"] == (6 if engine == "sequential" else 0)
        recs[engine] = _no_timing(read_jsonl(tmp_path / engine / "metrics.jsonl"))
    assert len(recs["sequential"]) == len(recs["batched"]) == 8
    for a, b in zip(recs["sequential"], recs["batched"]):
        assert a.keys() == b.keys()
        for k, v in a.items():
            if k.startswith("acc"):
                assert abs(v - b[k]) <= 1 / 32 + 1e-9, (k, v, b[k])  # one image of the 32-image test set
            elif isinstance(v, float):
                assert _close(v, b[k], 1e-3), (a["kind"], a["round"], a.get("client"), k, v, b[k])
            else:
                assert v == b[k], k


@pytest.mark.parametrize("override, key", [
    ("align.surgery=pcgrad", "align.surgery"),
    ("loss.contrast=memory-bank", "loss.contrast"),
    ("align.target=progressive", "align.target"),
])
def test_unsupported_settings_fail_at_validation(override, key, tmp_path):
    """Before any data is read (the dataset root does not exist), naming the key and the way out."""
    ov = ["client_engine=batched", f"dataset.root={tmp_path / 'nowhere'}", "align.anchors=etf", override]
    with pytest.raises(FlareError) as e:
        load_config(None, "fafi", ov)
    msg = e.value.render()
    assert e.value.key == key and key in msg and "client_engine=sequential" in msg, msg
    load_config(None, "fafi", [o for o in ov if o != "client_engine=batched"])  # fine with the sequential engine


@pytest.mark.parametrize("old, new", [("true", "threads"), ("false", "sequential")])
def test_concurrent_clients_was_renamed(old, new):
    with pytest.raises(FlareError) as e:
        load_config(None, "fafi", [f"concurrent_clients={old}"])
    assert e.value.key == "concurrent_clients" and f"client_engine={new}" in e.value.render()


def test_interrupted_batched_run_resumes_to_the_uninterrupted_metrics(tiny_overrides, tmp_path, monkeypatch):
    """Mirrors test_resume.py's torn-line test: the checkpoint holds per-client `Client.state_dict()`s (momentum
    and σ kept across rounds), and resuming gives exactly the metrics of the same run uninterrupted."""
    ov = tiny_overrides + ["rounds=3", "optim.reset_each_round=false", "client_engine=batched"]
    cfg = load_config(None, "flare", ov)
    d = tmp_path / "run"
    real = BatchedClients.train_round

    def interrupted(self, round_idx, on_step=None):
        if round_idx == 2:
            raise KeyboardInterrupt
        return real(self, round_idx, on_step)

    monkeypatch.setattr(BatchedClients, "train_round", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Run(cfg, d, quiet=True).execute()
    monkeypatch.setattr(BatchedClients, "train_round", real)
    assert json.loads((d / "state.json").read_text())["rounds_done"] == 2
    ck = torch.load(d / "checkpoint.pt", weights_only=True)
    assert len(ck["clients"]) == 3 and "s_a" in ck["clients"][0]["lam"]
    assert ck["clients"][0]["optimizer"]["state"] and ck["clients"][0]["epochs_done"] == 2
    kept = (d / "metrics.jsonl").read_text()
    Run(cfg, d, quiet=True).execute()
    assert (d / "metrics.jsonl").read_text().startswith(kept)
    ref = tmp_path / "ref"
    Run(cfg, ref, quiet=True).execute()
    assert _no_timing(read_jsonl(d / "metrics.jsonl")) == _no_timing(read_jsonl(ref / "metrics.jsonl"))


def test_nan_is_reported_as_the_sequential_engine_reports_it(tiny_overrides, tmp_path, monkeypatch):
    """The same poisoned term (SupCon from round index 1 on) stops both engines with the same message: the
    client, round, term and epoch step where it went non-finite; earlier rounds stay in metrics.jsonl."""
    import flare.client.step as step  # both engines build their loss there (local_loss)

    state = {"round": 0}
    messages = {}
    for engine, mod, cls in (("sequential", step, Client), ("batched", step, BatchedClients)):
        real_terms, real_round = mod.base_terms, cls.train_round

        def poisoned(*a, _real=real_terms, **k):
            t = _real(*a, **k)
            if state["round"] == 1:
                t["loss_con"] = t["loss_con"] * float("nan")
            return t

        def train_round(self, *a, _real=real_round, **k):
            state["round"] = a[1] if cls is Client else a[0]
            return _real(self, *a, **k)

        monkeypatch.setattr(mod, "base_terms", poisoned)
        monkeypatch.setattr(cls, "train_round", train_round)
        out = tmp_path / engine
        with pytest.raises(TrainingDiverged) as e:
            Run(load_config(None, "fafi", tiny_overrides + [f"client_engine={engine}"]), out, quiet=True).execute()
        messages[engine] = e.value.render()
        assert {r["round"] for r in read_jsonl(out / "metrics.jsonl")} == {0}
        monkeypatch.undo()
    assert "loss_con" in messages["batched"] and "client 0" in messages["batched"]
    assert messages["batched"] == messages["sequential"]


@pytest.mark.long
def test_compile_wraps_the_batched_step(tiny_overrides, tmp_path, monkeypatch):
    """compile=true compiles the batched step and update (not the client models), and the numbers stay those of
    the eager batched engine to float rounding. compile on CPU is refused under kernels pinned below the CPU's own
    (flare.backend), and the tests' process is pinned (conftest), so on such a CPU this test runs itself again in a
    process at native kernels. One shape throughout (iid, drop_last: every client the same steps of the same batch)
    compiles the step once: about 80 s of inductor with a cold cache on 2 busy cores, seconds with a warm one."""
    from flare import cpu
    if cpu.is_x86() and cpu.kernels() != cpu.native_level():
        assert not os.environ.get(_NATIVE_CHILD), f"a process started at native kernels runs at {cpu.kernels()}"
        env = {k: v for k, v in os.environ.items() if k not in ("FLARE_CPU_ISA_PINNED", "ATEN_CPU_CAPABILITY",
                                                                 "ONEDNN_MAX_CPU_ISA")}
        env.update(FLARE_CPU_ISA="native", **{_NATIVE_CHILD: "1"})
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            f"{__file__}::test_compile_wraps_the_batched_step"],
                           env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=400)
        assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
        return
    compiled = []
    real = torch.compile

    def spy(fn, *a, **k):
        compiled.append(getattr(fn, "__name__", type(fn).__name__))
        return real(fn, *a, **k)

    monkeypatch.setattr(torch, "compile", spy)
    last = {}
    for mode in ("false", "true"):
        run = Run(load_config(None, "flare", tiny_overrides + ["rounds=1", "client_engine=batched", "cpu_isa=native",
                                                               "partition.kind=iid", "drop_last=true",
                                                               f"compile={mode}"]), tmp_path / mode, quiet=True)
        run.execute()
        last[mode] = _no_timing(read_jsonl(tmp_path / mode / "metrics.jsonl"))
    assert len(compiled) == 2 and "_sgd_update" in compiled  # the vmapped step and the update, only when asked
    assert [r["kind"] for r in last["true"]] == [r["kind"] for r in last["false"]]
    for a, b in zip(last["false"], last["true"]):
        for k, v in a.items():
            if isinstance(v, float):
                assert _close(v, b[k], 1e-4), k


def test_a_compiled_step_without_alignment_keeps_its_gradient():
    """FedAvg's step has one term and no alignment, so its total is that term. Summed as `0 + ce` and returned
    beside `ce.detach()` in the logs, inductor (torch 2.14) gave the total back without a gradient, and the batched
    engine's compiled step stopped at backward for FedAvg and FAFI; `local_loss` and `StepLoss.total` add only the
    terms that exist. A one-matrix graph: it compiles in seconds."""
    from flare.client.lam import LamStep
    from flare.client.step import local_loss

    cfg = load_config(None, "fedavg", [])

    def step(w, x, y):
        logits = x @ w
        loss = local_loss(cfg, logits, logits, y, None, target=None, weigh=lambda base, align: LamStep(base, None))
        return loss.total(), loss.logs()

    w = torch.nn.Parameter(torch.ones(4, 3))
    total, logs = torch.compile(step)(w, torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))
    assert total.requires_grad and not logs["base_loss"].requires_grad
    total.backward()
    assert w.grad is not None


def test_cuda_batch_norm_wrapper_computes_batch_norm_under_vmap():
    """The float32-native BatchNorm the engine installs on CUDA is BatchNorm: under vmap over stacked clients it
    gives each client's own output and running statistics, and returns the input's dtype (checked on CPU, where
    only the CUDA-specific switches differ)."""
    from torch.func import functional_call, stack_module_state

    from flare.client.batched import _batch_norm_fp32_native

    torch.manual_seed(0)
    bns = [torch.nn.BatchNorm2d(3) for _ in range(2)]
    with torch.no_grad():
        for bn in bns:
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 8, 3, 4, 4) * 3 + 1
    template = torch.nn.BatchNorm2d(3)
    template.forward = lambda inp: _batch_norm_fp32_native(template, inp)
    params, buffers = stack_module_state(bns)
    out = torch.vmap(lambda p, b, xi: functional_call(template, (p, b), (xi,)))(params, buffers, x)
    for i, bn in enumerate([torch.nn.BatchNorm2d(3) for _ in range(2)]):
        bn.load_state_dict({**{n: v[i] for n, v in params.items()}, "running_mean": torch.zeros(3),
                            "running_var": torch.ones(3), "num_batches_tracked": torch.tensor(0)})
        torch.testing.assert_close(out[i], bn(x[i]))
        torch.testing.assert_close(buffers["running_mean"][i], bn.running_mean)
    assert _batch_norm_fp32_native(bns[0], x[0].bfloat16()).dtype == torch.bfloat16
