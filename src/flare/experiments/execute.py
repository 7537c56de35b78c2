"""Running sweep points: one after another in this process, or in parallel as Ray tasks (on this machine or a
Ray cluster) — or, without Ray, as processes on this machine —, each calling the same `Run(...).execute()`. Every
point records its start and end times, process, host, GPU share and outcome in `<run dir>/sweep_point.json`; a
broken point never takes the others down. Several points on one GPU is how a sweep fills it: a run of the
notes' size leaves most of an H100 idle, so `--workers N` on one GPU gives each point a 1/N share (Ray's
fractional GPUs; local processes share the device the same way), and `throughput` reports runs per hour."""
from __future__ import annotations

import json
import math
import multiprocessing
import os
import socket
import time
import traceback
import warnings
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from flare.config import build_config, experiment_differences
from flare.errors import FlareError, TrainingDiverged
from flare.progress import Counter
from flare.rundir import RunDir, atomic_write_text
from flare.registry import STRATEGIES
from flare.runner import Run
from flare.server.rounds import rules_for
from flare.server.strategy import Strategy
from flare.setup import check_buildable

POINT_FILE = "sweep_point.json"  # per run directory: start/end wall-clock times, pid, host, outcome


@dataclass
class Point:
    name: str
    values: dict[str, Any]          # the swept keys of this point (preset, grid and zip keys, seed)
    config: Any                     # flare.config.Config
    dir: Path | None = None

    @property
    def mapping(self) -> dict:
        return self.config.model_dump(mode="json")


def read_point_file(d: Path) -> dict:
    return RunDir(d).read_json(POINT_FILE)


def point_status(p: Point) -> str:
    """finished | diverged | partial | new"""
    d = p.dir
    if RunDir(d).read_state().get("status") == "finished":
        return "finished"
    if read_point_file(d).get("status") == "diverged":
        return "diverged"
    return "partial" if (d / "checkpoint.pt").exists() else "new"


def check_dirs(points: list[Point]) -> None:
    """Before anything runs: every existing run directory must hold the same experiment."""
    bad = []
    for p in points:
        try:
            old = RunDir(p.dir).read_config()
        except FlareError:
            keys = ["config.yaml (unreadable)"]
        else:
            keys = experiment_differences(old, p.config) if old is not None else []
        if keys:
            bad.append(f"{p.dir} (keys differ: {', '.join(keys)})")
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise FlareError("run directories hold a different experiment than the sweep asks for: "
                         + "; ".join(bad[:5]) + more + ".", key="--out",
                         fix="choose another --out, or delete those directories to recompute them.")


def check_data(configs: list) -> None:
    """What the drawn data cannot serve (`Strategy.check_data`), for every run of a compare or a sweep before the
    first one trains; only a config that scores a strategy with such a check pays for loading its data here."""
    for cfg in configs:
        if any(STRATEGIES.get(n).check_data is not Strategy.check_data for n in rules_for(cfg)):
            check_buildable(cfg)


