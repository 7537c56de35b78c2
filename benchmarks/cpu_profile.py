"""The CPU path, exact against fast against the bare kernels, on this machine (docs/performance.md).

The setting the reference's `OursV4` was timed in (453.5 s wall on a 2-core AMD EPYC VM with AVX512 and native
bf16, 2 threads): FAFI, CIFAR-10 export, a stratified 5,000 / 1,000 subset, ResNet-18, 5 clients, α = 0.05, batch
512, one round. Each profile runs as its own `flare run` process (the CPU kernel level is fixed per process), so
the wall time is what a user waits for: start-up, data (from the decode cache), speed=fast's probe (once per
machine and model: its figures are cached), training, evaluation, report.

    python benchmarks/cpu_profile.py --data-root ../shared/data/cifar10-jpg.tar.gz
    python benchmarks/cpu_profile.py --data-root ... --profile "bf16 only=amp=bf16 cpu_isa=native"  # add one
    python benchmarks/cpu_profile.py --data-root ... --train-subset 1000 --test-subset 200 --set model.width=0.25

Prints, with the CPU named (its model and whether it has native bf16): a table per profile — wall, training and
evaluation seconds, the kernels, precision and layout it ran, its training throughput against two bare-kernel
figures for the same configuration (forward, CE, backward and SGD on random input, flare/speed.py: the bare step
at the run's own step size, timed after the profiles, and speed=fast's 256-image probe), and the speed-up over
`exact`; then the probe's figures for every candidate, what
speed=fast chose and why; then the exact profile's evaluation seconds per shared pass and per rule; last, one
sentence setting the fast profile against the speed targets. The reference's
recorded wall time is shown only for its own setting (no --set, the 5,000 / 1,000 subset, no kernel cap) and only on
a CPU type it was timed on (a record of benchmarks/reference_fafi.py under results/reference-fafi/, such as the
AVX2-only EPYC's; else `REFERENCE_TIMES`: an AMD EPYC with AVX512 and native bf16, an Intel Xeon with AVX512 and no
native bf16); on any other CPU the sentence says it was never timed there.

`--avx2-only` caps ATen, oneDNN and MKL at AVX2 in every profile: an AVX2-only CPU's code paths on this CPU's
cores (its flags still list AVX512 and bf16; under the cap bf16 is emulated, so speed=fast does not time it).

`--onednn-isa AVX512_CORE_VNNI` exports that cap on oneDNN to every profile (the exact one pins its own AVX2): on
a CPU with native bf16 it gives oneDNN a Cascade Lake Xeon's instruction set, so bf16 is emulated as it is on an
Intel AVX512 machine without bf16 — that machine's code paths on this CPU's cores (its flags still list bf16;
speed=fast sees the cap and does not time the emulated bf16, as a Xeon's flags would leave it out). The CPU line
says so, and whether the record's probe timed bf16 (records made before speed=fast read the cap did).

With `--record FILE` it also writes what it measured as JSON — the CPU (model, flags that matter, cores), torch,
threads, the load average before and after, the setting, every profile's row and the probe's choice — and
`markdown(record)` renders the printed tables from that record alone: tools/readme.py's `cpu-profile` block on
docs/performance.md is rendered from the committed record (results/cpu-profile/).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from flare import cpu, speed
from flare.config import Config
from flare.speed import read_cpu

# The reference's OursV4 in this setting (its own defaults, 2 threads), by the CPU type it was timed on: a model
# name's part, the ISA text `CpuFacts.short` prints, and the wall seconds. Two figures we were given: AMD, timed on
# this project's VM beside the benchmark; Intel, timed on a 2-core Xeon without native bf16 where speed=fast had picked
# emulated bf16. The others are our own measurements, one record per CPU type under REFERENCE_RECORDS
# (benchmarks/reference_fafi.py --record), read before these. A record from a CPU type with neither shows no
# reference: a wall time from another CPU is no yardstick.
REFERENCE_TIMES = (("AMD EPYC", "AVX512, native bf16", 453.5), ("Intel", "AVX512, no native bf16", 334.0))
REFERENCE_RECORDS = Path(__file__).resolve().parents[1] / "results" / "reference-fafi"
SETTING = ["--preset", "fafi", "dataset.name=cifar10", "dataset.format=imagefolder", "model.name=resnet18",
           "num_clients=5", "partition.alpha=0.05", "batch_size=512", "rounds=1"]
PROFILES = {
    "exact": [],                    # the default: AVX2 kernels, fp32, NCHW, every rule evaluated
    "native": ["cpu_isa=native"],   # what pinning costs: the same run on the CPU's best kernels
    "fast": ["speed=fast"],         # native kernels, bf16 where the CPU has it, NHWC, the primary rule only
}


def run_profile(name: str, extra: list[str], args, out: Path) -> dict:
    d = out / name
    cmd = [sys.executable, "-m", "flare.cli", "run", *SETTING, f"dataset.root={args.data_root}",
           f"dataset.train_subset={args.train_subset}", f"dataset.test_subset={args.test_subset}", *args.set, *extra,
           "--out", str(d), "--quiet"]
    # This process pinned its own kernels when it imported FLARE: its children get the environment the user gave
    # it instead, so each profile's `cpu_isa` alone decides their kernels.
    env = {**cpu.user_environment(), **caps(args)}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env={**env, "FLARE_QUIET": "1"}, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{name}: flare run failed ({r.returncode}):\n{r.stderr}")
    recs = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
    rnd = [x for x in recs if x["kind"] == "round"][-1]
    st = json.loads((d / "state.json").read_text())
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    images = 2 * cfg.get("local_epochs", 1) * sum(x["num_samples"] for x in recs if x["kind"] == "client")
    return {"profile": name, "settings": " ".join(extra) or "(defaults)", "wall": wall,
            "train": rnd.get("seconds_train"), "eval": rnd.get("seconds_eval"), "acc": rnd.get("acc"),
            "train_rate": images / rnd["seconds_train"], "eval_parts": rnd.get("seconds_eval_parts") or {},
            "eval_rules": rnd.get("seconds_eval_rules") or {},
            "backend": st.get("backend", {}), "warnings": st.get("warnings", [])}


IMAGE_SHAPE, CLASSES = (3, 32, 32), 10  # the setting's CIFAR-10


def bare_step(d: Path, row: dict, args) -> dict:
    """The bare training step (forward, CE, backward, SGD with momentum on random input: flare/speed.py) of the
    configuration a profile ran — its kernels, precision and layout — at the run's own step size (2 × batch: the
    two views), in its own process under the same caps. speed=fast's probe steps 256 images to keep its cost below
    a run's; on ResNet-18 a 1,024-image step runs fewer images a second than a 256-image one, so only this figure
    says how much of the training's time the kernels alone would take."""
    cfg = Config.model_validate(yaml.safe_load((d / "config.yaml").read_text()))
    b = row["backend"]
    cand = speed.Candidate(b.get("amp") == "bf16", bool(b.get("channels_last")))
    spec = speed.ProbeSpec(cfg.model_dump(mode="json"), IMAGE_SHAPE, CLASSES, 2 * cfg.batch_size)
    rate = speed.measure_in_child(spec, cfg.cpu_isa, cand, {**cpu.user_environment(), **caps(args)})
    return {"images": spec.images, "steps": spec.steps, "samples_per_s": rate}


