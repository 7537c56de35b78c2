"""`speed=fast` by measurement: which precision and memory layout this CPU runs the run's own training step
fastest in, and how that compares with the exact profile.

Why measured, not assumed: torch reports bf16 as supported wherever oneDNN can run it, and on an AVX512 CPU
without native bf16 oneDNN emulates it — a ResNet-18 round there took 513 s in bf16 against 313 s in exact fp32.
So the CPU's own flags decide which candidates are worth timing, a short probe times them (and the exact profile,
in a child process, since the kernel level is fixed per process), and a candidate other than plain fp32 wins only
by `MARGIN`. The figures are cached on disk per machine and model. The steps, the cache's key and place:
docs/performance.md."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from flare import cpu
from flare.cpu import CpuFacts, read_cpu
from flare.config import Config
from flare.config.architectures import server_architecture
from flare.durable import atomic_write_text
from flare.models import create_architecture

PROBE_VERSION = 1
MARGIN = 0.05          # a candidate must beat plain fp32 by 5 % (the probe's noise on a shared 2-core VM is ~3 %)
# Images per timed step: the run's own step (2·batch: two views) up to this. A trade-off: at the full 1,024 the
# first probe of a ResNet-18 cost more than a one-round run's training (five candidates, a warm-up each), which a
# profile that must never be slower than exact cannot afford; smaller steps can misjudge a layout whose speed grows
# with the batch (fp32 NCHW did, on a loaded VM), which the margin and the summary's figures leave visible.
PROBE_IMAGES = 256
PROBE_STEPS = 2        # timed steps per candidate after one warm-up step; the fastest counts
KERNEL_ENV = cpu._ENV  # the variables that cap torch's kernel libraries (the `cpu` argument below is a CpuFacts)
GIVE_UP = 1.5          # a candidate whose timed step took this many times the best step so far is not timed again


@dataclass(frozen=True)
class Candidate:
    """One way to run the step. `exact`: the exact profile (fp32, NCHW, the default pinned kernels)."""

    bf16: bool
    channels_last: bool
    exact: bool = False

    @property
    def name(self) -> str:
        return "exact" if self.exact else ("bf16" if self.bf16 else "fp32") + (" NHWC" if self.channels_last else "")


EXACT = Candidate(False, False, exact=True)


def candidates(cpu: CpuFacts, *, decide_amp: bool, decide_layout: bool, bf16: bool = False,
               channels_last: bool = False, kernels_bf16: bool = True) -> list[Candidate]:
    """The exact profile, then the candidates at this process's kernels: what the config leaves to the probe
    (`decide_*`) in every allowed value, the rest as the config fixed it; the first after `EXACT` is the floor. bf16
    only where the CPU has bf16 instructions and the kernels may use them (`kernels_bf16`): emulated bf16 is never
    worth the probe's time (one warm-up step of it took minutes under an AVX2 cap)."""
    native = cpu.native_bf16 and kernels_bf16
    precisions = [False, True] if decide_amp and native else [False] if decide_amp else [bf16]
    layouts = [False, True] if decide_layout else [channels_last]
    return [EXACT] + [Candidate(p, cl) for p in precisions for cl in layouts]


@dataclass
class Choice:
    """What the probe chose, why, and the figures (samples/s per candidate name) it chose from."""

    candidate: Candidate
    figures: dict
    statement: str
    cpu: str
    cached: bool = False
    probe: dict = field(default_factory=dict)

    def record(self) -> dict:
        return {"chosen": self.candidate.name, "amp": "bf16" if self.candidate.bf16 else "off",
                "channels_last": self.candidate.channels_last, "statement": self.statement, "cpu": self.cpu,
                "samples_per_s": {k: round(v, 2) for k, v in self.figures.items()}, "cached": self.cached,
                "probe": self.probe}


