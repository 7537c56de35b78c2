"""Registries: every kind of part a config names is looked up by name here, so a plugin adds a part by registering
it, and the config validates names and options the same way for built-in parts and plugins (docs/extending.md).

Like timm's registry, a part is created by name and its options are passed through; unlike it, a name cannot be
replaced by accident (`overwrite=True` says so, and warns), a part may declare its options as a pydantic model
(validated with the config, errors naming `<key>.<option>`), and an unknown name is a `FlareError` that names the
config key and lists the registered names.

The built-in parts register themselves in the modules that implement them; those modules import the config, so the
registries load them by name on the first lookup (`load_builtins`) instead of importing them here — the same way
plugin modules are imported (`load_plugins`, the config's `plugins` key, and the `flare.plugins` entry points).
"""
from __future__ import annotations

import difflib
import importlib
import re
import sys
import warnings
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, ValidationError

from flare.errors import FlareError, KeyedValueError

# The modules that register the built-in parts (imported on the first lookup of any registry).
BUILTIN_MODULES = ("flare.models", "flare.schedules", "flare.data.datasets", "flare.data.partition",
                   "flare.client.terms.align", "flare.client.lam", "flare.client.surgery", "flare.client.objective",
                   "flare.client.terms.banks", "flare.client.terms.extra", "flare.client.trainer",
                   "flare.client.batched", "flare.server.strategy", "flare.baselines")
ENTRY_POINT_GROUP = "flare.plugins"
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class TermOptions(BaseModel):
    """The options every loss term has (`loss.terms.<name>.weight`); a term's own options model subclasses this."""

    model_config = ConfigDict(extra="forbid")
    weight: float = 1.0


_DECORATE = object()  # register(name) without an object: a decorator (None is a part: e.g. anchors "none")


@dataclass(frozen=True)
class Entry:
    name: str
    obj: Any
    options: type[BaseModel] | None
    description: str


class Registry:
    """Named parts of one kind. `key` is the config key that picks a part of this kind (used in error messages)."""

    def __init__(self, kind: str, key: str):
        self.kind, self.key = kind, key
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, obj: Any = _DECORATE, *, options: type[BaseModel] | None = None,
                 description: str = "", overwrite: bool = False):
        """Register `obj` under `name` (None may stand for "no such part", e.g. anchors `none`); without `obj`, a
        decorator. A taken name raises unless `overwrite=True`."""
        if obj is _DECORATE:
            return lambda o: self.register(name, o, options=options, description=description,
                                           overwrite=overwrite)
        if not isinstance(name, str) or not name:
            raise FlareError(f"a {self.kind} needs a non-empty string name, got {name!r}.", key=self.key)
        if options is not None and not (isinstance(options, type) and issubclass(options, BaseModel)):
            raise FlareError(f"{self.kind} '{name}': options must be a pydantic model class, got {options!r}.",
                             key=self.key)
        if name in self._entries:
            if not overwrite:
                raise FlareError(f"{self.kind} '{name}' is already registered.", key=self.key,
                                 fix=f"choose another name, or pass overwrite=True to replace it on purpose.")
            warnings.warn(f"{self.kind} '{name}' replaced by a new registration (overwrite=True).", stacklevel=2)
        doc = (getattr(obj, "__doc__", None) or "").strip().splitlines()
        self._entries[name] = Entry(name, obj, options, description or (doc[0] if doc else ""))
        return obj

    def __contains__(self, name: object) -> bool:
        load_builtins()
        return name in self._entries

    def names(self) -> list[str]:
        load_builtins()
        return list(self._entries)

    def describe(self) -> list[tuple[str, str]]:
        """(name, description) of every registered part, in registration order."""
        load_builtins()
        return [(e.name, e.description) for e in self._entries.values()]

    def unknown(self, name: object, key: str | None = None) -> str:
        """The message for a name nobody registered: the key, the close matches, the registered names."""
        return f"unknown {self.kind} {name!r} for {key or self.key}{self._hint(name)}; {self._choices()}"

    def _hint(self, name: object) -> str:
        close = difflib.get_close_matches(str(name), self.names(), n=3)
        return f" (did you mean {', '.join(close)}?)" if close else ""

    def _choices(self) -> str:
        return (f"registered: {', '.join(self.names()) or '(none)'} (`flare parts` lists every part; a plugin's "
                "parts need its module in `plugins`)")

    def entry(self, name: str, key: str | None = None) -> Entry:
        load_builtins()
        if name not in self._entries:
            raise FlareError(f"unknown {self.kind} {name!r}{self._hint(name)}.", key=key or self.key,
                             fix=f"use a {self._choices()}.")
        return self._entries[name]

    def get(self, name: str, key: str | None = None) -> Any:
        """The registered object, or a FlareError naming `key` and listing the registered names."""
        return self.entry(name, key).obj

    def options(self, name: str, mapping: dict | None, key: str,
                default: type[BaseModel] | None = None) -> BaseModel | None:
        """The part's options validated from `mapping` (None when it declares none and none are given; `default`:
        the model of parts that declare none); errors name `<key>.<option>`. Raises KeyedValueError, a ValueError
        that carries the key, so the config reports it like any other bad value."""
        entry = self.entry(name)
        mapping = mapping or {}
        if not isinstance(mapping, dict):
            raise KeyedValueError(key, f"{key} must be a mapping of option: value, got {mapping!r}")
        model = entry.options or default
        if model is None:
            if mapping:
                raise KeyedValueError(key, f"{key}: {self.kind} '{name}' takes no options, got {sorted(mapping)}")
            return None
        try:
            return model.model_validate(mapping)
        except ValidationError as err:
            e = err.errors()[0]
            where = ".".join([key, *(str(x) for x in e["loc"])])
            raise KeyedValueError(where, f"{where}={e.get('input')!r}: {e['msg']}") from None


