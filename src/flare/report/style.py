"""How a method looks in every report: its label, its colour and its place among the rows, read from its preset's
YAML (`label`, `color`, `order`; `flare.config.preset_metadata`), so a new preset brings its own and no report code
names a preset. How a server strategy looks: its `title` and `colour`, attributes of its registered class
(`flare.registry.STRATEGIES`), so no report code names a strategy either.

A method no preset describes (a plugin's, or `method=` set by hand) is labelled by its name and gets a colour from
matplotlib's default cycle, picked by a hash of the name: the same colour in every figure and every session."""
from __future__ import annotations

import math
import zlib

from flare.config import preset_metadata
from flare.registry import STRATEGIES


def method_label(method: str) -> str:
    """The preset's `label`, else the method's own name."""
    return str(preset_metadata(method).get("label") or method)


def method_colour(method: str) -> str:
    """The preset's `color`, else a stable pick from matplotlib's default colour cycle."""
    if colour := preset_metadata(method).get("color"):
        return str(colour)
    from matplotlib import rcParamsDefault  # lazy: about 0.4 s to import; paid where a figure is coloured
    from matplotlib.colors import to_hex
    cycle = [to_hex(c) for c in rcParamsDefault["axes.prop_cycle"].by_key()["color"]]
    return cycle[zlib.crc32(method.encode()) % len(cycle)]


def method_order(method: str) -> float:
    """The preset's `order` (rows sort by it, then by name), else after every preset that states one."""
    order = preset_metadata(method).get("order")
    return float(order) if order is not None else math.inf


def _strategy_attribute(name: str, attribute: str) -> str | None:
    """A registered strategy class's `attribute`, None for a name nobody registered (a run's old rule) or one
    without it."""
    value = getattr(STRATEGIES.get(name), attribute, None) if name in STRATEGIES else None
    return str(value) if value else None


def rule_title(rule: str) -> str | None:
    """The strategy's `title` (a column of the accuracy tables), None when it states none (the table shows the
    accuracy key)."""
    return _strategy_attribute(rule, "title")


def rule_colour(rule: str) -> str | None:
    """The strategy's `colour` in the accuracy figures, None when it states none (the figure picks one)."""
    return _strategy_attribute(rule, "colour")
