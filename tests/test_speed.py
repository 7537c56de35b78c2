"""speed=fast chooses precision and layout by the CPU's flags and a measured probe (flare/speed.py): CPUs and probe
results that are not this machine's are injected, so the Intel-without-bf16 behaviour is tested here too."""
import json
import os
from pathlib import Path

import pytest
import torch

from flare import cpu, speed
from flare.backend import backend, machine, settle_speed
from flare.config import load_config
from flare.rundata import RunData

INTEL_NO_BF16 = speed.CpuFacts("Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz",
                               frozenset("fpu sse2 avx avx2 fma avx512f avx512bw avx512vl avx512_vnni".split()))
AMD_BF16 = speed.CpuFacts("AMD EPYC 9R14", frozenset("avx2 avx512f avx512bw avx512_bf16".split()))
AMD_AVX2 = speed.CpuFacts("AMD EPYC 7R13", frozenset("avx avx2 fma".split()))
SHAPE = (3, 32, 32)


def fake_measure(figures: dict, seen: list | None = None):
    def measure(c):
        if seen is not None:
            seen.append(c.name)
        return figures[c.name]
    return measure


def fast_cfg(*extra):
    return load_config(None, "fafi", ["speed=fast", "device=cpu", "model.name=cnn", "model.width=0.25",
                                      "batch_size=16", *extra])


def test_cpuinfo_is_read_for_model_and_flags(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8259CL\nflags\t\t: fpu avx2 avx512f "
                 "avx512bw avx512_vnni\n\nprocessor\t: 1\nmodel name\t: other\nflags\t\t: avx512_bf16\n")
    facts = speed.read_cpu(f)
    assert facts.model == "Intel(R) Xeon(R) Platinum 8259CL" and "avx512f" in facts.flags
    assert not facts.native_bf16 and "no native bf16" in facts.short
    assert speed.read_cpu(tmp_path / "missing").flags == frozenset()


def _cpuinfo(vendor, family, model, stepping, name, flags):
    return "".join(f"processor\t: {i}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\nmodel name"
                   f"\t: {name}\nstepping\t: {stepping}\nflags\t\t: {flags}\n\n" for i in range(2))


def test_family_model_and_stepping_tell_cpus_of_one_name_apart(tmp_path, monkeypatch):
    """A VM's CPU is often just "AMD EPYC": a Zen 1 and a Zen 4 differ in family and model number only, and the
    string runs record (`backend.machine`) and CPU-speed tables key on must show it."""
    texts = {"zen1": _cpuinfo("AuthenticAMD", 23, 1, 2, "AMD EPYC", "fpu avx avx2 fma"),
             "zen4": _cpuinfo("AuthenticAMD", 25, 17, 1, "AMD EPYC", "avx2 avx512f avx512bw avx512_bf16"),
             "xeon": _cpuinfo("GenuineIntel", 6, 85, 7, "Intel(R) Xeon(R) Platinum 8259CL", "avx2 avx512f avx512_vnni")}
    shorts = {}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
        shorts[name] = speed.read_cpu(tmp_path / name).short
    assert shorts == {"zen1": "AMD EPYC (family 23 model 1 stepping 2, AVX2, no native bf16)",
                      "zen4": "AMD EPYC (family 25 model 17 stepping 1, AVX512, native bf16)",
                      "xeon": "Intel(R) Xeon(R) Platinum 8259CL (family 6 model 85 stepping 7, AVX512, no native bf16)"}
    assert speed.read_cpu(tmp_path / "zen4").signature == ("25", "17", "1")
    # a cpuinfo without the three (not x86) keeps the old string: records without them stay under their old key
    (tmp_path / "arm").write_text("processor\t: 0\nmodel name\t: Neoverse\nFeatures\t: fp asimd\n")
    assert speed.read_cpu(tmp_path / "arm").short == "Neoverse (no AVX2, no native bf16)"
    monkeypatch.setattr(speed, "read_cpu", lambda path="/proc/cpuinfo": speed.CpuFacts(
        "AMD EPYC", frozenset({"avx2"}), ("23", "1", "2")))
    assert machine(torch.device("cpu")).startswith("AMD EPYC (family 23 model 1 stepping 2, AVX2, no native")
    # the reference's recorded times still find their CPU type in a record that names the family
    bench = _cpu_profile()
    assert bench.of_type(shorts["zen4"], "AMD EPYC", "AVX512, native bf16")
    assert bench.of_type("AMD EPYC (AVX512, native bf16)", "AMD EPYC", "AVX512, native bf16")
    assert not bench.of_type(shorts["xeon"], "Intel", "AVX512, native bf16")
    assert bench.of_type(shorts["xeon"], "Intel", "AVX512, no native bf16")