MODELS = Registry("model", "model.name")
DATASETS = Registry("dataset", "dataset.name")
PARTITIONS = Registry("partition", "partition.kind")
ANCHORS = Registry("anchor kind", "align.anchors")
LAM_PROVIDERS = Registry("λ provider", "lam.learner")
SCHEDULES = Registry("schedule", "align.schedule")
SURGERY = Registry("gradient surgery", "align.surgery")
CONTRAST = Registry("contrast bank", "loss.contrast")
OBJECTIVES = Registry("local objective", "loss.objective")
LOSS_TERMS = Registry("loss term", "loss.terms")
STRATEGIES = Registry("server strategy", "server.primary")
# The client engines (`client_engine`, a closed choice: not a plugin point, so not in REGISTRIES): each engine's
# class states what it cannot run with `check(cfg)`, which the config's validation calls.
CLIENT_ENGINES = Registry("client engine", "client_engine")
REGISTRIES = {"models": MODELS, "datasets": DATASETS, "partitions": PARTITIONS, "anchors": ANCHORS,
              "lam-providers": LAM_PROVIDERS, "schedules": SCHEDULES, "surgery": SURGERY, "contrast": CONTRAST,
              "objectives": OBJECTIVES, "loss-terms": LOSS_TERMS, "strategies": STRATEGIES}

_state = {"builtins": False}
LOADED_PLUGINS: list[str] = []


def load_builtins() -> None:
    """Import the built-in parts' modules and the `flare.plugins` entry points, once per process."""
    if _state["builtins"]:
        return
    _state["builtins"] = True
    for m in BUILTIN_MODULES:
        importlib.import_module(m)
    _log([m for ep in entry_points(group=ENTRY_POINT_GROUP)
          if _import_plugin(m := ep.value.split(":")[0], lambda ep=ep: ep.load(), f"entry point {ep.name!r} of")])


def load_plugins(modules: object) -> list[str]:
    """Import the config's `plugins` (module names) before the rest of the config is validated; returns them."""
    load_builtins()
    if modules is None:
        return []
    if not isinstance(modules, (list, tuple)) or not all(isinstance(m, str) for m in modules):
        raise FlareError(f"plugins must be a list of module names, got {modules!r}.", key="plugins",
                         fix="write e.g. plugins: [my_pkg.my_methods].")
    for m in modules:
        if not _MODULE_NAME.match(m):
            raise FlareError(f"plugin '{m}' looks like a file path, not a module name.", key="plugins",
                             fix="put its folder on PYTHONPATH (or install it) and write the dotted module name, "
                                 "e.g. plugins: [my_methods] for my_methods.py.")
    _log([m for m in modules if _import_plugin(m, lambda m=m: importlib.import_module(m), "plugin module")])
    return list(modules)


def _log(new: list[str]) -> None:
    """One line on stderr naming the plugin modules this call imported (the CLI's `flare: ...` style)."""
    if new:
        print(f"flare: loaded plugin module{'s' if len(new) > 1 else ''} {', '.join(new)}", file=sys.stderr)


def _import_plugin(module: str, load: Callable[[], object], what: str) -> bool:
    """Import a plugin once per process; True when this call imported it."""
    if module in LOADED_PLUGINS:
        return False
    try:
        load()
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise FlareError(f"{what} '{module}' cannot be found (no module named {e.name!r}).", key="plugins",
                             fix="check its spelling, and put its folder on PYTHONPATH or install its "
                                 "package.") from None
        raise FlareError(f"{what} '{module}' failed to import: {e}.", key="plugins",
                         fix="install what it needs, or fix the plugin.") from None
    except FlareError as e:
        raise FlareError(f"{what} '{module}' failed to import: {e.render()}", key="plugins",
                         fix="fix the plugin.") from None
    except Exception as e:  # noqa: BLE001 — a broken plugin is the user's mistake, reported without a traceback
        raise FlareError(f"{what} '{module}' raised on import: {type(e).__name__}: {e}.", key="plugins",
                         fix="fix the plugin (import it in Python to see the traceback).") from None
    LOADED_PLUGINS.append(module)
    return True
