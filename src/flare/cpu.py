"""Which CPU kernels torch runs, and the CPU speed switches.

A CPU run's digits follow the instruction set that torch's three kernel libraries dispatch to: ATen (elementwise
and reductions), oneDNN (convolutions) and, on x86 builds, Intel MKL (the BLAS behind `linear`/`addmm`); each
chooses its code path once, at its first kernel call, from the environment (`ATEN_CPU_CAPABILITY`,
`ONEDNN_MAX_CPU_ISA`, `MKL_CBWR` with `MKL_ENABLE_INSTRUCTIONS`) capped by what the CPU supports. So FLARE pins a
level every x86-64 machine of this workplace supports (`cpu_isa=avx2`, the default) before a run's first tensor
operation, checks afterwards that the libraries really dispatch there, and records the level in the run
(state.json, summary.md). `cpu_isa=native` lets each library pick the CPU's best (faster, other digits). The
measurements behind it and which claims hold on which CPUs: docs/reproducibility.md and docs/performance.md."""
from __future__ import annotations

import ctypes
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

# cpu_isa -> (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, what torch.backends.cpu.get_cpu_capability() then says,
#             MKL_CBWR, MKL_ENABLE_INSTRUCTIONS)
LEVELS: dict[str, tuple[str, str, str, str, str] | None] = {
    "default": ("default", "SSE41", "DEFAULT", "COMPATIBLE", "SSE4_2"),
    "avx2": ("avx2", "AVX2", "AVX2", "AVX2,STRICT", "AVX2"),
    "avx512": ("avx512", "AVX512_CORE", "AVX512", "AVX512,STRICT", "AVX512"),
    "native": None,  # whatever the CPU (and any ATEN_CPU_CAPABILITY / MKL_CBWR the user exported) gives
}
DEFAULT_ISA = "avx2"
_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS")
_MARK = "FLARE_CPU_ISA_PINNED"  # the level FLARE pinned: children keep it, and `native` knows the pin was ours
# The kernel variables the user had exported before FLARE's first pin (JSON; children inherit it): importing FLARE
# pins the default before the command line is read, so `native` must restore these, not merely drop FLARE's own.
_USER = "FLARE_CPU_USER_ENV"


def user_environment() -> dict:
    """The environment as the user gave it (FLARE's pins and marks removed, the user's kernel variables put back):
    what a child process that chooses its own kernel level (a benchmark's profiles) starts from."""
    env = {k: v for k, v in os.environ.items() if k not in (*_ENV, _MARK, _USER)}
    env.update(json.loads(os.environ.get(_USER) or "{}"))
    return env


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def pin(level: str) -> None:
    """Set the environment so that this process's first CPU kernel (and every process it starts: sweep workers, Ray
    workers, Flower nodes) dispatches at `level`. Takes effect only before the process's first tensor operation
    (`flare/__init__.py` and the CLI pin first thing; `check` says whether it took). `native` removes a pin FLARE
    set (one the user exported stays: it is theirs)."""
    if level not in LEVELS:
        raise ValueError(f"unknown cpu_isa {level!r}; one of {', '.join(LEVELS)}")
    spec, prev = LEVELS[level], os.environ.get(_MARK)
    if prev is None:  # no pin of FLARE's in this environment yet: what it holds is the user's
        os.environ[_USER] = json.dumps({k: os.environ[k] for k in _ENV if k in os.environ})
    os.environ[_MARK] = level  # also for native: a child process must not re-pin the default
    if spec is None:
        if prev not in (None, "native"):
            user = json.loads(os.environ.get(_USER) or "{}")
            for k in _ENV:
                if k in user:
                    os.environ[k] = user[k]
                else:
                    os.environ.pop(k, None)
        return
    if is_x86():
        for k, v in zip(_ENV, (spec[0], spec[1], spec[3], spec[4])):
            os.environ[k] = v


def kernels() -> str:
    """The level ATen dispatches to in this process (this fixes it, if nothing ran before)."""
    import torch  # lazy: `pin` must be importable before torch loads (the CLI calls it first)
    return str(torch.backends.cpu.get_cpu_capability())


def native_level() -> str:
    """The best level the CPU itself supports, whatever this process was pinned to."""
    import torch  # lazy: see kernels()
    for level, fn in (("AVX512", "_is_avx512_supported"), ("AVX2", "_is_avx2_supported")):
        if getattr(torch.cpu, fn, lambda: False)():
            return level
    return "DEFAULT"


def mkl_mode() -> str:
    """The MKL reproducibility branch in force in this process: the `MKL_CBWR` value MKL took at its first call,
    "unpinned" (MKL's automatic, CPU-dependent dispatch), or "no MKL". MKL's public `mkl_cbwr_get` is not exported by
    torch's library, so this reads the service routine behind it, which (torch 2.11 and 2.14, MKL 2024.2) answers 1
    while no branch is set; a small `addmm` first makes MKL read its environment."""
    import torch  # lazy: see kernels()
    lib = None
    if torch.backends.mkl.is_available():
        try:  # torch's own copy of MKL, linked into libtorch_cpu
            lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        except OSError:
            pass
    if lib is None or not hasattr(lib, "mkl_serv_cbwr_get"):
        return "no MKL"
    a = torch.ones(2, 2)
    torch.addmm(a, a, a)
    branch = lib.mkl_serv_cbwr_get(1)
    return "unpinned" if branch == 1 else (os.environ.get("MKL_CBWR") or f"branch {branch}")


