"""How a method looks in every report: its label and its colour, read from its preset's YAML (`label`, `color`;
`flare.config.preset_metadata`), so a new preset brings its own and no report code names a preset.

A method no preset describes (a plugin's, or `method=` set by hand) is labelled by its name and gets a colour from
matplotlib's default cycle, picked by a hash of the name: the same colour in every figure and every session.
"""
from __future__ import annotations

import zlib

import matplotlib
from matplotlib.colors import to_hex

from flare.config import preset_metadata

_CYCLE = [to_hex(c) for c in matplotlib.rcParamsDefault["axes.prop_cycle"].by_key()["color"]]


def method_label(method: str) -> str:
    """The preset's `label`, else the method's own name."""
    return str(preset_metadata(method).get("label") or method)


def method_colour(method: str) -> str:
    """The preset's `color`, else a stable pick from matplotlib's default colour cycle."""
    colour = preset_metadata(method).get("color")
    return str(colour) if colour else _CYCLE[zlib.crc32(method.encode()) % len(_CYCLE)]