# An AVX2-only CPU (an older AMD EPYC or Xeon), as far as the kernel libraries can be told to be one: every library's
# dispatch capped at AVX2. The CPU's flags still list what it has; speed=fast sees the cap and leaves bf16 out.
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def caps(args) -> dict:
    """The kernel caps exported to every profile (the exact profile pins its own AVX2 over them)."""
    if args.avx2_only:
        return dict(AVX2_ONLY)
    return {"ONEDNN_MAX_CPU_ISA": args.onednn_isa} if args.onednn_isa else {}


def record_caps(rec: dict) -> dict:
    """The kernel caps a record ran under (records written before `caps` name only their oneDNN cap)."""
    return rec.get("caps") or ({"ONEDNN_MAX_CPU_ISA": rec["onednn_isa"]} if rec.get("onednn_isa") else {})


def cap_text(rec: dict) -> str:
    """What the CPU line says of the caps a record ran under."""
    capped = record_caps(rec)
    timed = "bf16" in ((rec.get("choice") or {}).get("samples_per_s") or {})
    probe = ("speed=fast's probe timed the emulated bf16 too" if timed else
             "bf16, emulated under the cap, is no candidate for speed=fast's probe")
    if capped == AVX2_ONLY:
        return (", ATen, oneDNN and MKL capped at AVX2 (an AVX2-only CPU, emulated on this one's cores; its flags "
                f"still list AVX512 and bf16: {probe})")
    if capped:
        return (f", oneDNN capped at {capped['ONEDNN_MAX_CPU_ISA']} (bf16 emulated: an AVX512 CPU without native "
                f"bf16, emulated on this one's cores; {probe})")
    return ""


