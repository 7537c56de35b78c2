"""CPU kernels pinned by default (flare/cpu.py), and the fast profile (`speed=fast`) that a user picks."""
import json
import os
import subprocess
import sys

import pytest
import torch

from flare import cpu
from flare.config import load_config
from flare.rundata import RunData
from flare.server.rounds import rules_for
from flare.backend import backend

CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in (*cpu._ENV, cpu._MARK)}
x86_avx2 = pytest.mark.skipif(not cpu.is_x86() or "avx2" not in open("/proc/cpuinfo").read(),
                              reason="needs an x86-64 CPU with AVX2")


def _flare_run(tiny, out, *extra, env=None):
    r = subprocess.run([sys.executable, "-m", "flare.cli", "run", *tiny, "rounds=2", "--out", str(out), "--quiet",
                        *extra], capture_output=True, text=True, env={**CLEAN_ENV, "FLARE_QUIET": "1", **(env or {})})
    assert r.returncode == 0, r.stderr
    return [{k: v for k, v in json.loads(ln).items() if not k.startswith("seconds")}
            for ln in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.long
@x86_avx2
def test_default_pins_avx2_and_forcing_it_by_hand_gives_the_same_digits(tiny_overrides, tmp_path):
    by_default = _flare_run(tiny_overrides, tmp_path / "a")
    forced = _flare_run(tiny_overrides, tmp_path / "b",
                        env={"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2,STRICT",
                             "MKL_ENABLE_INSTRUCTIONS": "AVX2"})
    assert by_default == forced
    st = json.loads((tmp_path / "a" / "state.json").read_text())
    assert st["backend"]["cpu_isa"] == "avx2" and st["backend"]["cpu_kernels"] == "AVX2"
    assert st["backend"]["mkl"] == ("AVX2,STRICT" if torch.backends.mkl.is_available() else "no MKL")
    assert st["warnings"] == []
    assert "AVX2 CPU kernels" in (tmp_path / "a" / "summary.md").read_text()
    if torch.backends.mkl.is_available():
        assert "(MKL: AVX2,STRICT)" in (tmp_path / "a" / "summary.md").read_text()


_ADDMM_BITS = ("import hashlib, torch; torch.manual_seed(0); torch.set_num_threads(1); "
               "a, b, c = torch.randn(64, 300), torch.randn(300, 257), torch.randn(64, 257); "
               "print(hashlib.md5(torch.addmm(c, a, b).numpy().tobytes()).hexdigest())")


@x86_avx2
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch build has no MKL")
def test_the_pin_reaches_mkl_and_is_read_back_after_the_first_call():
    """A linear layer's digits follow MKL's branch: pinned, they are those of an environment that names the branch
    by hand, and the run's check reads the branch MKL took."""
    def child(code, env):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**CLEAN_ENV, **env})
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    pinned, mode = child("import flare; " + _ADDMM_BITS + "; from flare import cpu; print(cpu.mkl_mode())",
                         {"FLARE_CPU_ISA": "avx2"}).splitlines()
    by_hand = child(_ADDMM_BITS, {"MKL_CBWR": "AVX2,STRICT", "MKL_ENABLE_INSTRUCTIONS": "AVX2"})
    assert pinned == by_hand and mode == "AVX2,STRICT"
    assert child("import flare; from flare import cpu; print(cpu.mkl_mode())", {"FLARE_CPU_ISA": "native"}) == "unpinned"
    # a matrix product before the pin leaves MKL on its automatic branch: the check says so
    late = child("import torch; torch.addmm(torch.ones(2, 2), torch.ones(2, 2), torch.ones(2, 2)); import os; "
                 "os.environ['FLARE_CPU_ISA_PINNED'] = 'x'; from flare import cpu; cpu.pin('avx2'); "
                 "print(cpu.check('avx2')[1])", {"FLARE_CPU_ISA": "native", "ATEN_CPU_CAPABILITY": "avx2",
                                                 "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert "asked MKL for its AVX2,STRICT branch, but MKL runs unpinned" in late


@x86_avx2
def test_native_is_what_the_cpu_gives(tiny_overrides, tmp_path):
    _flare_run(tiny_overrides, tmp_path / "n", "cpu_isa=native")
    st = json.loads((tmp_path / "n" / "state.json").read_text())
    native = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                            capture_output=True, text=True, env=CLEAN_ENV).stdout.strip()
    assert st["backend"]["cpu_kernels"] == native and st["warnings"] == []


def test_early_level_reads_the_command_line_before_torch(tmp_path):
    assert cpu.early_level([], env={}) == "avx2"
    assert cpu.early_level([], env={"FLARE_CPU_ISA": "native"}) == "native"
    assert cpu.early_level(["rounds=3", "cpu_isa=avx512"], env={}) == "avx512"
    assert cpu.early_level(["speed=fast"], env={}) == "native"
    assert cpu.early_level(["speed=fast", "cpu_isa=avx2"], env={}) == "avx2"
    (tmp_path / "c.yaml").write_text("cpu_isa: default\n")
    assert cpu.early_level(["--config", str(tmp_path / "c.yaml")], env={}) == "default"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("speed: fast\n")
    assert cpu.early_level(["--resume", str(tmp_path / "run")], env={}) == "native"
    assert cpu.early_level(["--config", str(tmp_path / "missing.yaml")], env={}) == "avx2"


def test_pin_sets_every_library_and_native_undoes_only_its_own(monkeypatch):
    for k in (*cpu._ENV, cpu._MARK):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(cpu, "is_x86", lambda: True)
    cpu.pin("avx512")
    assert [os.environ[k] for k in cpu._ENV] == ["avx512", "AVX512_CORE", "AVX512,STRICT", "AVX512"]
    cpu.pin("avx2")
    assert [os.environ[k] for k in cpu._ENV] == ["avx2", "AVX2", "AVX2,STRICT", "AVX2"]
    cpu.pin("native")
    assert not any(k in os.environ for k in cpu._ENV) and os.environ[cpu._MARK] == "native"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # the user's own: native leaves it
    cpu.pin("native")
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    with pytest.raises(ValueError):
        cpu.pin("avx9000")


def test_a_cap_the_user_exported_survives_the_default_pin_and_comes_back_under_native(monkeypatch):
    # importing FLARE pins the default before the command line says `native`: the user's oneDNN cap (a Cascade
    # Lake's level, say) must be what native runs under, not the CPU's best
    for k in (*cpu._ENV, cpu._MARK):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(cpu, "is_x86", lambda: True)
    monkeypatch.setenv(cpu._USER, "{}")  # a parent FLARE process (a benchmark) recorded its own, empty, environment
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI")
    cpu.pin("avx2")  # what `import flare` does
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"  # exact is exact whatever the user exported
    cpu.pin("native")  # what the CLI then does for speed=fast
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_VNNI"
    assert not any(k in os.environ for k in cpu._ENV if k != "ONEDNN_MAX_CPU_ISA")
    mine = cpu.user_environment()  # what a benchmark hands its profiles: the user's cap, none of FLARE's pins
    assert mine["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_VNNI" and cpu._MARK not in mine and "MKL_CBWR" not in mine
    child = dict(os.environ)  # a child process inherits the record, and re-pinning there changes nothing
    cpu.pin("avx2"), cpu.pin("native")
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_VNNI" and child[cpu._USER] == os.environ[cpu._USER]


def test_a_level_that_cannot_apply_in_this_process_is_a_warning_not_silence():
    got = torch.backends.cpu.get_cpu_capability()  # fixed for this process already
    other = "avx512" if got != "AVX512" else "avx2"
    kernels, warning = cpu.check(other)
    assert kernels == got and warning and f"cpu_isa={other}" in warning and got in warning
    assert cpu.check("native") == (got, None)


def test_bf16_on_a_cpu_without_it_falls_back_to_fp32_with_a_warning(monkeypatch):
    cfg = load_config(None, "fafi", ["amp=bf16", "device=cpu"])
    monkeypatch.setattr(cpu, "bf16_supported", lambda: False)
    be = backend(cfg)
    assert be.amp_dtype is None and any("amp=bf16" in w and "fp32" in w for w in be.warnings)
    assert be.facts(cfg)["amp"] == "off"
    monkeypatch.setattr(cpu, "bf16_supported", lambda: True)
    assert backend(cfg).amp_dtype == torch.bfloat16


def test_bf16_is_never_native_under_avx2_kernels(monkeypatch):
    monkeypatch.setattr(cpu, "kernels", lambda: "AVX2")
    assert cpu.bf16_supported() is False


def test_fast_profile_fills_its_items_and_an_explicit_key_wins():
    fast = load_config(None, "fafi", ["speed=fast"])
    assert (fast.cpu_isa, fast.amp, fast.cpu_channels_last, fast.eval.every, fast.eval.rules) == (
        "native", "auto", "auto", 5, ["primary"])  # precision and layout: the probe's (tests/test_speed.py)
    assert rules_for(fast) == ("feature",)
    mine = load_config(None, "fafi", ["speed=fast", "eval.every=1", "cpu_isa=avx2", "eval.rules=[feature,iffi]",
                                      "amp=bf16", "cpu_channels_last=false"])
    assert (mine.eval.every, mine.cpu_isa, mine.amp, mine.cpu_channels_last) == (1, "avx2", "bf16", False)
    assert rules_for(mine) == ("feature", "iffi")
    exact = load_config(None, "fafi", [])
    assert (exact.speed, exact.cpu_isa, exact.amp, exact.cpu_channels_last, exact.eval.every) == (
        "exact", "avx2", "auto", False, 1)
    assert rules_for(load_config(None, "fedavg", ["eval.rules=[primary]"])) == ("fedavg",)


def test_eval_every_skips_rounds_and_reports_read_the_evaluated_ones(tiny_overrides, tmp_path):
    from flare.cli import main
    out = tmp_path / "r"
    tiny = [o for o in tiny_overrides if not o.startswith("rounds=")]
    assert main(["run", "--preset", "fafi", *tiny, "rounds=3", "eval.every=2", "eval.rules=[feature]",
                 "cpu_channels_last=true", "--out", str(out), "--quiet"]) == 0
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in recs if r["kind"] == "round"]
    assert [r.get("evaluated", True) for r in rounds] == [False, True, True]   # round 2, and the last
    assert "acc_feature" not in rounds[0] and "acc_iffi" not in rounds[1] and "acc_feature" in rounds[2]
    assert len([r for r in recs if r["kind"] == "client"]) == 9                 # every round still trains
    run = RunData.load(out)
    assert run.round_numbers() == [2, 3] and run.peak("acc")[1] in (2, 3)
    summary = (out / "summary.md").read_text()
    assert "rounds done: 3" in summary and "evaluated every 2 round(s)" in summary and "channels_last=True" in summary


def test_compile_on_cpu_under_a_pinned_lower_level_is_refused():
    if not cpu.is_x86() or cpu.kernels() == cpu.native_level():
        pytest.skip("this process runs at the CPU's own level")
    from flare.errors import FlareError
    with pytest.raises(FlareError, match="cpu_isa=native") as e:
        backend(load_config(None, "fafi", ["compile=true", "device=cpu"]))
    assert e.value.key == "compile"
