"""Where one round's time goes: torch.profiler over one round of local training and its evaluation.

Builds a run exactly as `flare run` does (any preset, any KEY=VALUE overrides, any `client_engine`), trains
`--warmup` rounds unprofiled (allocator, cuDNN autotuning, torch.compile), then profiles the next round's training
and evaluation. Prints

* the wall time of the profiled round's training and evaluation;
* the phases the code marks with `record_function` (`flare.augment`, `flare.forward`, `flare.loss`,
  `flare.forward_loss` — the batched engine's vmapped forward and loss —, `flare.backward`, `flare.optimizer`,
  `flare.evaluate`): host time and, on a GPU, device time;
* the host↔device syncs it can see: reads of a tensor's value on the host (`aten::_local_scalar_dense`, which
  every `.item()`, `float(t)`, `.tolist()` of a scalar and `if t:` go through; `aten::nonzero`), and on CUDA the
  runtime's synchronising calls (`cudaStreamSynchronize`, `cudaDeviceSynchronize`, `cudaEventSynchronize`,
  blocking `cudaMemcpy`) — on a CPU the first kind are the places that would sync on a GPU;
* the top ops by self time (device time on a GPU, host time on a CPU);

and writes a Chrome trace (open it in chrome://tracing or https://ui.perfetto.dev).

    python benchmarks/profile_round.py --preset fafi dataset.name=cifar10 dataset.format=imagefolder \\
        dataset.root=PATH/cifar10-jpg.tar.gz model.name=resnet18 num_clients=5 partition.alpha=0.05 \\
        client_engine=batched --out runs/profile
    python benchmarks/profile_round.py --cpu-smoke          # a tiny CPU run in seconds (CI runs it)
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from flare.client.batched import BatchedClients
from flare.config import load_config
from flare.runner import InProcess
from flare.setup import RunSetup

SMOKE = ["dataset.name=synthetic-cifar10", "dataset.train_subset=256", "dataset.test_subset=128", "model.name=cnn",
         "model.width=0.25", "num_clients=2", "batch_size=32", "test_batch_size=128", "device=cpu",
         "partition.kind=iid"]
PHASES = ("flare.augment", "flare.forward", "flare.loss", "flare.forward_loss", "flare.backward", "flare.optimizer",
          "flare.train_round", "flare.evaluate")
HOST_READS = ("aten::_local_scalar_dense", "aten::nonzero")
CUDA_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_us(evt) -> float:
    """An event's device time (µs), across torch versions (cuda_time_total was renamed device_time_total)."""
    return float(getattr(evt, "device_time_total", getattr(evt, "cuda_time_total", 0.0)) or 0.0)


def _self_device_us(evt) -> float:
    return float(getattr(evt, "self_device_time_total", getattr(evt, "self_cuda_time_total", 0.0)) or 0.0)