def timed_setting(rec: dict) -> bool:
    """Whether the record ran the setting the reference was timed in: no --set, the 5,000 / 1,000 subset, no cap."""
    return rec["reference_setting"] and not record_caps(rec)


def timed_here(cpu: str) -> dict | None:
    """benchmarks/reference_fafi.py's record of the reference timed on this very CPU type, if one is committed."""
    return next((ref for f in sorted(REFERENCE_RECORDS.glob("*.json"))
                 if (ref := json.loads(f.read_text()))["machine"]["cpu"] == cpu), None)


def reference(rec: dict) -> tuple[str, float] | None:
    """(CPU type, seconds) of the reference timed on this record's CPU type, in this record's setting; else None
    (another setting, a kernel cap — the reference ran uncapped — or a CPU type it was never timed on)."""
    if not timed_setting(rec):
        return None
    cpu = rec["machine"]["cpu"]
    if ref := timed_here(cpu):
        return f"{cpu.replace(' (', ', ').rstrip(')')}, timed {ref['date']}", ref["wall"]
    return next(((f"{model}, {isa}", s) for model, isa, s in REFERENCE_TIMES if of_type(cpu, model, isa)), None)


def of_type(cpu: str, model: str, isa: str) -> bool:
    """Whether a record's CPU (`CpuFacts.short`) is of a `REFERENCE_TIMES` type: the name's part and the ISA text,
    with or without the family, model number and stepping newer records name before it."""
    return model in cpu and (f"({isa})" in cpu or f", {isa})" in cpu)


def probe_rate(row: dict, choice: dict) -> float | None:
    """The bare-kernel probe's samples/s for the configuration a profile ran (from speed=fast's probe)."""
    b, rates = row["backend"], choice.get("samples_per_s", {})
    if b.get("cpu_kernels") == "AVX2" and b.get("amp") == "off" and not b.get("channels_last"):
        return rates.get("exact")
    name = ("bf16" if b.get("amp") == "bf16" else "fp32") + (" NHWC" if b.get("channels_last") else "")
    return rates.get(name)


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages (None where the OS has none): how busy the machine was."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def machine_facts() -> dict:
    cpu = read_cpu()
    return {"cpu": cpu.short, "cpu_model": cpu.model, "cores": os.cpu_count(),
            "flags": sorted(f for f in cpu.flags if f.startswith(("avx", "amx"))),
            "torch": torch.__version__, "python": platform.python_version(),
            "torch_threads": os.environ.get("OMP_NUM_THREADS", "default")}


