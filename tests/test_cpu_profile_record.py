"""The `cpu-profile` block of docs/performance.md: rendered by benchmarks/cpu_profile.py's own `markdown` from the
JSON record the benchmark wrote (committed under results/cpu-profile/), naming the CPU and the load it ran under."""
import importlib.util
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


tool = _load("readme_tool", ROOT / "tools" / "readme.py")
RECORD = "readme/cpu-profile-record.json"  # relative to runs/, as in results/cpu-profile/


def test_the_block_is_what_the_record_renders_to():
    block = tool.RESULTS["cpu-profile"]
    base = tool.records_of(block)
    rec = json.loads((base / RECORD).read_text())
    body = tool.blocks((ROOT / block.page).read_text())["cpu-profile"][1]
    assert body == tool.render_block(block, base, copy_figures=False)
    # the machine is named and the load stated, from the record
    assert rec["machine"]["cpu_model"] in body and rec["machine"]["torch"] in body
    assert f"{rec['load_average']['before'][0]:.2f}" in body
    # every profile the benchmark ran is a row, with its measured training throughput
    for row in rec["rows"]:
        assert f"| {row['profile']} | `{row['settings']}` |" in body
        assert f"{row['train_rate']:.1f}" in body


def test_an_edited_record_changes_the_block(tmp_path):
    block = tool.RESULTS["cpu-profile"]
    base = shutil.copytree(tool.records_of(block), tmp_path / "cpu-profile")
    body = tool.render_block(block, base, copy_figures=False)
    rec = json.loads((base / RECORD).read_text())
    rec["rows"][0]["train_rate"] *= 2
    (base / RECORD).write_text(json.dumps(rec))
    assert tool.render_block(block, base, copy_figures=False) != body


def test_the_record_is_copied_with_the_runs():
    paths = tool.record_paths(tool.RESULTS["cpu-profile"])
    assert RECORD in paths and "readme/cpu-profile" in paths