def conv_dtype_under_vmap(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype a convolution computes in under vmap + autocast — the batched engine's case. Autocast casts
    `conv2d`, but vmap's batching rule reaches the lower-level `convolution`, which CUDA's autocast list holds and
    CPU's does not: where this says float32, the batched engine's convolutions run without the lower precision."""
    w, x = torch.randn(2, 4, 3, 3, 3, device=device), torch.randn(2, 1, 3, 8, 8, device=device)

    def conv(wi, xi):
        with torch.autocast(device.type, dtype=dtype):
            return torch.nn.functional.conv2d(xi, wi)

    return torch.vmap(conv)(w, x).dtype


def summarize(prof, on_gpu: bool, steps: int, top: int) -> dict:
    """The phases, syncs and top ops of a finished profile, as numbers (the test reads them)."""
    avg = {e.key: e for e in prof.key_averages()}
    phases = {k: (avg[k].cpu_time_total / 1e3, _device_us(avg[k]) / 1e3, avg[k].count) for k in PHASES if k in avg}
    reads = {k: avg[k].count for k in HOST_READS if k in avg}
    by_phase: dict[str, int] = {}
    for e in prof.events():  # which marked phase each host read happened in (its innermost flare.* ancestor)
        if e.name in HOST_READS:
            up = e.cpu_parent
            while up is not None and not up.name.startswith("flare."):
                up = up.cpu_parent
            name = up.name if up is not None else "(unmarked)"
            by_phase[name] = by_phase.get(name, 0) + 1
    syncs = {k: avg[k].count for k in CUDA_SYNCS if k in avg}
    key = _self_device_us if on_gpu else (lambda e: float(e.self_cpu_time_total))
    ops = sorted((e for e in avg.values() if not e.key.startswith("flare.") and key(e) > 0), key=key, reverse=True)
    total = sum(key(e) for e in ops) or 1.0
    top_ops = [(e.key, key(e) / 1e3, 100 * key(e) / total, e.count) for e in ops[:top]]
    return {"phases": phases, "host_reads": reads, "host_reads_by_phase": by_phase, "cuda_syncs": syncs,
            "top_ops": top_ops, "steps": steps}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="fafi")
    ap.add_argument("--warmup", type=int, default=1, help="unprofiled rounds first (compile, autotuning)")
    ap.add_argument("--top", type=int, default=20, help="how many ops to list")
    ap.add_argument("--out", default=None, help="folder for trace.json (default: a temporary folder)")
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny CPU configuration that runs in seconds")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)  # KEY=VALUE may come before or after the options
    base = SMOKE if args.cpu_smoke else []
    cfg = load_config(None, args.preset, base + args.overrides)
    cfg = cfg.model_copy(update={"rounds": max(cfg.rounds, args.warmup + 1)})
    setup = RunSetup.build(cfg)
    be = setup.server.backend
    clients = setup.make_clients(lambda m: print("warning:", m), lambda m: None)
    if cfg.compile and cfg.client_engine != "batched":
        for c in clients:
            c.model.compile()
    active = [c for c in clients if c.num_samples > 0]
    engine = BatchedClients(active, setup.ctx, compile=cfg.compile) if cfg.client_engine == "batched" else None

    io = InProcess(None, setup, clients, active, None, None, None, [], {})  # the round loop's in-process transport

    def evaluate(r: int) -> None:
        """Round r's evaluation as the round loop (flare/loop.py) makes it: the uploads, their score, the carry."""
        scored = setup.server.scored(r)
        uploads = io.uploads(r, scored)
        setup.server.carry(setup.server.evaluate(r, uploads, io.models(uploads), clients=io.exchange(uploads, scored)))

    def train(r: int) -> list[dict]:
        if engine is not None:
            return engine.train_round(r)
        return [c.train_round(setup.ctx, r) for c in active]  # threads: profile the per-client work sequentially

    for r in range(args.warmup):
        train(r)
        evaluate(r)
    r = args.warmup
    on_gpu = be.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    sync(be.device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        with record_function("flare.train_round"):
            recs = train(r)
            sync(be.device)
        t1 = time.perf_counter()
        with record_function("flare.evaluate"):
            evaluate(r)
            sync(be.device)
        t2 = time.perf_counter()
    steps = sum(rec["steps"] for rec in recs)
    s = summarize(prof, on_gpu, steps, args.top)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="flare-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / "trace.json"))
    dev = torch.cuda.get_device_name(be.device) if on_gpu else f"CPU ({torch.get_num_threads()} threads)"
    print(f"device: {dev}   torch {torch.__version__}   amp: {be.amp_dtype}   channels_last: {be.channels_last}")
    print(f"config: {cfg.method} ({cfg.client_engine} engine{', compiled' if cfg.compile else ''}), {cfg.model.name} "
          f"width {cfg.model.width}, {len(active)} clients, batch {cfg.batch_size}, round {r} after {args.warmup} "
          f"warm-up round(s)")
    print(f"round {r}: train {t1 - t0:.3f} s ({steps} client steps), evaluation {t2 - t1:.3f} s")
    if be.amp_dtype is not None:
        s["conv_dtype_under_vmap"] = str(conv_dtype_under_vmap(be.device, be.amp_dtype))
        print(f"autocast {be.amp_dtype}: a convolution under vmap (the batched engine) computes in "
              f"{s['conv_dtype_under_vmap']}")
    print(f"\n{'phase':22s} {'host ms':>10s} {'device ms':>10s} {'calls':>7s}")
    for k, (cpu_ms, dev_ms, n) in s["phases"].items():
        print(f"{k:22s} {cpu_ms:10.1f} {dev_ms:10.1f} {n:7d}")
    reads = sum(s["host_reads"].values())
    print(f"\nhost reads of device values (would sync on a GPU): {reads} "
          f"({reads / max(steps, 1):.2f} per client step) {s['host_reads']}; by phase: {s['host_reads_by_phase']}")
    if on_gpu:
        print(f"CUDA synchronising calls: {sum(s['cuda_syncs'].values())} {s['cuda_syncs']}")
    print(f"\ntop {len(s['top_ops'])} ops by self {'device' if on_gpu else 'host'} time:")
    print(f"{'op':48s} {'ms':>10s} {'%':>6s} {'calls':>7s}")
    for name, ms, pct, n in s["top_ops"]:
        print(f"{name[:48]:48s} {ms:10.1f} {pct:6.1f} {n:7d}")
    print(f"\nChrome trace: {out / 'trace.json'}")
    s.update(train_s=t1 - t0, eval_s=t2 - t1, trace=str(out / "trace.json"))
    return s


if __name__ == "__main__":
    main()
