"""A run's protocol label: `clean`, `reference`, or the protocol plus the items its config sets away from it.

A protocol is data: `clean` is the schema's defaults, any other a file in `flare/protocols/` whose keys are its
*items* (config/load.py layers it under the preset; docs/reproduction.md gives each item's evidence). Every item is
a key of its own, so that an ablation can flip one; `ITEM_KEYS` are the keys any protocol file sets."""
from __future__ import annotations

from typing import Any

from flare.config.load import key_default, parsed_protocols, protocol_overlay
from flare.records import get_key


def _keys(overlay: dict) -> list[str]:
    """Every key an overlay can set, its `when` branches included, in the file's order."""
    branches = [b for by_value in (overlay.get("when") or {}).values() for b in by_value.values()]
    return [k for k in overlay if k != "when"] + [k for b in branches for k in _keys(b)]


ITEM_KEYS = tuple(dict.fromkeys(k for overlay in parsed_protocols().values() for k in _keys(overlay)))


def protocol_deviations(mapping: dict) -> dict[str, Any]:
    """The items a (full) config sets away from its own protocol: {key: value}. Each item's protocol value is the
    overlay's, else (`clean`, or an item the protocol leaves alone) the key's default; a config written before the
    protocol switch existed (no `protocol`, no item keys) is clean with no deviations."""
    overlay = protocol_overlay(mapping)
    want = {k: overlay.get(k, key_default(k)) for k in ITEM_KEYS}
    return {k: get_key(mapping, k, v) for k, v in want.items() if get_key(mapping, k, v) != v}


def protocol_label(mapping: dict) -> str:
    """`clean`, `reference`, or e.g. `reference, eval.bn=running` — the protocol a run directory's config.yaml
    says produced it (reports and summary.md print this)."""
    deviations = protocol_deviations(mapping).items()
    return mapping.get("protocol", "clean") + "".join(f", {k}={_fmt(v)}" for k, v in deviations)


def _fmt(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)