def _cpu_profile():
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_cpu_profile", Path(__file__).resolve().parents[1]
                                                  / "benchmarks" / "cpu_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bf16_is_a_candidate_only_where_the_cpu_has_it_natively():
    names = lambda c: [x.name for x in c]  # noqa: E731
    assert names(speed.candidates(INTEL_NO_BF16, decide_amp=True, decide_layout=True)) == [
        "exact", "fp32", "fp32 NHWC"]
    assert names(speed.candidates(AMD_BF16, decide_amp=True, decide_layout=True)) == [
        "exact", "fp32", "fp32 NHWC", "bf16", "bf16 NHWC"]
    # what the config fixes itself stays fixed: amp=off, cpu_channels_last=true
    assert names(speed.candidates(AMD_BF16, decide_amp=False, decide_layout=False, channels_last=True)) == [
        "exact", "fp32 NHWC"]


def test_the_exact_key_of_the_config_wins_over_the_cpu_flags(monkeypatch):
    """An AVX512 CPU without native bf16: torch's oneDNN says bf16 is supported (it emulates it), the flags say
    no — explicit amp=bf16 falls back to fp32 with a warning."""
    monkeypatch.setattr(cpu, "read_cpu", lambda path="/proc/cpuinfo": INTEL_NO_BF16)
    monkeypatch.setattr(cpu, "kernels", lambda: "AVX512")
    for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):  # a native process: FLARE's AVX2 pin lifted
        monkeypatch.delenv(k, raising=False)
    assert cpu.bf16_supported() is False
    monkeypatch.setattr(cpu, "read_cpu", lambda path="/proc/cpuinfo": AMD_BF16)
    assert cpu.bf16_supported() is True


def test_a_candidate_must_beat_plain_fp32_by_the_margin():
    cands = speed.candidates(AMD_BF16, decide_amp=True, decide_layout=True)
    pick, text = speed.choose(cands, {"exact": 30, "fp32": 36, "fp32 NHWC": 37, "bf16": 20, "bf16 NHWC": 37.5})
    assert pick.name == "fp32" and "nothing beat fp32 by 5%" in text and "1.20×" in text
    pick, text = speed.choose(cands, {"exact": 30, "fp32": 36, "fp32 NHWC": 50, "bf16": 20, "bf16 NHWC": 98})
    assert pick.name == "bf16 NHWC" and pick.bf16 and pick.channels_last and "3.27×" in text


def test_a_probe_where_native_fp32_is_slower_than_exact_says_so():
    cands = speed.candidates(AMD_AVX2, decide_amp=True, decide_layout=True)
    pick, text = speed.choose(cands, {"exact": 40, "fp32": 30, "fp32 NHWC": 30.5})
    assert pick.name == "fp32" and "slower than exact" in text and "speed=exact" in text


def test_intel_without_bf16_runs_fp32_at_native_kernels_and_the_summary_says_why(monkeypatch, tmp_path):
    seen = []
    cfg = fast_cfg()
    be = backend(cfg)
    settle_speed(be, cfg, SHAPE, 10, cpu_facts=INTEL_NO_BF16, cache=tmp_path / "c.json",
                 measure=fake_measure({"exact": 31.0, "fp32": 35.8, "fp32 NHWC": 36.5}, seen))
    assert seen == ["exact", "fp32", "fp32 NHWC"]   # bf16 never timed on a CPU without it
    assert be.amp_dtype is None and be.channels_last is False
    facts = be.facts(cfg)
    assert facts["amp"] == "off" and facts["speed_choice"]["chosen"] == "fp32"
    assert "nothing beat fp32" in facts["speed_choice"]["statement"]
    run = RunData.__new__(RunData)
    run.state = {"backend": facts}
    line = run.speed_choice
    assert "Xeon" in line and "no native bf16" in line and "exact 31.0" in line and "fp32 NHWC 36.5" in line


