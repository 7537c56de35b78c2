"""What a run's records say, read and compared as plain data (no file is owned here: `flare.rundir` owns the run
directory): the comparisons every command that trusts a run's files makes the same way."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from flare.registry import STRATEGIES


def acc_keys(records: list[dict]) -> list[str]:
    """The records' `acc_<strategy>` keys in registration order (built-in rules first), then unregistered ones."""
    seen, order = dict.fromkeys(k for r in records for k in r if k.startswith("acc_")), STRATEGIES.names()
    return [f"acc_{n}" for n in order if f"acc_{n}" in seen] + [k for k in seen if k[4:] not in order]


def flatten(m: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in m.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def get_key(mapping: dict, key: str, default=None):
    """A dotted key's value in a nested mapping; `default` where a section on its way is missing."""
    node = mapping
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def set_key(mapping: dict, key: str, value) -> None:
    """Set a dotted key in a nested mapping, copying (or making) each section on its way."""
    *path, last = key.split(".")
    node = mapping
    for part in path:
        node[part] = node = dict(node.get(part) or {})
    node[last] = value


def config_differences(old: dict, new: dict, defaults: dict | None = None) -> list[str]:
    """Dotted keys whose values differ; a key one side lacks and the other leaves empty (None, [], {}) is none.
    With `defaults` (a flattened default config), a key one side lacks counts as its default: an option added after
    `old` was written defaults to the behaviour `old` ran with, so a run recorded before it existed still resumes."""
    a, b, defaults = flatten(old or {}), flatten(new or {}), defaults or {}
    return sorted(k for k in set(a) | set(b) if a.get(k, defaults.get(k)) != b.get(k, defaults.get(k))
                  and not all(v is None or v in ([], {}) for v in (a.get(k), b.get(k))))


def config_fingerprint(mapping: dict) -> str:
    """A short hash of a resolved config (key order and YAML formatting do not matter; values do)."""
    return hashlib.sha256(json.dumps(mapping, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_fingerprint(path: Path) -> str | None:
    """A short hash of a file's bytes (None: no such file)."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except FileNotFoundError:
        return None


def shown(v) -> str:
    text = json.dumps(v, default=str)
    return text if len(text) <= 40 else text[:37] + "..."