def check(level: str) -> tuple[str, str | None]:
    """(the level torch dispatches to, a warning when that — ATen's level or MKL's branch — is not what `level`
    asked for)."""
    got = kernels()
    spec = LEVELS.get(level)
    if spec is None:
        return got, None
    if not is_x86():
        return got, (f"cpu_isa={level} names an x86-64 instruction set, but this machine is {platform.machine()}; "
                     f"torch runs its native {got} kernels, so digits can differ from x86-64 machines'")
    if got != spec[2]:
        return got, (f"cpu_isa={level} asked for {spec[2]} kernels, but torch dispatches to {got} in this process "
                     "(the CPU lacks that level, or a tensor operation ran before the run pinned it); digits can "
                     "differ from the documented tables'")
    mkl = mkl_mode()
    if mkl not in ("no MKL", spec[3]):
        return got, (f"cpu_isa={level} asked MKL for its {spec[3]} branch, but MKL runs {mkl} in this process "
                     "(a matrix product ran before the run pinned it, or MKL_CBWR was changed after); the linear "
                     "layers' digits can differ from the documented tables'")
    return got, None


# oneDNN's levels below its bf16 instructions (AVX512_CORE_BF16): capped at one of these, oneDNN emulates bf16.
ONEDNN_BELOW_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"})
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class CpuFacts:
    """What the CPU itself says it runs (not what torch's libraries are willing to emulate)."""

    model: str
    flags: frozenset = frozenset()
    signature: tuple = ()  # (family, model number, stepping): "AMD EPYC" is a Zen 1 or a Zen 5; () where unknown

    @property
    def native_bf16(self) -> bool:
        return any(f in self.flags for f in NATIVE_BF16_FLAGS)

    @property
    def short(self) -> str:
        isa = "AVX512" if "avx512f" in self.flags else "AVX2" if "avx2" in self.flags else "no AVX2"
        sig = "family {} model {} stepping {}, ".format(*self.signature) if self.signature else ""
        return f"{self.model} ({sig}{isa}, {'native bf16' if self.native_bf16 else 'no native bf16'})"


def read_cpu(path: str | Path = "/proc/cpuinfo") -> CpuFacts:
    """The first processor's model name, flags, family, model number and stepping (the name alone does not tell one
    EPYC generation from another); a machine without /proc/cpuinfo reports no flags (so no bf16 candidate:
    emulated bf16 is never worth timing)."""
    model, flags, ids = platform.processor() or platform.machine(), frozenset(), {}
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return CpuFacts(model, flags)
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == (platform.processor() or platform.machine()):
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
        elif key in ("cpu family", "model", "stepping"):
            ids.setdefault(key, value.strip())
    return CpuFacts(model, flags, tuple(ids[k] for k in ("cpu family", "model", "stepping")) if len(ids) == 3 else ())


def kernels_run_bf16(environ: dict | None = None) -> bool:
    """Whether this process's kernel libraries may use the CPU's bf16 instructions: ATen dispatching above AVX2,
    and oneDNN not capped below its bf16 level (ONEDNN_MAX_CPU_ISA, or its old name DNNL_MAX_CPU_ISA). Under either
    cap bf16 is emulated: ResNet-18's step measured 2.8 samples/s in bf16 against 44.7 in fp32 on an avx512_bf16 CPU."""
    env = os.environ if environ is None else environ
    cap = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return cap not in ONEDNN_BELOW_BF16 and kernels() not in ("DEFAULT", "AVX2")


def bf16_supported(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether bf16 autocast is fast here: native bf16 arithmetic (AVX512-BF16 or AMX) by the CPU's own flags, not
    torch's `_is_mkldnn_bf16_supported`, which also says yes where oneDNN emulates it (flare/speed.py: why), and
    kernels that may use it (`kernels_run_bf16`). Where there is no /proc/cpuinfo (not Linux), torch's answer stands."""
    import torch  # lazy: see kernels()
    facts = read_cpu(cpuinfo)
    if facts.flags:
        hw = facts.native_bf16
    else:
        try:
            hw = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            hw = False
    return hw and kernels_run_bf16()


def _yaml_level(path) -> str | None:
    """cpu_isa (or speed=fast → native) of a YAML config, read without torch; None if it says nothing or cannot
    be read (the config loader reports a bad file later, with the proper message)."""
    import yaml  # lazy: only the CLI's start needs it here
    try:
        with open(path, encoding="utf-8") as f:
            m = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(m, dict):
        return None
    return m.get("cpu_isa") or ("native" if m.get("speed") == "fast" else None)


def early_level(argv: list[str], env: dict | None = None) -> str:
    """The cpu_isa a command line asks for, read before anything dispatches a kernel: an override `cpu_isa=...` (or
    `speed=fast` → native), else the `--config` file's (or a `--resume` or `flare fuse` directory's config.yaml),
    else $FLARE_CPU_ISA, else the default. Each run then pins and checks its config's level (`backend`)."""
    env = os.environ if env is None else env
    level = env.get("FLARE_CPU_ISA") or DEFAULT_ISA
    for i, a in enumerate(argv):
        path = None
        if a in ("--config", "--resume") and i + 1 < len(argv):
            path = argv[i + 1] if a == "--config" else os.path.join(argv[i + 1], "config.yaml")
        elif a.startswith(("--config=", "--resume=")):
            path = a.split("=", 1)[1] if a.startswith("--config=") else os.path.join(a.split("=", 1)[1], "config.yaml")
        elif argv[0] == "fuse" and i > 0 and not a.startswith("-") and os.path.isfile(os.path.join(a, "config.yaml")):
            path = os.path.join(a, "config.yaml")  # `flare fuse RUN_DIR`: the run's own kernels
        if path and (found := _yaml_level(path)):
            level = found
    if any(a.startswith("speed=") and a.split("=", 1)[1].strip() == "fast" for a in argv):
        level = "native"
    level = next((a.split("=", 1)[1].strip() for a in reversed(argv) if a.startswith("cpu_isa=")), level)
    return level if level in LEVELS else DEFAULT_ISA
