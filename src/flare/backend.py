"""Where and how a process computes: the device, the pinned CPU kernels, bf16 autocast and the memory layout,
decided once per process from the config (`backend`), under `speed=fast` on CPU settled by a measured probe once
the model's input is known (`settle_speed`), and recorded with the run (`Backend.facts`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flare import cpu, speed
from flare.config import Config
from flare.errors import FlareError
from flare.server.rounds import rules_for


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise FlareError(f"device={name} was asked for, but torch sees no CUDA GPU on this machine.",
                         key="device", fix="use device=auto or device=cpu, or install a CUDA build of torch.")
    if name == "mps" and not torch.backends.mps.is_available():
        raise FlareError("device=mps was asked for, but MPS is not available.", key="device",
                         fix="use device=auto or device=cpu.")
    return torch.device(name)


def amp_dtype_for(cfg: Config, device: torch.device) -> torch.dtype | None:
    auto = cfg.amp == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.bfloat16 if cfg.amp == "bf16" or auto else None


def use_channels_last(cfg: Config, device: torch.device) -> bool:
    """NHWC pays off on GPUs (tensor cores); on CPU only where asked for (`cpu_channels_last`: oneDNN's NHWC
    convolutions, measured faster, other digits)."""
    if device.type == "cpu":
        return cfg.cpu_channels_last is True  # "auto": NCHW unless speed=fast's probe chooses NHWC (settle_speed)
    return cfg.channels_last and device.type == "cuda"


@dataclass
class Backend:
    """Where and how a process computes (device, kernels, precision, layout): decided once, recorded (`facts`)."""
    device: torch.device
    amp_dtype: torch.dtype | None
    channels_last: bool
    cpu_kernels: str
    warnings: list[str]
    mkl: str = "no MKL"
    speed_choice: dict | None = None  # speed=fast on CPU: what the probe chose and its figures (flare/speed.py)

    def facts(self, cfg: Config) -> dict:
        return {"machine": machine(self.device), "speed": cfg.speed, "cpu_isa": cfg.cpu_isa,
                "cpu_kernels": self.cpu_kernels, "mkl": self.mkl,
                "amp": "bf16" if self.amp_dtype == torch.bfloat16 else "off", "channels_last": self.channels_last,
                "eval_every": cfg.eval.every, "eval_rules": list(rules_for(cfg)),
                **({"speed_choice": self.speed_choice} if self.speed_choice is not None else {})}


def machine(device: torch.device) -> str:
    """The CPU model and ISA, torch's version and the device: what a reader needs to place a run's digits (the
    exact profile's are the same across CPU types; another torch may move them)."""
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{speed.read_cpu().short}, torch {torch.__version__}, device {dev}"


def backend(cfg: Config, device: str | None = None) -> Backend:
    """Pin the CPU kernels (`cpu_isa`), resolve the device, and turn bf16 autocast off — with a warning — on a CPU
    where it would be emulated (no AVX512-BF16/AMX, or kernels pinned below AVX512): there it is ~50× slower."""
    cpu.pin(cfg.cpu_isa)
    kernels, warn = cpu.check(cfg.cpu_isa)
    warns, device = [warn] if warn else [], resolve_device(device or cfg.device)
    if cfg.compile and device.type == "cpu" and cpu.is_x86() and kernels != cpu.native_level():
        # Measured with torch 2.14.1 on an AVX512 VM: inductor's CPU code under ATEN_CPU_CAPABILITY=avx2 turned the
        # first step's loss into NaN (the same test passes at native kernels), so this is refused, not risked.
        raise FlareError(f"compile=true on CPU with the kernels pinned to {kernels} below this CPU's own "
                         f"{cpu.native_level()} (cpu_isa={cfg.cpu_isa}): torch.compile's CPU code then produced NaN "
                         "losses here.", key="compile", fix="add cpu_isa=native to compile on CPU (other digits), "
                                                            "or leave compile=false.")
    amp = amp_dtype_for(cfg, device)
    if amp == torch.bfloat16 and device.type == "cpu" and not cpu.bf16_supported():
        warns.append(f"amp=bf16 on a CPU without native bf16 under {kernels} kernels (it needs AVX512-BF16 or AMX "
                     "and cpu_isa=native or avx512): torch would emulate it, far slower; training and evaluating "
                     "in fp32 instead")
        amp = None
    cl = use_channels_last(cfg, device)
    if cl and cfg.client_engine == "batched":
        warns.append("client_engine=batched trains in NCHW (vmap cannot use an NHWC layout); channels_last applies "
                     "to evaluation only")
    return Backend(device, amp, cl, kernels, warns, cpu.mkl_mode())


def settle_speed(be: Backend, cfg: Config, shape: tuple[int, int, int], num_classes: int, *, cpu_facts=None,
                 measure=None, cache=None, train_size: int | None = None, kernels_bf16: bool | None = None) -> Backend:
    """`speed=fast` on CPU: the precision (amp=auto) and layout (cpu_channels_last=auto) the probe measures fastest
    for the run's model at its input `shape` (flare/speed.py), recorded in the run's facts; anything else: `be`
    unchanged. `train_size`: all clients' training images (None: unknown), so a run shorter than the probe is not
    probed. `cpu_facts`, `measure`, `cache`, `kernels_bf16` (None: `cpu.kernels_run_bf16()`): for tests."""
    decide_amp, decide_layout = cfg.amp == "auto", cfg.cpu_channels_last == "auto"
    if cfg.speed != "fast" or be.device.type != "cpu" or not (decide_amp or decide_layout):
        return be
    facts = cpu_facts or speed.read_cpu()
    cands = speed.candidates(facts, decide_amp=decide_amp, decide_layout=decide_layout,
                             bf16=be.amp_dtype == torch.bfloat16, channels_last=be.channels_last,
                             kernels_bf16=cpu.kernels_run_bf16() if kernels_bf16 is None else kernels_bf16)
    images = min(2 * cfg.batch_size, speed.PROBE_IMAGES)
    spec = speed.ProbeSpec(cfg.model_dump(mode="json"), tuple(shape), num_classes, images)
    try:
        run_images = None if train_size is None else train_size * cfg.rounds * cfg.local_epochs  # one view each
        choice = speed.probe(spec, cands, cpu.DEFAULT_ISA, facts, measure, cache, run_images)
    except RuntimeError as e:  # the child process of the exact profile failed: fall back to the floor, say so
        be.warnings.append(f"speed=fast: the probe could not run ({e}); running {cands[1].name}")
        be.amp_dtype, be.channels_last = (torch.bfloat16 if cands[1].bf16 else None), cands[1].channels_last
        return be
    be.amp_dtype = torch.bfloat16 if choice.candidate.bf16 else None
    be.channels_last = choice.candidate.channels_last
    be.speed_choice = choice.record()
    if "slower than exact" in choice.statement:
        be.warnings.append(choice.statement)
    return be