def run_point(config: dict, out_dir: str, threads: int | None = None, gpus: float | None = None) -> dict:
    """Run (or resume) one point; records start/end times, the GPU share it was given (`gpus`: Ray's fraction, or
    1/workers for local processes on a GPU machine) and the outcome in <dir>/sweep_point.json. Called in-process for
    sequential sweeps, inside a Ray task or a local worker process for parallel ones."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    info: dict = {"start": time.time(), "pid": os.getpid(), "host": socket.gethostname(), "status": "running",
                  **({"gpus": gpus} if gpus is not None else {})}
    atomic_write_text(d / POINT_FILE, json.dumps(info, indent=1))
    if threads:
        torch.set_num_threads(max(1, int(threads)))
    info["threads"] = torch.get_num_threads()
    t0 = time.perf_counter()
    try:
        summary = Run(build_config(config), d, quiet=True).execute()
        info.update(status="finished", summary=summary)
    except TrainingDiverged as e:
        info.update(status="diverged", error=e.render())
    except FlareError as e:
        info.update(status="error", error=e.render(), key=e.key, fix=e.fix, message=e.message)
    except Exception:  # noqa: BLE001 — one broken point must not take the other points down
        info.update(status="failed", error=traceback.format_exc())
    info.update(end=time.time(), seconds=time.perf_counter() - t0)
    atomic_write_text(d / POINT_FILE, json.dumps(info, indent=1, default=str))
    return info


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_fraction(total_gpus: float, workers: int, asked: float | None = None) -> float:
    """The GPUs each point asks Ray for: `asked` if given (whole GPUs above 1: Ray takes fractions only below 1),
    else a fair share — 1 when there are GPUs enough for every worker, 1/workers of one GPU when there is one."""
    if asked is None:
        return min(1.0, total_gpus / workers) if total_gpus else 0.0
    return float(int(asked)) if asked > 1 else float(asked)


def throughput(results: dict[str, dict], wall: float) -> dict:
    """Runs per hour of a sweep invocation: the points it ran (not those skipped as done earlier), their outcome,
    the wall time, and how many ran at once on average (the sum of their run times over the wall time)."""
    ran = [r for r in results.values() if r.get("status") not in ("skipped", None)]
    finished = sum(1 for r in ran if r.get("status") == "finished")
    busy = sum(float(r.get("seconds") or 0.0) for r in ran)
    return {"runs": len(ran), "finished": finished, "wall_seconds": wall,
            "runs_per_hour": 3600.0 * finished / wall if wall > 0 else float("nan"),
            "mean_run_seconds": busy / len(ran) if ran else float("nan"),
            "concurrency": busy / wall if wall > 0 else float("nan")}


def format_throughput(t: dict) -> str:
    if not t["runs"]:
        return "throughput: nothing ran in this invocation."
    return (f"throughput: {t['finished']} of {t['runs']} runs finished in {t['wall_seconds']:.1f} s wall — "
            f"{t['runs_per_hour']:.1f} runs/hour, {t['mean_run_seconds']:.1f} s per run, "
            f"{t['concurrency']:.2f} runs at once on average")


def execute_points(points: list[Point], *, workers: int = 1, address: str | None = None,
                   cpus_per_point: float = 1.0, gpus_per_point: float | None = None, quiet: bool = False,
                   desc: str = "sweep", log: Callable[[str], None] | None = None, ray: bool = True) -> dict[str, dict]:
    """Run every unfinished point; returns name -> outcome ({'status': ..., ...}). Raises FlareError for a
    user mistake that a point reports at run time (e.g. a missing dataset), after stopping the others.
    `ray=False` keeps parallel points in plain local processes even where Ray is installed (a command whose
    workers never leave this machine need not pay Ray's start-up)."""
    log = log or (lambda m: None if quiet else print(m, flush=True))
    results: dict[str, dict] = {}
    todo = []
    for p in points:
        st = point_status(p)
        if st == "finished":
            results[p.name] = {"status": "skipped", **{k: v for k, v in read_point_file(p.dir).items()
                                                       if k in ("start", "end", "seconds")}}
        elif st == "diverged":
            results[p.name] = {"status": "diverged", "error": read_point_file(p.dir).get("error", "")}
        else:
            todo.append((p, st))
    n_skip = len(points) - len(todo)
    n_resume = sum(1 for _, st in todo if st == "partial")
    log(f"{desc}: {len(points)} points — {n_skip} done earlier (skipped), {n_resume} to resume, "
        f"{len(todo) - n_resume} to run" + (f", {workers} workers" if workers > 1 else ""))
    if not todo:
        return results
    threads = max(1, int(cpus_per_point)) if (workers > 1 or address) else None
    ran = None
    if (workers > 1 and ray) or address:
        ran = _execute_ray([p for p, _ in todo], workers, address, cpus_per_point, gpus_per_point, threads,
                           quiet, desc, n_skip, len(points), log)
    if ran is None and workers > 1 and not address:
        ran = _execute_local([p for p, _ in todo], workers, threads, quiet, desc, n_skip, len(points))
    if ran is None:
        ran = {}
        with Counter(len(points), n_skip, desc, unit="point", disable=quiet) as bar:
            for p, _ in todo:
                bar.set_postfix_str(p.name)
                ran[p.name] = run_point(p.mapping, str(p.dir), threads)
                bar.update(1)
                if ran[p.name]["status"] == "error":
                    break
    results.update(ran)
    if errors := [(n, r) for n, r in ran.items() if r.get("status") == "error"]:
        n, r = errors[0]
        raise FlareError(f"sweep point '{n}' stopped: {r.get('message', r.get('error'))}", key=r.get("key"),
                         fix=r.get("fix"))
    return results


def _execute_ray(points: list[Point], workers: int, address: str | None, cpus_per_point: float,
                 gpus_per_point: float | None, threads: int | None, quiet: bool, desc: str, n_skip: int,
                 total: int, log) -> dict[str, dict] | None:
    try:
        with warnings.catch_warnings():  # lazy: Ray is an optional extra (flare-ofl[sweep])
            warnings.simplefilter("ignore")
            import ray
    except ImportError:
        how = "one after another in this process" if address else f"in {workers} processes on this machine"
        log(f"flare: Ray is not installed, so the points run {how}. "
            "For a Ray cluster: pip install 'flare-ofl[sweep]' (or pip install ray).")
        return None
    started = False
    if not ray.is_initialized():
        kw = dict(include_dashboard=False, log_to_driver=False, logging_level="ERROR", ignore_reinit_error=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            where = dict(address=address) if address else dict(num_cpus=max(1, math.ceil(workers * cpus_per_point)),
                                                                num_gpus=_gpu_count())
            ray.init(**where, **kw)
        started = True
    try:
        total_gpus = float(ray.cluster_resources().get("GPU", 0))
        gpus_per_point = gpu_fraction(total_gpus, workers, gpus_per_point)
        log(f"{desc}: Ray {'cluster at ' + address if address else 'on this machine'} — "
            f"{ray.cluster_resources().get('CPU', 0):g} CPUs, {total_gpus:g} GPUs; per point "
            f"{cpus_per_point:g} CPU, {gpus_per_point:g} GPU")
        task = ray.remote(num_cpus=cpus_per_point, num_gpus=gpus_per_point, max_retries=0)(run_point)
        with Counter(total, n_skip, desc, unit="point", disable=quiet) as bar:
            return _keep_busy(points, workers, bar,
                              submit=lambda p: task.remote(p.mapping, str(p.dir.resolve()), threads, gpus_per_point),
                              wait_some=lambda refs: ray.wait(refs, num_returns=1)[0], result=ray.get)
    finally:
        if started:
            ray.shutdown()


def _keep_busy(points: list[Point], workers: int, bar, submit, wait_some, result) -> dict[str, dict]:
    """Keep `workers` points in flight (Ray tasks or local processes) until every point ran; after a point reports
    a user error (`status: error`) start no new one."""
    out: dict[str, dict] = {}
    queue, inflight, stop = list(points), {}, False
    while queue or inflight:
        while queue and not stop and len(inflight) < workers:
            p = queue.pop(0)
            inflight[submit(p)] = p
        if not inflight:
            break
        for handle in wait_some(list(inflight)):
            p = inflight.pop(handle)
            try:
                info = result(handle)
            except Exception as e:  # noqa: BLE001 — the worker died (OOM, killed, node lost, ...)
                info = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
            out[p.name] = info
            bar.set_postfix_str(p.name)
            bar.update(1)
            if info.get("status") == "error":
                stop = True
    return out


def _execute_local(points: list[Point], workers: int, threads: int | None, quiet: bool, desc: str, n_skip: int,
                   total: int) -> dict[str, dict]:
    """Without Ray: `workers` processes on this machine, started fresh (spawn: a forked process cannot use CUDA),
    sharing its GPU — each point's share recorded as 1/workers of one GPU when there is one."""
    gpus = 1.0 / workers if _gpu_count() else None
    ex = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        with Counter(total, n_skip, desc, unit="point", disable=quiet) as bar:
            return _keep_busy(points, workers, bar,
                              submit=lambda p: ex.submit(run_point, p.mapping, str(p.dir.resolve()), threads, gpus),
                              wait_some=lambda futs: wait(futs, return_when=FIRST_COMPLETED)[0],
                              result=lambda f: f.result())
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
