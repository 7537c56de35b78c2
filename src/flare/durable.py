"""Durable files: atomic writes and JSON lines that stay parseable (non-finite floats as strings, torn lines
reported, not fatal)."""
from __future__ import annotations

import json
import math
import os
import tempfile
from contextlib import suppress
from pathlib import Path
from typing import Callable

import numpy as np
import torch


def _fsync_dir(path: Path) -> None:
    with suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic(path: Path, write: Callable) -> None:
    """Write to a temporary file, fsync it, rename it over `path`, fsync the folder: `path` is old or new, never torn.
    The temporary file's name is its own (two processes filling one shared cache never write into the same file),
    and it is removed when the write fails."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a shared FLARE_CACHE should stay readable
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    _atomic(path, lambda f: f.write(text.encode()))


def atomic_torch_save(obj, path: Path) -> None:
    _atomic(path, lambda f: torch.save(obj, f))


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, torch.Tensor):
        return o.tolist()
    raise TypeError(type(o))


def encode_record(rec: dict) -> str:
    """One JSON line; JSON has no NaN/Inf, so a non-finite float is written as a string (the line stays parseable)."""
    return json.dumps({k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in rec.items()},
                      default=_json_default)


def parse_jsonl(text: str) -> tuple[list[dict], list[int]]:
    """Records of a JSON-lines text, and the 1-based numbers of lines that do not parse (a torn write)."""
    out, bad = [], []
    for i, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        if isinstance(rec, dict):
            out.append(rec)
        else:
            bad.append(i)
    return out, bad


def read_jsonl(path: str | Path) -> list[dict]:
    """The parseable records of a JSON-lines file ([] if it does not exist)."""
    path = Path(path)
    return parse_jsonl(path.read_text(errors="replace"))[0] if path.exists() else []