def markdown(rec: dict) -> str:
    """The benchmark's tables, from its record alone (what it prints, and what the docs block shows)."""
    m, rows, choice = rec["machine"], rec["rows"], rec.get("choice") or {}
    own = reference(rec)
    setting = " ".join(rec["set"])
    load = rec.get("load_average") or {}
    fmt_load = lambda v: "/".join(f"{x:.2f}" for x in v) if v else "unknown"  # noqa: E731
    cpu_txt = m["cpu"] + cap_text(rec)
    out = [f"CPU: {cpu_txt}, {m['cores']} cores; torch {m['torch']}, torch threads {m['torch_threads']}, each profile "
           f"its own process; load average (1/5/15 min) {fmt_load(load.get('before'))} before, "
           f"{fmt_load(load.get('after'))} after.", "",
           f"FAFI, CIFAR-10 export {rec['train_subset']}/{rec['test_subset']}, ResNet-18, 5 clients, α = 0.05, batch "
           f"512, one round{'; ' + setting if setting else ''}.", ""]
    ref = f" over the reference ({own[1]} s, {own[0]}) |" if own else ""
    step = next((r["bare_step"]["images"] for r in rows if r.get("bare_step")), None)
    step = f"{step:,} images" if step else "the run's images"  # records made before the column: none measured
    out += ["| profile | settings | CPU kernels | amp | channels_last | rules evaluated | wall (s) | train (s) | "
            f"eval (s) | train (samples/s) | bare step, {step} (samples/s) | train ÷ bare step | "
            f"probe, {(choice.get('probe') or {}).get('images_per_step', 256)} images (samples/s) | train ÷ probe | "
            f"speed-up over exact |{ref}",
            "| --- " * (15 + bool(ref)) + "|"]
    base = rows[0]["wall"]
    ratio = lambda v: f"{r['train_rate'] / v:.2f}" if v else "—"  # noqa: E731
    for r in rows:
        b, bare = r["backend"], probe_rate(r, choice)
        own_step = (r.get("bare_step") or {}).get("samples_per_s")
        cells = [r["profile"], f"`{r['settings']}`", b.get("cpu_kernels"), b.get("amp"), b.get("channels_last"),
                 ", ".join(b.get("eval_rules") or []), f"{r['wall']:.1f}", f"{r['train']:.1f}", f"{r['eval']:.1f}",
                 f"{r['train_rate']:.1f}", f"{own_step:.1f}" if own_step else "—", ratio(own_step),
                 f"{bare:.1f}" if bare else "—", ratio(bare), f"{base / r['wall']:.2f}×"]
        cells += [f"{own[1] / r['wall']:.2f}×"] if own else []
        out.append("| " + " | ".join(map(str, cells)) + " |")
    if choice and (choice.get("probe") or {}).get("skipped"):
        out += ["", f"{choice.get('statement')}."]
    elif choice:
        p = choice.get("probe", {})
        when = "from the cache" if choice.get("cached") else f"measured in {p.get('seconds')} s"
        out += ["", f"speed=fast's probe ({p.get('images_per_step')} images per step, fastest of {p.get('steps')} "
                f"timed steps after a warm-up; exact = fp32 NCHW on {p.get('exact_level')} kernels, in its own "
                f"process; {when}):", "", "| candidate | samples/s | ÷ exact |", "| --- | --- | --- |"]
        ex = choice["samples_per_s"].get("exact")
        order = ["exact", "fp32", "fp32 NHWC", "bf16", "bf16 NHWC"]  # the probe's own order (the cache sorts keys)
        rates = sorted(choice["samples_per_s"].items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 9)
        for k, v in rates:
            out.append(f"| {k}{' (chosen)' if k == choice.get('chosen') else ''} | {v:.1f} | "
                       f"{f'{v / ex:.2f}' if ex else '—'} |")
        out += ["", f"{choice.get('statement')}."]
    if rows[0]["eval_parts"]:
        out += ["", f"Evaluation of the {rows[0]['profile']} profile, {rows[0]['eval']:.1f} s: seconds per part, and "
                "what each rule would cost alone (the shared passes it reads plus its own part):", "",
                "| part | seconds | rule alone (s) |", "| --- | --- | --- |"]
        out += [f"| {k} | {v:.2f} | {rows[0]['eval_rules'].get(k, '—')} |" for k, v in rows[0]["eval_parts"].items()]
    summary = targets(rec)
    out += ["", summary] if summary else []
    for r in rows:
        out += [f"\n{r['profile']}: warning: {w}" for w in r["warnings"]]
    return "\n".join(out) + "\n"