def choose(cands: list[Candidate], figures: dict, margin: float = MARGIN) -> tuple[Candidate, str]:
    """The fastest candidate if it beats the floor (plain fp32 at these kernels) by `margin`, else the floor; and
    one sentence that says so, with the exact profile's figure beside it."""
    own = [c for c in cands if not c.exact]
    floor = own[0]
    best = max(own, key=lambda c: figures[c.name])
    pick = best if figures[best.name] >= figures[floor.name] * (1 + margin) else floor
    rate, exact = figures[pick.name], figures.get(EXACT.name)
    if pick is floor and len(own) > 1:
        why = (f"nothing beat {floor.name} by {margin:.0%} (best other: {best.name}, {figures[best.name]:.1f} "
               f"samples/s)" if best is not floor else f"{floor.name} was the fastest")
    else:
        why = f"the fastest of {len(own)} candidate(s) measured"
    text = f"speed=fast runs {pick.name} ({rate:.1f} samples/s in the probe; {why})"
    if exact:
        ratio = rate / exact
        text += f"; the exact profile measured {exact:.1f} samples/s ({ratio:.2f}× it)"
        if ratio < 1 - margin:
            text += (": slower than exact on this CPU — its kernels are fixed per process, so use speed=exact "
                     "(or cpu_isa=avx2) here")
    return pick, text


# ------------------------------------------------------------------------------------------------------------
# the measurement


def step_rate(model, images: int, shape: tuple, num_classes: int, bf16: bool, channels_last: bool,
              steps: int = PROBE_STEPS, lr: float = 0.05, beat: float = 0.0) -> float:
    """Samples/s of the bare training step (forward, CE, backward, SGD with momentum) on random input, fastest of
    `steps` after one warm-up. `beat`: the best rate so far; a step slower than it by `GIVE_UP` ends the timing. The
    model is trained in place: pass a copy."""
    gen = torch.Generator().manual_seed(0)  # its own stream: the run's seeded generator is not touched
    x = torch.randn((images, *shape), generator=gen)
    y = torch.randint(0, num_classes, (images,), generator=gen)
    if channels_last:
        x, model = x.contiguous(memory_format=torch.channels_last), model.to(memory_format=torch.channels_last)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    best = float("inf")
    for i in range(steps + 1):
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _, logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i:  # the first step pays for oneDNN's kernel creation
            best = min(best, time.perf_counter() - t)
            if beat and images / best * GIVE_UP < beat:
                break
    return images / best


@dataclass(frozen=True)
class ProbeSpec:
    """Everything the probe's figures depend on besides the CPU and torch (also the child process's input)."""

    config: dict          # the run's config (mode="json"): the model the probe builds is its server architecture
    shape: tuple          # (C, H, W)
    num_classes: int
    images: int
    steps: int = PROBE_STEPS

    def model(self):
        cfg = Config.model_validate(self.config)
        with torch.random.fork_rng(devices=[]):  # the run's own init draws must not move
            torch.manual_seed(0)
            return create_architecture(server_architecture(cfg), self.shape[0], self.num_classes, cfg.head,
                                       cfg.model.feature_dim, checkpoint=False), cfg.lr

    def model_key(self) -> dict:
        cfg = Config.model_validate(self.config)
        return {"arch": repr(server_architecture(cfg)), "head": cfg.head, "feature_dim": cfg.model.feature_dim,
                "shape": list(self.shape), "classes": self.num_classes, "images": self.images, "steps": self.steps}


def measure_here(spec: ProbeSpec, cand: Candidate, beat: float = 0.0) -> float:
    model, lr = spec.model()
    return step_rate(model, spec.images, spec.shape, spec.num_classes, cand.bf16, cand.channels_last, spec.steps, lr,
                     beat)


