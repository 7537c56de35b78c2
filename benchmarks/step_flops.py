"""The main job's local step against the core's own FP32 peak, in FLOP/s, on this machine (docs/performance.md,
"The step against the core's peak").

Why: `efficiency.py` says how close a run's step is to torch's bare step (about 0.9), but not how close the bare
step is to the hardware — a Fashion-MNIST client was seen at ~4 GFLOP/s on a core whose FP32 peak is ~32. This
puts the three on one scale in one process: the step a run takes (configs/main.yaml's model, batch and two views,
the preset's loss; built by `efficiency.build`, so it is that benchmark's end-to-end client), the bare step
(efficiency.py's: the same model, CE on already-normalised input, backward, SGD), and a single-thread SGEMM
(`torch.mm`, square, a few sizes, the best), which is what a core reaches on the kernel these steps are made of.
The SGEMM is timed twice: in this process, under the kernels FLARE pinned (what the run's own matrix products get),
and in a child process with the user's environment (the CPU's own kernels: the core's practical peak). Each timing
of the three in this process is interleaved with the others, and the best of `--repeats` is taken.

What is counted (`torch.utils.flop_counter.FlopCounterMode` over a whole round of `--steps` steps, divided by
them; over one bare step): the matrix products and convolutions, forward and backward — mm, addmm, bmm,
convolution and convolution_backward (the first convolution's backward has no input gradient: its input needs
none). Not counted, though they take time: elementwise work (batch norm, ReLU, pooling, softmax, the loss's
normalisations, gradient clipping, the SGD update) and the augmentation's crops, flips and colour ops (the
augmentation's only counted FLOPs are its tiny affine-matrix products, shown apart). FLOP/s is the counted FLOPs
over the whole step's time, so it is a lower bound on the work done and directly comparable with the SGEMM's.

    python benchmarks/step_flops.py                                    # configs/main.yaml, FAFI, one thread
    python benchmarks/step_flops.py --repeats 7 --clock cpu --record runs/readme/step-flops-record.json
    python benchmarks/step_flops.py --config configs/main.yaml --preset flare model.width=0.25
    python benchmarks/step_flops.py --options nhwc,batched5       # also the ways the step could run faster

`--options` times the same step (and its bare step) other ways, interleaved with the first, each in FLOP/s ÷ the
same peak: `nhwc` (the channels-last layout, `cpu_channels_last=true`), `nchw` (the default layout, forced),
`batchedK` (the batched client engine over K clients: the K models' convolutions as one grouped call under
`torch.vmap`), and `nomkldnn` (ATen's own im2col-and-GEMM convolutions, oneDNN off). For each layout a child
process runs one step with `ONEDNN_VERBOSE=1` and records which oneDNN convolution implementations ran: a
kernel's reduction order can depend on how it blocks its loops, and brgemm kernels block by the core's cache sizes,
so an implementation name says which option can keep a run's digits the same on every CPU type
(docs/performance.md, "The step against the core's peak").

`--clock cpu` times in this process's CPU seconds (on a machine shared with other processes: the work done rather
than the waiting); every timing also keeps the other clock in the record. The record (`--record FILE`) holds the
CPU (model name, family, model number, stepping, the flags that matter), torch, threads, kernels, the load average
before and after, the FLOP counts and every figure; `markdown(record)` renders the printed table from it alone
(tools/readme.py's `step-flops` block).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SIZES = (256, 512, 1024, 1536, 2048)
FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
SGEMM_SECONDS = 0.25  # each SGEMM timing runs about this long (at 30 GFLOP/s), so timer and call overhead vanish


def _clocks():
    return time.perf_counter(), time.process_time()


def _elapsed(t0) -> dict:
    w, c = _clocks()
    return {"wall": w - t0[0], "cpu": c - t0[1]}


def sgemm_timings(sizes, repeats: int) -> dict:
    """GFLOP/s of `torch.mm` on n×n fp32 matrices, best of `repeats` per size and clock (2n³ FLOPs a product)."""
    out = {}
    for n in sizes:
        a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
        torch.mm(a, b, out=c)  # warm-up: MKL's buffers and dispatch
        k = max(1, round(SGEMM_SECONDS * 30e9 / (2 * n ** 3)))
        best = {"wall": 0.0, "cpu": 0.0}
        for _ in range(repeats):
            t = _clocks()
            for _ in range(k):
                torch.mm(a, b, out=c)
            dt = _elapsed(t)
            best = {clk: max(best[clk], 2 * n ** 3 * k / dt[clk] / 1e9 if dt[clk] > 0 else 0.0) for clk in best}
        out[str(n)] = best
    return out


def sgemm_in_child(sizes, repeats: int, threads: int, env: dict) -> dict:
    """`sgemm_timings` in a child process with `env` (the user's, FLARE's kernel pins removed): the CPU's own
    kernels. The child imports torch only — importing FLARE would pin them again."""
    env = {**env, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    r = subprocess.run([sys.executable, __file__, "--sgemm-child", ",".join(map(str, sizes)), str(repeats),
                        str(threads)], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"the SGEMM child failed: {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _child(argv) -> None:
    sizes, repeats, threads = [int(s) for s in argv[0].split(",")], int(argv[1]), int(argv[2])
    torch.set_num_threads(threads)
    print(json.dumps({"sgemm": sgemm_timings(sizes, repeats), "kernels": torch.backends.cpu.get_cpu_capability(),
                      "threads": torch.get_num_threads()}))


def _efficiency():
    spec = importlib.util.spec_from_file_location("bench_efficiency", HERE / "efficiency.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def counted(fn, model_name: str, augment_name: str) -> dict:
    """FLOPs `FlopCounterMode` counts over `fn()`: the total, by operator, and the parts inside the model and the
    augmentation (the rest: the loss's products)."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as fc:
        fn()
    by_module = fc.get_flop_counts()
    part = lambda name: sum(by_module.get(name, {}).values())  # noqa: E731
    total = fc.get_total_flops()
    return {"total": total, "model": part(model_name), "augmentation": part(augment_name),
            "by_op": {str(op).removeprefix("aten."): n for op, n in by_module.get("Global", {}).items()}}


OPTIONS = {"nhwc": "channels-last layout (cpu_channels_last=true)", "nchw": "NCHW layout (cpu_channels_last=false)",
           "nomkldnn": "ATen's im2col + GEMM convolutions (oneDNN off)",
           "compiled": "the client's model under torch.compile (inductor: fused elementwise kernels)"}


def option_label(o: str) -> str:
    return OPTIONS.get(o) or f"batched engine, {o[7:]} clients as one vmapped model"


def per_step(counts: dict, steps: int) -> dict:
    return {k: (v / steps if k != "by_op" else {o: c / steps for o, c in v.items()}) for k, v in counts.items()}


def option_context(name: str):
    """`nomkldnn` runs with oneDNN's convolutions off (torch then takes its own im2col-and-GEMM path); the rest as
    they are."""
    import contextlib
    return torch.backends.mkldnn.flags(enabled=False) if name.startswith("nomkldnn:") else contextlib.nullcontext()


def build_option(o: str, cfg, steps: int, eff) -> tuple[dict, int]:
    """The option's timed functions (`O:step`, and `O:bare` where it has a bare step) and the images one call of
    its step trains. A layout builds the run's client and bare step again under that layout; `batchedK` builds K
    clients on K slices of the data and the batched engine over them, as a run on that engine does."""
    if o.startswith("batched"):
        import copy
        from flare.client.batched import BatchedClients
        from flare.client.trainer import Client
        K = int(o[7:])
        b = eff.build(cfg, steps, K)
        n = cfg.batch_size * steps
        clients = [Client(i, torch.arange(i * n, (i + 1) * n), copy.deepcopy(b.model), b.ctx, 1.0) for i in range(K)]
        engine = BatchedClients(clients, b.ctx, compile=False)

        def batched_step():
            for c in clients:
                c.epochs_done = 0
            engine.train_round(0)
        return {f"{o}:step": batched_step}, K
    b = eff.build(cfg.model_copy(update={"cpu_channels_last": o == "nhwc"}) if o in ("nhwc", "nchw") else cfg, steps)
    if o == "compiled":  # in place (`nn.Module.compile`): the client and the optimiser keep the same parameters
        b.client.model.compile()
        b.bare_model.compile()

    def step():
        b.client.epochs_done = 0
        b.client.train_round(b.ctx, 0)

    def bare():
        for _ in range(steps):
            b.bare_step()
    return {f"{o}:step": step, f"{o}:bare": bare}, 1


def option_timers(o: str, cfg, args, eff, names) -> tuple[dict, dict]:
    """`build_option`'s functions warmed up, with the option's record: what it is, its FLOPs a step (counted as the
    run's step is) and the oneDNN convolutions it runs."""
    fns, clients = build_option(o, cfg, args.steps, eff)
    info = {"label": option_label(o), "clients": clients, "flops": {}}
    countable = clients == 1 and o != "compiled"
    for name, fn in fns.items():
        with option_context(name):
            fn()  # warm-up
            if countable:
                info["flops"][name.split(":")[1]] = per_step(counted(fn, *names), args.steps)["total"]
    if not countable:  # the same work a client-step as the run's step; FlopCounterMode miscounts
        info["flops"] = {"step": None}  # vmap's grouped convolutions (2.4 times over, seen) and sees only part of a
        # compiled graph's (inductor's own kernels never reach the dispatcher it counts at), so it is not asked
    info["onednn"] = onednn_convolutions(args, o)
    return fns, info


def onednn_convolutions(args, option: str) -> dict:
    """The oneDNN convolution implementations one step of `option` runs, counted by direction ("forward_training
    brg_conv_fwd:avx2": 3), from a child process with ONEDNN_VERBOSE=1 (oneDNN reads it once, at its first call)."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1", "OMP_NUM_THREADS": str(args.threads)}
    r = subprocess.run([sys.executable, __file__, "--onednn-child", option, args.config, args.preset,
                        *args.overrides], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"the oneDNN child ({option}) failed: {r.stderr.strip()[-500:]}")
    seen: dict[str, int] = {}
    for line in r.stdout.splitlines():
        parts = line.split(",")
        for i in range(len(parts) - 5):
            if parts[i:i + 4] == ["primitive", "exec", "cpu", "convolution"]:
                key = f"{parts[i + 5]} {parts[i + 4]}"
                seen[key] = seen.get(key, 0) + 1
                break
    return seen


def _onednn_child(argv) -> None:
    option, config, preset, overrides = argv[0], argv[1], argv[2], argv[3:]
    from flare.config import load_config
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = load_config(config, preset, ["device=cpu", *overrides]).model_copy(update={"rounds": 1, "local_epochs": 1})
    eff = _efficiency()
    if option == "default":  # the run's own step, as main() builds it
        b = eff.build(cfg, 1)
        b.client.epochs_done = 0
        b.client.train_round(b.ctx, 0)
        return
    fns, _ = build_option(option, cfg, 1, eff)
    with option_context(f"{option}:step"):
        fns[f"{option}:step"]()


def _best(timings: list[dict], clock: str) -> float:
    return min(t[clock] for t in timings)


def load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def machine_facts(threads: int) -> dict:
    from flare import cpu
    from flare.speed import read_cpu
    facts = read_cpu()
    family, model, stepping = facts.signature or (None, None, None)
    return {"cpu": facts.short, "cpu_model": facts.model, "family": family, "model": model, "stepping": stepping,
            "flags": {f: f in facts.flags for f in FLAGS}, "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": threads, "kernels": str(torch.backends.cpu.get_cpu_capability()),
            "cpu_isa": os.environ.get(cpu._MARK), "mkl": cpu.mkl_mode()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(HERE.parent / "configs" / "main.yaml"))
    ap.add_argument("--preset", default="fafi")
    ap.add_argument("--steps", type=int, default=8, help="local steps per timing of the step and the bare step")
    ap.add_argument("--repeats", type=int, default=5, help="timings of each; the best counts")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the main job trains with one per run)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="SGEMM sizes n (n×n · n×n), comma-separated")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--record", default=None, metavar="FILE", help="also write the figures as JSON")
    ap.add_argument("--options", default="", metavar="O,O",
                    help="also time the step other ways: nhwc, nchw, nomkldnn, compiled, batchedK (K clients), comma-separated")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    options = [o for o in args.options.split(",") if o]
    for o in options:
        if o not in OPTIONS and not (o.startswith("batched") and o[7:].isdigit() and int(o[7:]) >= 1):
            ap.error(f"--options: unknown option {o!r}; choose from nhwc, nchw, nomkldnn, compiled, batchedK (e.g. batched5)")
    torch.set_num_threads(args.threads)
    from flare import cpu
    from flare.config import load_config
    eff = _efficiency()
    cfg = load_config(args.config, args.preset, ["device=cpu", *args.overrides])
    cfg = cfg.model_copy(update={"rounds": 1, "local_epochs": 1})
    sizes = [int(s) for s in args.sizes.split(",") if s]
    b = eff.build(cfg, args.steps)
    B, n = cfg.batch_size, cfg.batch_size * args.steps

    def step():
        b.client.epochs_done = 0
        b.client.train_round(b.ctx, 0)

    def bare():
        for _ in range(args.steps):
            b.bare_step()

    step(), bare()  # warm-up: allocator, oneDNN's kernels, kornia
    names = type(b.client.model).__name__, type(b.aug).__name__
    flops = {"step": counted(step, *names), "bare": counted(lambda: b.bare_step(), *names)}
    flops["step"] = per_step(flops["step"], args.steps)
    timed = {"step": step, "bare": bare}
    option_info = {}
    for o in options:
        fns, info = option_timers(o, cfg, args, eff, names)
        timed.update(fns)
        option_info[o] = info
    load_before = load_average()
    times: dict[str, list[dict]] = {name: [] for name in timed}
    sgemm_here = {str(s): {"wall": 0.0, "cpu": 0.0} for s in sizes}
    for _ in range(args.repeats):  # interleaved: background load hurts all of them alike
        for name, fn in timed.items():
            with option_context(name):
                t = _clocks()
                fn()
                times[name].append(_elapsed(t))
        for s, v in sgemm_timings(sizes, 1).items():
            sgemm_here[s] = {clk: max(sgemm_here[s][clk], v[clk]) for clk in v}
    native = sgemm_in_child(sizes, args.repeats, args.threads, cpu.user_environment())
    load_after = load_average()
    for o, info in option_info.items():
        info["seconds"] = {k: {clk: _best(times[f"{o}:{k}"], clk) for clk in ("wall", "cpu")}
                           for k in ("step", "bare") if f"{o}:{k}" in times}
    if options:
        option_info["default"] = {"onednn": onednn_convolutions(args, "default")}
    rec = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine_facts(args.threads),
           "load_average": {"before": load_before, "after": load_after}, "clock": args.clock, "repeats": args.repeats,
           "config": {"config": Path(args.config).name, "preset": args.preset, "overrides": args.overrides,
                      "method": cfg.method, "model": cfg.model.name, "width": cfg.model.width,
                      "dataset": b.data.name, "shape": list(b.data.train_x.shape[1:]), "batch": B, "views": 2,
                      "steps": args.steps},
           "flops": flops,
           "seconds": {k: {clk: _best(times[k], clk) for clk in ("wall", "cpu")} for k in ("step", "bare")},
           **({"options": option_info} if option_info else {}),
           "sgemm": {"pinned": {"kernels": str(torch.backends.cpu.get_cpu_capability()), "mkl": cpu.mkl_mode(),
                                "gflops": sgemm_here},
                     "native": {"kernels": native["kernels"], "gflops": native["sgemm"]}}}
    print(markdown(rec))
    if args.record:
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        Path(args.record).write_text(json.dumps(rec, indent=1) + "\n")
    return rec


def figures(rec: dict, clock: str | None = None) -> dict:
    """GFLOP/s of the step, the bare step and the SGEMM peaks, and the ratios, from a record (at its clock)."""
    clock = clock or rec["clock"]
    steps = rec["config"]["steps"]
    rate = {k: rec["flops"][k]["total"] * steps / rec["seconds"][k][clock] / 1e9 for k in ("step", "bare")}
    peaks = {where: max(rec["sgemm"][where]["gflops"].items(), key=lambda kv: kv[1][clock])
             for where in ("pinned", "native")}
    peak_where = max(peaks, key=lambda w: peaks[w][1][clock])
    peak = peaks[peak_where][1][clock]
    return {"step": rate["step"], "bare": rate["bare"], "peak": peak, "peak_where": peak_where,
            "peak_size": int(peaks[peak_where][0]), "pinned_peak": peaks["pinned"][1][clock],
            "pinned_size": int(peaks["pinned"][0]), "native_peak": peaks["native"][1][clock],
            "native_size": int(peaks["native"][0]),
            "step_peak": rate["step"] / peak, "bare_peak": rate["bare"] / peak, "step_bare": rate["step"] / rate["bare"]}


def options_table(rec: dict) -> list[str]:
    """The step timed other ways (`--options`), each against the same peak and the run's own step."""
    clock, steps, c = rec["clock"], rec["config"]["steps"], rec["config"]
    f = figures(rec)
    imgs = c["batch"] * c["views"]
    opts = rec["options"]

    def convs(o):
        seen = opts.get(o, {}).get("onednn")
        return "; ".join(f"{k} ×{v}" for k, v in sorted(seen.items())) if seen else "none (oneDNN not used)"

    rows = ["| option | ms a client-step | images/s | GFLOP/s | ÷ peak | ÷ the run's step | bare step ÷ peak | oneDNN "
            "convolutions a step |", "| --- | --- | --- | --- | --- | --- | --- | --- |",
            f"| the run's step as it runs (default) | {1e3 * rec['seconds']['step'][clock] / steps:.2f} | "
            f"{imgs * steps / rec['seconds']['step'][clock]:.0f} | {f['step']:.2f} | {f['step_peak']:.3f} | 1.000 | "
            f"{f['bare_peak']:.3f} | {convs('default')} |"]
    for o, info in opts.items():
        if o == "default":
            continue
        k, sec = info["clients"], info["seconds"]
        work = {w: info["flops"].get(w) or rec["flops"][w]["total"] for w in sec}  # None: the run's own step's
        rate = {w: work[w] * steps * k / sec[w][clock] / 1e9 for w in sec}
        bare = f"{rate['bare'] / f['peak']:.3f}" if "bare" in rate else "—"
        rows.append(f"| {o}: {info['label']} | {1e3 * sec['step'][clock] / (steps * k):.2f} | "
                    f"{imgs * steps * k / sec['step'][clock]:.0f} | {rate['step']:.2f} | {rate['step'] / f['peak']:.3f} | "
                    f"{rate['step'] / f['step']:.3f} | {bare} | {convs(o)} |")
    return rows


def markdown(rec: dict) -> str:
    """The benchmark's table, from its record alone (what it prints, and what the docs block shows)."""
    m, c, clock = rec["machine"], rec["config"], rec["clock"]
    f = figures(rec)
    has = lambda yes: ", ".join(k for k, v in m["flags"].items() if v == yes) or "none"  # noqa: E731
    flags = f"flags: {has(True)}; not: {has(False)}"
    fmt_load = lambda v: "/".join(f"{x:.2f}" for x in v) if v else "unknown"  # noqa: E731
    load = rec["load_average"]
    steps, imgs = c["steps"], c["batch"] * c["views"]
    sec = {k: rec["seconds"][k][clock] / steps for k in ("step", "bare")}
    fl = rec["flops"]
    out = [f"CPU: {m['cpu']} — model name \"{m['cpu_model']}\", family {m['family']}, model {m['model']}, stepping "
           f"{m['stepping']}; {flags}. torch {m['torch']}, {m['threads']} thread(s), kernels {m['kernels']} "
           f"(MKL: {m['mkl']}); {clock} clock, best of {rec['repeats']} interleaved repeats; load average (1/5/15 "
           f"min) {fmt_load(load['before'])} before, {fmt_load(load['after'])} after; {rec['date']}.", "",
           f"Step: {c['method']}, {c['model']} width {c['width']}, {c['dataset']} {tuple(c['shape'])}, batch "
           f"{c['batch']} × {c['views']} views = {imgs} images a step, {steps} steps a timing "
           f"({c['config']}, preset {c['preset']}{', ' + ' '.join(c['overrides']) if c['overrides'] else ''}). "
           f"Counted a step: {fl['step']['total'] / 1e9:.3f} GFLOP ({fl['step']['model'] / 1e9:.3f} in the model, "
           f"{(fl['step']['total'] - fl['step']['model'] - fl['step']['augmentation']) / 1e6:.1f} M in the loss, "
           f"{fl['step']['augmentation'] / 1e3:.1f} k in the augmentation); the bare step "
           f"{fl['bare']['total'] / 1e9:.3f} GFLOP.", "",
           "| what | ms a step | images/s | GFLOP/s | ÷ peak |", "| --- | --- | --- | --- | --- |",
           f"| the run's local step (end to end) | {1e3 * sec['step']:.2f} | {imgs / sec['step']:.0f} | "
           f"{f['step']:.2f} | {f['step_peak']:.3f} |",
           f"| the bare step | {1e3 * sec['bare']:.2f} | {imgs / sec['bare']:.0f} | {f['bare']:.2f} | "
           f"{f['bare_peak']:.3f} |",
           f"| SGEMM, the run's pinned kernels ({rec['sgemm']['pinned']['kernels']}, MKL "
           f"{rec['sgemm']['pinned']['mkl']}), best n = {f['pinned_size']} | | | {f['pinned_peak']:.2f} | "
           f"{f['pinned_peak'] / f['peak']:.3f} |",
           f"| SGEMM, the CPU's own kernels ({rec['sgemm']['native']['kernels']}), best n = {f['native_size']} | | | "
           f"{f['native_peak']:.2f} | {f['native_peak'] / f['peak']:.3f} |", "",
           f"Step ÷ bare step {f['step_bare']:.3f}; step ÷ peak {f['step_peak']:.3f}; bare ÷ peak "
           f"{f['bare_peak']:.3f} (peak: the best SGEMM, {f['peak']:.2f} GFLOP/s).", "",
           "SGEMM GFLOP/s by size (n): " + "; ".join(
               f"{where} " + ", ".join(f"{s}: {v[clock]:.2f}" for s, v in rec["sgemm"][where]["gflops"].items())
               for where in ("pinned", "native")) + "."]
    if rec.get("options"):
        out += ["", *options_table(rec)]
    other = "wall" if clock == "cpu" else "cpu"
    g = figures(rec, other)
    out += ["", f"By the {other} clock instead: step {g['step']:.2f}, bare step {g['bare']:.2f}, peak {g['peak']:.2f} "
                f"GFLOP/s (step ÷ peak {g['step_peak']:.3f}, bare ÷ peak {g['bare_peak']:.3f})."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--sgemm-child"]:
        _child(sys.argv[2:])
    elif sys.argv[1:2] == ["--onednn-child"]:
        _onednn_child(sys.argv[2:])
    else:
        main()