def targets(rec: dict) -> str:
    """The fast profile against the speed targets, as one sentence computed from the record, so that the prose
    around a block never has to copy its figures (and cannot drift from them)."""
    by = {r["profile"]: r for r in rec["rows"]}
    if not {"exact", "fast"} <= by.keys():
        return ""
    fast, exact = by["fast"], by["exact"]
    parts = [f"speed=fast ran {exact['wall'] / fast['wall']:.2f}× exact's wall time (target: never below 1×)"]
    bare = (fast.get("bare_step") or {}).get("samples_per_s")
    parts.append(f"its training at {fast['train_rate'] / bare:.2f} of its own bare step at the run's step size "
                 "(target: at least 0.85)" if bare else "its bare step at the run's step size is not in this record")
    if ref := reference(rec):
        native_bf16 = bool({"avx512_bf16", "amx_bf16"} & set(rec["machine"].get("flags", [])))
        parts.append(f"{ref[1] / fast['wall']:.2f}× the reference's wall time (target: "
                     f"{'at least 1.5× on a CPU with native bf16' if native_bf16 else 'above 1×'}), and the exact "
                     f"default {ref[1] / exact['wall']:.2f}× it (target: at most 10 % slower than it)")
    elif timed_setting(rec):
        parts.append(f"the reference was never timed on this CPU type ({rec['machine']['cpu']}), so no multiple of "
                     "its wall time is given")
    return "Against the targets, from this record: " + "; ".join(parts) + "."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-root", required=True, help="the CIFAR-10 export (.tar.gz or folder)")
    ap.add_argument("--train-subset", type=int, default=5000)
    ap.add_argument("--test-subset", type=int, default=1000)
    ap.add_argument("--out", default="runs/bench-cpu-profile", help="run directories (replaced)")
    ap.add_argument("--record", default=None, metavar="FILE", help="also write the measurements as JSON here")
    ap.add_argument("--profile", action="append", default=[], metavar="NAME=KEY=VALUE ...",
                    help="another profile: a name, '=', then overrides separated by spaces")
    ap.add_argument("--onednn-isa", default=None, metavar="ISA",
                    help="export ONEDNN_MAX_CPU_ISA=ISA to every profile (AVX512_CORE_VNNI: a Cascade Lake's level)")
    ap.add_argument("--avx2-only", action="store_true",
                    help="cap ATen, oneDNN and MKL at AVX2 in every profile: an AVX2-only CPU on this one's cores")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="overrides for every profile (a smaller setting; the reference's time is then not shown)")
    args = ap.parse_intermixed_args(argv)  # KEY=VALUE may come before or after the options
    if args.avx2_only and args.onednn_isa:
        ap.error("--avx2-only caps oneDNN itself; give it or --onednn-isa, not both")
    profiles = dict(PROFILES)
    for p in args.profile:
        name, _, rest = p.partition("=")
        profiles[name] = rest.split()
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    before = load_average()
    # Decode the archive once before timing (the decode cache), so no profile pays for it.
    warm = subprocess.run([sys.executable, "-c", "import sys; from flare.config import load_config; "
                           "from flare.data.prepare import prepare_data; prepare_data(load_config(None, None, sys.argv[1:]))",
                           "dataset.name=cifar10", "dataset.format=imagefolder", f"dataset.root={args.data_root}"],
                          capture_output=True, text=True)
    if warm.returncode != 0:
        raise SystemExit(f"cannot read the dataset: {warm.stderr}")
    rows = [run_profile(n, x, args, out) for n, x in profiles.items()]
    for r in rows:  # after every profile, so none of them waits on it; one child per configuration
        r["bare_step"] = bare_step(out / r["profile"], r, args)
    choice = next((r["backend"]["speed_choice"] for r in rows if r["backend"].get("speed_choice")), {})
    rec = {"machine": machine_facts(), "load_average": {"before": before, "after": load_average()},
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "train_subset": args.train_subset,
           "test_subset": args.test_subset, "set": list(args.set), "profiles": profiles,
           "caps": caps(args),
           "reference_setting": args.set == [] and (args.train_subset, args.test_subset) == (5000, 1000),
           "rows": rows, "choice": choice}
    if args.record:
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        Path(args.record).write_text(json.dumps(rec, indent=1, default=str) + "\n")
    print(markdown(rec), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
