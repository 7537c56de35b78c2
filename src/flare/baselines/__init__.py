"""The one-shot baselines the field compares against (docs/baselines.md), written against FLARE's public extension points
only — the registries, `flare.server.strategy` (Strategy, predictors, ServerContext) and `flare.server.extras`
(client statistics) — exactly as a plugin would be (tests/test_architecture.py holds them to that). Each module
registers its parts when imported; the registries import this package on their first lookup.
"""
from __future__ import annotations

import importlib
import pkgutil

for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")
