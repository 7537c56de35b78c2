"""FLARE: one-shot federated learning with learned global alignment."""
import os as _os

from flare import cpu as _cpu

__version__ = "0.1.0"

# Importing FLARE's modules runs tensor operations, and the first one fixes the CPU kernels torch uses for the
# whole process: pin them here, before any of that (flare/cpu.py says why; the CLI refines it from the command
# line, a run checks it against its config's `cpu_isa`).
if _cpu._MARK not in _os.environ:
    _cpu.pin(_os.environ.get("FLARE_CPU_ISA") if _os.environ.get("FLARE_CPU_ISA") in _cpu.LEVELS else _cpu.DEFAULT_ISA)