def measure_in_child(spec: ProbeSpec, level: str, cand: Candidate = EXACT, env: dict | None = None) -> float:
    """`cand`'s bare step in a child process at kernel level `level` (a `cpu_isa`). `env`: the child's environment
    before the level (default: this process's less FLARE's pins; a benchmark passes the user's, with its caps)."""
    env = dict(env) if env is not None else {k: v for k, v in os.environ.items() if k not in (*cpu._ENV, cpu._MARK)}
    env["FLARE_CPU_ISA"] = level
    payload = {"config": spec.config, "shape": list(spec.shape), "num_classes": spec.num_classes,
               "images": spec.images, "steps": spec.steps}
    if not cand.exact:
        payload.update(bf16=cand.bf16, channels_last=cand.channels_last)
    src = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    r = subprocess.run([sys.executable, "-m", "flare.speed"], input=json.dumps(payload), env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"the {cand.name} step's measurement failed: {r.stderr.strip()[-500:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if out.get("candidate") != cand.name:  # a figure of another configuration must never pass for this one's
        raise RuntimeError(f"asked for the {cand.name} step, the child measured {out.get('candidate')}")
    return float(out["samples_per_s"])


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "flare" / "speed-probe.json"


def cache_key(cpu: CpuFacts, spec: ProbeSpec, cands: list[Candidate], exact_level: str) -> tuple[str, dict]:
    """The figures' key: the CPU, torch, threads, the kernels and the model. The kernel caps a user exported
    (`ONEDNN_MAX_CPU_ISA` and the rest: under `native` FLARE leaves them) are part of it — ATen's level alone does
    not show a oneDNN capped below the CPU's bf16 instructions, where bf16 is emulated and far slower."""
    fields = {"version": PROBE_VERSION, "cpu": cpu.model, "flags": sorted(cpu.flags), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "kernels": str(torch.backends.cpu.get_cpu_capability()),
              "kernel_env": {k: os.environ[k] for k in KERNEL_ENV if k in os.environ},
              "exact_level": exact_level, "candidates": [c.name for c in cands], **spec.model_key()}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20], fields


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def probe(spec: ProbeSpec, cands: list[Candidate], exact_level: str, cpu: CpuFacts | None = None,
          measure=None, cache: Path | None = None, run_images: int | None = None) -> Choice:
    """Figures for every candidate (from the cache, else measured and cached), and the choice among them.
    `run_images`: the images the run's training steps through (None: unknown); a probe that would cost more is not
    measured (the floor runs; cached figures still decide). `measure(candidate) -> samples/s` and `cpu`: for tests."""
    cpu = cpu or read_cpu()
    cache = cache or cache_path()
    key, fields = cache_key(cpu, spec, cands, exact_level)
    entries = _read_cache(cache)
    hit = entries.get(key)
    cost = len(cands) * (spec.steps + 1) * spec.images  # every candidate timed, warm-up steps included
    if hit and all(c.name in hit.get("figures", {}) for c in cands):
        figures, cached = hit["figures"], True
    elif run_images is not None and cost > run_images:
        floor = cands[1]
        text = (f"speed=fast runs {floor.name}, unmeasured: the run trains {run_images:,} images and the probe "
                f"would step through {cost:,}, so measuring would cost more than it could save")
        return Choice(floor, {}, text, cpu.short, False, {"images_per_step": spec.images, "steps": spec.steps,
                                                          "exact_level": exact_level, "skipped": True})
    else:
        t, figures, cached = time.perf_counter(), {}, False
        for c in cands:
            if measure is not None:
                figures[c.name] = float(measure(c))
            else:  # exact first, in its own process: the others need not beat it, only be timed fairly
                figures[c.name] = (measure_in_child(spec, exact_level) if c.exact else
                                   measure_here(spec, c, max((v for k, v in figures.items() if k != EXACT.name),
                                                             default=0.0)))
        entries = _read_cache(cache)  # another process may have written meanwhile
        entries[key] = {"key": fields, "figures": figures, "seconds": round(time.perf_counter() - t, 1),
                        "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(cache, json.dumps(entries, indent=1, sort_keys=True))
        except OSError:
            pass  # a read-only home: the run goes on, the next one measures again
    pick, text = choose(cands, figures)
    info = {"images_per_step": spec.images, "steps": spec.steps, "exact_level": exact_level, "cache": str(cache),
            "seconds": (hit or entries.get(key, {})).get("seconds")}
    return Choice(pick, figures, text, cpu.short, cached, info)


def _child() -> None:
    """`python -m flare.speed`: one step's measurement (the exact profile's, or the candidate the JSON names)."""
    d = json.loads(sys.stdin.read())
    spec = ProbeSpec(d["config"], tuple(d["shape"]), d["num_classes"], d["images"], d["steps"])
    cand = Candidate(d["bf16"], d["channels_last"]) if "bf16" in d else EXACT
    print(json.dumps({"samples_per_s": measure_here(spec, cand), "candidate": cand.name}))


if __name__ == "__main__":
    _child()
