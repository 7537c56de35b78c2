"""A run's protocol label: `clean`, `reference`, or the protocol plus the items its config sets away from it.

A protocol is data: `clean` is the schema's defaults, any other a file in `flare/protocols/` whose keys are its
*items* (config/load.py layers it under the preset; docs/reproduction.md gives each item's evidence). Every item is
a key of its own, so that an ablation can flip one; `ITEM_KEYS` are the keys any protocol file sets."""
from __future__ import annotations

from flare.config.load import key_default, parsed_protocols, protocol_overlay
from flare.records import get_key


def _keys(overlay: dict) -> list[str]:
    """Every key an overlay can set, its `when` branches included, in the file's order."""
    branches = [b for by_value in (overlay.get("when") or {}).values() for b in by_value.values()]
    return [k for k in overlay if k != "when"] + [k for b in branches for k in _keys(b)]


ITEM_KEYS = tuple(dict.fromkeys(k for overlay in parsed_protocols().values() for k in _keys(overlay)))


def protocol_label(mapping: dict) -> str:
    """`clean`, `reference`, or e.g. `reference, eval.bn=running` — the protocol a run directory's config.yaml
    says produced it, then each item the (full) config sets away from it (reports and summary.md print this). An
    item's protocol value is the overlay's, else (`clean`, or an item the protocol leaves alone) the key's default;
    a config written before the protocol switch existed (no `protocol`, no item keys) is clean with no deviations."""
    overlay, label = protocol_overlay(mapping), mapping.get("protocol", "clean")
    for k in ITEM_KEYS:
        want = overlay.get(k, key_default(k))
        if (v := get_key(mapping, k, want)) != want:
            label += f", {k}={str(v).lower() if isinstance(v, bool) else v}"
    return label