def test_an_avx2_only_record_says_so_and_drops_the_reference_column():
    """`--avx2-only` caps every kernel library at AVX2 in every profile; its record's CPU line says so, and the
    reference's AMD EPYC time (measured uncapped) is not shown beside it, as under the oneDNN cap."""
    bench = _load("cpu_profile_bench", ROOT / "benchmarks" / "cpu_profile.py")
    rec = json.loads((tool.records_of(tool.RESULTS["cpu-speed"]) / "readme/cpu-speed-record.json").read_text())
    assert rec["reference_setting"] and "over the reference" in bench.markdown(rec)
    capped = {**rec, "caps": dict(bench.AVX2_ONLY)}
    text = bench.markdown(capped)
    assert "ATen, oneDNN and MKL capped at AVX2 (an AVX2-only CPU" in text and "over the reference" not in text
    assert "timed the emulated bf16" in text  # this record's probe timed bf16 (it ran uncapped)
    no_bf16 = {**capped, "choice": {**rec["choice"], "samples_per_s": {"exact": 1.0, "fp32": 1.0}}}
    assert "no candidate" in bench.markdown(no_bf16)
    old = {**rec, "onednn_isa": "AVX512_CORE_VNNI"}  # a record written before `caps` existed
    assert "oneDNN capped at AVX512_CORE_VNNI" in bench.markdown(old)
    args = bench.argparse.Namespace(avx2_only=True, onednn_isa=None)
    assert bench.caps(args) == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                                "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    try:
        bench.main(["--data-root", "x", "--avx2-only", "--onednn-isa", "AVX2"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("--avx2-only with --onednn-isa must be refused")


def test_each_profile_is_set_against_its_bare_step_at_the_runs_own_size():
    """The bare-step column: the profile's own configuration at 2 × batch images, beside the probe's 256-image
    figure; a record made before the column existed shows a dash, never another figure."""
    bench = _load("cpu_profile_bench", ROOT / "benchmarks" / "cpu_profile.py")
    rec = json.loads((tool.records_of(tool.RESULTS["cpu-speed"]) / "readme/cpu-speed-record.json").read_text())
    rows = [{**r, "bare_step": {"images": 1024, "steps": 2, "samples_per_s": r["train_rate"] * 1.25}}
            for r in rec["rows"]]
    text = bench.markdown({**rec, "rows": rows})
    assert "bare step, 1,024 images (samples/s) | train ÷ bare step |" in text
    for r in rows:
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| {r['profile']} |"))
        assert f"| {r['train_rate'] * 1.25:.1f} | 0.80 |" in line
    old = bench.markdown({**rec, "rows": [{k: v for k, v in r.items() if k != "bare_step"} for r in rec["rows"]]})
    assert "the run's images (samples/s)" in old
    assert all("| — | — |" in ln for ln in old.splitlines() if ln.startswith(("| exact | `", "| fast | `")))


def test_the_targets_sentence_is_computed_from_the_record():
    """Below the tables, one sentence sets the fast profile against the speed targets from the record's own figures:
    the prose around a block cites no figure of its own. A capped record has no reference to be set against."""
    bench = _load("cpu_profile_bench", ROOT / "benchmarks" / "cpu_profile.py")
    rec = json.loads((tool.records_of(tool.RESULTS["cpu-speed"]) / "readme/cpu-speed-record.json").read_text())
    by = {r["profile"]: r for r in rec["rows"]}
    text = bench.markdown(rec)
    assert f"speed=fast ran {by['exact']['wall'] / by['fast']['wall']:.2f}× exact's wall time" in text
    old = {**rec, "rows": [{k: v for k, v in r.items() if k != "bare_step"} for r in rec["rows"]]}
    assert "bare step at the run's step size is not in this record" in bench.markdown(old)  # made before the column
    assert f"{453.5 / by['fast']['wall']:.2f}× the reference's wall time" in text  # its AMD EPYC time
    rows = [{**r, "bare_step": {"images": 1024, "steps": 2, "samples_per_s": r["train_rate"] / 0.9}}
            for r in rec["rows"]]
    assert "its training at 0.90 of its own bare step" in bench.markdown({**rec, "rows": rows})
    no_bf16 = {**rec, "machine": {**rec["machine"], "flags": ["avx2", "avx512f"]}}
    assert "(target: above 1×)" in bench.markdown(no_bf16) and "1.5×" not in bench.markdown(no_bf16)
    capped = bench.markdown({**rec, "caps": dict(bench.AVX2_ONLY)})
    assert "Against the targets" in capped and "the reference's wall time" not in capped


def test_the_reference_is_shown_only_beside_the_cpu_type_it_was_timed_on():
    """The reference's wall time is a figure of one CPU type: an AVX2-only EPYC gets the time reference_fafi.py
    recorded on one (results/reference-fafi/), an Intel Xeon without native bf16 the time measured there, never the
    AMD one, and a CPU type it was never timed on no column and a sentence saying so."""
    bench = _load("cpu_profile_bench", ROOT / "benchmarks" / "cpu_profile.py")
    rec = json.loads((tool.records_of(tool.RESULTS["cpu-speed"]) / "readme/cpu-speed-record.json").read_text())
    cpu = rec["machine"]["cpu"]  # the record names the family, model number and stepping before the ISA text
    assert bench.of_type(cpu, "AMD EPYC", "AVX512, native bf16") and "(family " in cpu
    assert bench.reference(rec)[1] == 453.5
    fast = next(r for r in rec["rows"] if r["profile"] == "fast")
    zen3 = {**rec, "machine": {**rec["machine"], "cpu": "AMD EPYC (AVX2, no native bf16)", "flags": ["avx2"]}}
    timed = json.loads((bench.REFERENCE_RECORDS / "amd-epyc-avx2.json").read_text())
    assert timed["machine"]["cpu"] == zen3["machine"]["cpu"] and timed["commit"].startswith("26cf90e")
    own = f"AMD EPYC, AVX2, no native bf16, timed {timed['date']}"
    assert bench.reference(zen3) == (own, timed["wall"])
    text = bench.markdown(zen3)
    assert f"over the reference ({timed['wall']} s, {own}) |" in text and "never timed" not in text
    assert f"{timed['wall'] / fast['wall']:.2f}× the reference's wall time (target: above 1×)" in text
    other = {**rec, "machine": {**rec["machine"], "cpu": "AMD EPYC (AVX512, no native bf16)", "flags": ["avx512f"]}}
    text = bench.markdown(other)
    assert bench.reference(other) is None and "over the reference" not in text
    assert "never timed on this CPU type (AMD EPYC (AVX512, no native bf16))" in text
    xeon = {**rec, "machine": {**rec["machine"], "cpu": "Intel(R) Xeon(R) Platinum 8259CL CPU @ 2.50GHz (AVX512, no "
                               "native bf16)", "flags": ["avx2", "avx512f", "avx512bw", "avx512_vnni"]}}
    text = bench.markdown(xeon)
    assert "over the reference (334.0 s, Intel, AVX512, no native bf16) |" in text
    assert f"{334.0 / fast['wall']:.2f}× the reference's wall time (target: above 1×)" in text
    small = {**rec, "reference_setting": False}
    assert bench.reference(small) is None and "never timed" not in bench.markdown(small)


def test_the_cpu_types_against_the_reference_come_from_the_records(monkeypatch, tmp_path):
    """docs/performance.md's summary: a row per uncapped reference-setting record, its ratios computed from that
    record and the reference's time on its CPU type; a CPU type the reference was timed on where FLARE has no such
    record (the Intel Xeon) is listed as not measured, and one whose record the reference never met says so."""
    bench = _load("cpu_profile_bench2", ROOT / "benchmarks" / "cpu_profile.py")
    text = tool.cpu_against_reference()
    for b in tool.REFERENCE_SETTING_BLOCKS:
        rec = json.loads((tool.records_of(tool.RESULTS[b]) / f"readme/{b}-record.json").read_text())
        by, ref = {r["profile"]: r for r in rec["rows"]}, bench.reference(rec)
        row = next(line for line in text.splitlines() if line.startswith(f"| {rec['machine']['cpu']} |"))
        assert f"{by['fast']['wall']:.1f} s ({ref[1] / by['fast']['wall']:.2f}× faster)" in row
        assert f"{by['exact']['wall']:.1f} s ({ref[1] / by['exact']['wall']:.2f}× faster)" in row
    assert "| Intel (AVX512, no native bf16) | 334.0 s, the figure we were given | not measured" in text
    assert "980.0 s, timed here 2026-11-29 (reference_fafi.py)" in text
    monkeypatch.setattr(tool, "_script", lambda path: type("B", (), {"reference": staticmethod(lambda rec: None),
                                                                     "REFERENCE_TIMES": ()}))
    assert tool.cpu_against_reference().count("never timed on this CPU type") == len(tool.REFERENCE_SETTING_BLOCKS)