def test_a_native_bf16_cpu_whose_probe_confirms_it_runs_bf16(tmp_path):
    cfg = fast_cfg()
    be = settle_speed(backend(cfg), cfg, SHAPE, 10, cpu_facts=AMD_BF16, cache=tmp_path / "c.json", kernels_bf16=True,
                      measure=fake_measure({"exact": 30, "fp32": 36, "fp32 NHWC": 50, "bf16": 60, "bf16 NHWC": 98}))
    assert be.amp_dtype == torch.bfloat16 and be.channels_last is True


def test_figures_are_cached_per_machine_and_model(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert speed.cache_path() == tmp_path / "xdg" / "flare" / "speed-probe.json"
    figures = {"exact": 30, "fp32": 36, "fp32 NHWC": 50}
    cfg = fast_cfg()
    seen = []
    settle_speed(backend(cfg), cfg, SHAPE, 10, cpu_facts=INTEL_NO_BF16, measure=fake_measure(figures, seen))
    be = settle_speed(backend(cfg), cfg, SHAPE, 10, cpu_facts=INTEL_NO_BF16, measure=fake_measure(figures, seen))
    assert len(seen) == 3 and be.speed_choice["cached"] and be.channels_last
    stored = json.loads(speed.cache_path().read_text())
    assert len(stored) == 1 and next(iter(stored.values()))["key"]["cpu"] == INTEL_NO_BF16.model
    other = fast_cfg("model.width=0.5")  # another model: measured again
    settle_speed(backend(other), other, SHAPE, 10, cpu_facts=INTEL_NO_BF16, measure=fake_measure(figures, seen))
    assert len(seen) == 6 and len(json.loads(speed.cache_path().read_text())) == 2


def test_a_kernel_cap_the_user_exported_is_measured_again_not_read_from_the_cache(tmp_path, monkeypatch):
    # oneDNN capped below the CPU's bf16 instructions (a Cascade Lake's level on this AMD) emulates bf16: the
    # uncapped figures, where bf16 won, must not decide for it, and the emulated bf16 is not even timed
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    cfg, seen = fast_cfg(), []
    be0 = backend(cfg)
    monkeypatch.setattr(cpu, "kernels", lambda: "AVX512")  # a native process on an AVX512 CPU
    uncapped = {"exact": 30, "fp32": 36, "fp32 NHWC": 50, "bf16": 60, "bf16 NHWC": 98}
    be = settle_speed(be0, cfg, SHAPE, 10, cpu_facts=AMD_BF16, measure=fake_measure(uncapped, seen))
    assert be.amp_dtype == torch.bfloat16 and len(seen) == 5
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI")
    capped = {"exact": 30, "fp32": 36, "fp32 NHWC": 50}  # timing bf16 here would raise KeyError
    be = settle_speed(backend(cfg), cfg, SHAPE, 10, cpu_facts=AMD_BF16, measure=fake_measure(capped, seen))
    assert seen[5:] == ["exact", "fp32", "fp32 NHWC"] and not be.speed_choice["cached"]
    assert be.amp_dtype != torch.bfloat16 and be.channels_last
    assert len(json.loads(speed.cache_path().read_text())) == 2


def test_bf16_runs_natively_only_where_no_kernel_library_is_capped_below_it(monkeypatch):
    """The CPU's flags are not enough: an exported oneDNN cap below AVX512_CORE_BF16, or ATen at AVX2, makes bf16
    emulated (2.8 samples/s against fp32's 44.7 for ResNet-18 under an AVX2 cap), so it is neither timed by the
    probe nor taken for an explicit amp=bf16."""
    monkeypatch.setattr(cpu, "kernels", lambda: "AVX512")
    assert cpu.kernels_run_bf16({})
    assert cpu.kernels_run_bf16({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"})
    assert cpu.kernels_run_bf16({"ONEDNN_MAX_CPU_ISA": "avx512_core_amx"})
    for cap in ("AVX2", "avx512_core_vnni", "AVX512_CORE"):
        assert not cpu.kernels_run_bf16({"ONEDNN_MAX_CPU_ISA": cap})
    assert not cpu.kernels_run_bf16({"DNNL_MAX_CPU_ISA": "AVX2"})  # oneDNN's older name
    monkeypatch.setattr(cpu, "kernels", lambda: "AVX2")
    assert not cpu.kernels_run_bf16({})
    names = [c.name for c in speed.candidates(AMD_BF16, decide_amp=True, decide_layout=True, kernels_bf16=False)]
    assert names == ["exact", "fp32", "fp32 NHWC"]


def test_a_run_shorter_than_the_probe_is_not_probed_unless_the_cache_has_it(tmp_path):
    cfg = fast_cfg("rounds=1", "local_epochs=1")  # batch 16: the probe steps 3 candidates × 3 steps × 32 images
    seen = []
    be = settle_speed(backend(cfg), cfg, SHAPE, 10, cpu_facts=INTEL_NO_BF16, cache=tmp_path / "c.json",
                      measure=fake_measure({"exact": 30, "fp32": 36, "fp32 NHWC": 50}, seen), train_size=200)
    assert seen == [] and be.amp_dtype is None and not be.channels_last  # the floor: fp32 NCHW
    assert be.speed_choice["probe"]["skipped"] and "trains 200 images" in be.speed_choice["statement"]
    assert "would step through 288" in be.speed_choice["statement"]
    be = settle_speed(backend(cfg), cfg, SHAPE, 10, cpu_facts=INTEL_NO_BF16, cache=tmp_path / "c.json",
                      measure=fake_measure({"exact": 30, "fp32": 36, "fp32 NHWC": 50}, seen), train_size=300)
    assert len(seen) == 3 and be.channels_last  # 300 images > 288: measured, and cached
    be = settle_speed(backend(cfg), cfg, SHAPE, 10, cpu_facts=INTEL_NO_BF16, cache=tmp_path / "c.json",
                      measure=fake_measure({}, seen), train_size=200)
    assert len(seen) == 3 and be.speed_choice["cached"] and be.channels_last  # the cache costs nothing: it decides


def test_exact_and_explicit_keys_are_left_alone(tmp_path):
    boom = fake_measure({})  # any measurement would raise KeyError
    exact = load_config(None, "fafi", ["device=cpu"])
    be = settle_speed(backend(exact), exact, SHAPE, 10, cpu_facts=AMD_BF16, measure=boom, cache=tmp_path / "c")
    assert be.speed_choice is None and be.amp_dtype is None and not be.channels_last
    fixed = fast_cfg("amp=bf16", "cpu_channels_last=false")
    be = settle_speed(backend(fixed), fixed, SHAPE, 10, cpu_facts=AMD_BF16, measure=boom, cache=tmp_path / "c")
    assert be.speed_choice is None


def test_the_probe_really_measures_a_step():
    from flare.models import create_model
    torch.manual_seed(0)
    model = create_model("cnn", 3, 10, 0.25, head="prototype")
    rate = speed.step_rate(model, 8, SHAPE, 10, bf16=False, channels_last=True, steps=1)
    assert rate > 0 and next(model.parameters()).grad is not None


@pytest.mark.slow
def test_the_exact_profile_is_measured_in_its_own_process():
    cfg = fast_cfg()
    spec = speed.ProbeSpec(cfg.model_dump(mode="json"), SHAPE, 10, 8, 1)
    assert speed.measure_in_child(spec, "avx2") > 0


@pytest.mark.slow
def test_a_benchmark_measures_another_configuration_in_its_own_process():
    """benchmarks/cpu_profile.py times each profile's bare step (its kernels, precision and layout) this way."""
    cfg = fast_cfg()
    spec = speed.ProbeSpec(cfg.model_dump(mode="json"), SHAPE, 10, 8, 1)
    env = {k: v for k, v in os.environ.items() if k not in (*cpu._ENV, cpu._MARK)}
    assert speed.measure_in_child(spec, "native", speed.Candidate(False, True), env) > 0


def test_a_fast_run_records_its_choice_in_state_and_summary(tiny_overrides, tmp_path):
    from flare.cli import main
    out = tmp_path / "r"
    tiny = [o for o in tiny_overrides if not o.startswith("rounds=")]
    # 96 training images × 6 epochs: more than the probe steps through (≤ 5 candidates × 3 steps × 32), so it probes
    assert main(["run", "--preset", "fafi", *tiny, "rounds=1", "local_epochs=6", "speed=fast", "--out", str(out),
                 "--quiet"]) == 0
    choice = json.loads((out / "state.json").read_text())["backend"]["speed_choice"]
    assert set(choice["samples_per_s"]) >= {"exact", "fp32", "fp32 NHWC"} and choice["probe"]["images_per_step"] == 32
    assert all(v > 0 for v in choice["samples_per_s"].values())
    assert "speed=fast's choice: speed=fast runs" in (out / "summary.md").read_text()
