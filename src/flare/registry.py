"""Registries: every kind of part a config names is looked up by name here, so a plugin adds a part by registering it,
and the config validates names and options the same way for built-in parts and plugins (docs/extending.md).

Like timm's registry, a part is created by name and its options are passed through; unlike it, a name cannot be
replaced by accident (`overwrite=True` says so, and warns), a part may declare its options as a pydantic model
(validated with the config, errors naming `<key>.<option>`), and an unknown name is a `FlareError` that names the
config key and lists the registered names.

Each registry states what its entries are (`signature`, a `typing.Protocol`: what the code that uses the part calls it
with). The Protocol is declared in the module whose types it names (`PartitionFn` beside `Partition` in
flare/data/partition.py), and named here as `"module:Name"`, resolved when asked for: this module is the bottom floor,
so it imports none of the modules above it, not even for type checking. Every part may state what it needs of a config
(`check(cfg)`: the `check=` argument of `register`, or the part's own `check` attribute, e.g. a `Strategy`'s
classmethod). The config calls every chosen part's checks from one place (`Config._compatible_parts`), so a rule about
a part lives with that part, and a plugin part refuses a config it cannot serve exactly as a built-in one does.

The built-in parts register themselves in the modules that implement them; those modules import the config, so the
registries load them by name on the first lookup (`load_builtins`) instead of importing them here — the same way
plugin modules are imported (`load_plugins`, the config's `plugins` key, and the `flare.plugins` entry points).
"""
from __future__ import annotations

import difflib
import importlib
import inspect
import math
import re
import sys
import types
import typing
import warnings
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Annotated, Any, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticUndefined

from flare.errors import FlareError, KeyedValueError, short

# The modules that register the built-in parts (imported on the first lookup of any registry).
BUILTIN_MODULES = ("flare.models", "flare.schedules", "flare.data.datasets", "flare.data.features", "flare.data.partition",
                   "flare.data.scaling", "flare.client.terms.align", "flare.client.lam", "flare.client.surgery",
                   "flare.client.objective", "flare.client.terms.banks", "flare.client.terms.extra",
                   "flare.client.trainer", "flare.client.batched", "flare.server.rules", "flare.baselines")
ENTRY_POINT_GROUP = "flare.plugins"
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def boolean_number(model: type[BaseModel], field: str, value: Any) -> str | None:
    """Why `value` cannot be `model`'s field `field`: a boolean where the field holds a number (int or float,
    `X | None` included), which pydantic would read as 1 or 0 — `rounds: true` is a slip, not a number. None when
    it can (or `field` is not one of `model`'s). The one rule for the config's sections and every part's options."""
    info = model.model_fields.get(field) if isinstance(value, bool) else None
    if info is None:
        return None
    ann = info.annotation
    args = typing.get_args(ann) if typing.get_origin(ann) in (typing.Union, types.UnionType) else (ann,)
    if int in args:
        return "a boolean is not an integer; give a whole number"
    if float in args:
        return "a boolean is not a number; give a number"
    return None


FLOAT32_MAX = 3.4028234663852886e38  # a float option reaches the float32 tensors of a run


def nonfinite(value: Any) -> bool:
    """NaN, ±inf, or beyond float32's range (1e308 is a finite float, and an overflow in the first float32 op)."""
    return isinstance(value, float) and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX)


def nonfinite_option(model: BaseModel) -> str | None:
    """The first float option of a validated `model` that is `nonfinite`, unless its field says it may
    (`Field(allow_inf_nan=True)`): an infinite learning rate or temperature passes a `gt=0` bound and fails only
    after the clients have trained, so every part's options are finite unless they say otherwise."""
    for name, info in type(model).model_fields.items():
        value = getattr(model, name, None)
        allowed = any(getattr(m, "allow_inf_nan", None) for m in info.metadata)
        if not allowed and any(map(nonfinite, value if isinstance(value, (list, tuple)) else [value])):
            return name
    return None


# Every seed a config or a part's options take: numpy's generators and scikit-learn's random_state take an unsigned
# 32-bit seed and fail with a traceback on anything else, so the bound is checked with the config.
Seed = Annotated[int, Field(ge=0, lt=2 ** 32)]


@dataclass(frozen=True)
class NoFacts:
    """The facts of a kind whose parts need nothing of the run (schedules, surgery, loss terms): options alone."""


class TermOptions(BaseModel):
    """The options every loss term has (`loss.terms.<name>.weight`); a term's own options model subclasses this."""

    model_config = ConfigDict(extra="forbid")
    weight: float = 1.0


# A check of the validated Config (typed Any: the config module sits above this one); raises a FlareError naming the
# key when the config cannot serve the part.
CheckFn = Callable[[Any], None]
_DECORATE = object()  # register(name) without an object: a decorator (None is a part: e.g. anchors "none")


@dataclass(frozen=True)
class Entry:
    name: str
    obj: Any
    options: type[BaseModel] | None
    description: str
    checks: tuple[CheckFn, ...] = ()  # the part's own `check` attribute, then the `check=` it was registered with
    module: str = ""  # where `obj` was defined: error messages name a plugin's module

    @property
    def plugin(self) -> str | None:
        """The module of a part that did not come with FLARE (a plugin's), else None."""
        return None if not self.module or self.module.split(".")[0] == "flare" else self.module


@dataclass(frozen=True)
class Namespace:
    """Names `prefix<name>` a library's catalogue answers (`Registry.add_namespace`)."""
    prefix: str
    names: Callable[[], list[str]]
    entry: Callable[[str], Entry]
    description: str


class Registry:
    """Named parts of one kind. `key` is the config key that picks a part of this kind (used in error messages);
    `signature` says what an entry is: a Protocol class, or `"module:Name"` naming one in a module above this one
    (imported on first use); `default_options` is the options model of the entries that declare none (loss terms:
    `TermOptions`, every term has a weight)."""

    def __init__(self, kind: str, key: str, signature: type | str | None, facts: type | str | None,
                 default_options: type[BaseModel] | None = None):
        self.kind, self.key, self.default_options = kind, key, default_options
        self._signature, self._facts = signature, facts
        self._entries: dict[str, Entry] = {}
        self._spaces: dict[str, Namespace] = {}

    @property
    def signature(self) -> type:
        """The Protocol the entries follow, imported from the module that declares it when named as a string."""
        if isinstance(self._signature, str):
            module, _, name = self._signature.partition(":")
            self._signature = getattr(importlib.import_module(module), name)
        return self._signature

    @property
    def facts(self) -> type | None:
        """The frozen dataclass of the run facts an entry is built from (`create`), declared beside the Protocol
        (named by its name in the Protocol's module, or given as a class); None: its entries are not built here."""
        if isinstance(self._facts, str):
            self._facts = getattr(sys.modules[self.signature.__module__], self._facts)
        return self._facts

    def register(self, name: str, obj: Any = _DECORATE, *, options: type[BaseModel] | None = None,
                 description: str = "", check: CheckFn | None = None, overwrite: bool = False):
        """Register `obj` under `name` (None may stand for "no such part", e.g. anchors `none`); without `obj`, a
        decorator. `check(cfg)` raises a FlareError for a config the part cannot serve (run when the config is
        validated, with the `check` attribute the object may carry itself). A taken name raises unless
        `overwrite=True`."""
        if obj is _DECORATE:
            return lambda o: self.register(name, o, options=options, description=description, check=check,
                                           overwrite=overwrite)
        if not isinstance(name, str) or not name:
            raise FlareError(f"a {self.kind} needs a non-empty string name, got {name!r}.", key=self.key)
        if options is not None and not (isinstance(options, type) and issubclass(options, BaseModel)):
            raise FlareError(f"{self.kind} '{name}': options must be a pydantic model class, got {options!r}.",
                             key=self.key)
        if check is not None and not callable(check):
            raise FlareError(f"{self.kind} '{name}': check must be a function of the config, got {check!r}.",
                             key=self.key)
        if name in self._entries:
            if not overwrite:
                raise FlareError(f"{self.kind} '{name}' is already registered.", key=self.key,
                                 fix="choose another name, or pass overwrite=True to replace it on purpose.")
            warnings.warn(f"{self.kind} '{name}' replaced by a new registration (overwrite=True).", stacklevel=2)
        doc = (getattr(obj, "__doc__", None) or "").strip().splitlines()
        own = getattr(obj, "check", None)
        checks = tuple(c for c in (own if callable(own) else None, check) if c is not None)
        self._entries[name] = Entry(name, obj, options, description or (doc[0] if doc else ""), checks,
                                    getattr(obj, "__module__", None) or "")
        return obj

    def add_namespace(self, prefix: str, *, names: Callable[[], list[str]], entry: Callable[[str], Entry],
                      description: str) -> None:
        """Serve every `prefix<name>` from a library's own catalogue (e.g. `timm/<any timm architecture>`) instead
        of registering its names one by one: `names()` gives the names after the prefix and may import the library
        (so it runs on the first such lookup, never at registration), `entry(rest)` builds the part."""
        self._spaces[prefix] = Namespace(prefix, names, entry, description)

    def _space(self, name: object) -> tuple[Namespace, str] | None:
        """The namespace a name that nobody registered falls in, and the name after its prefix."""
        if isinstance(name, str) and name not in self._entries:
            for ns in self._spaces.values():
                if name.startswith(ns.prefix):
                    return ns, name[len(ns.prefix):]
        return None

    def __contains__(self, name: object) -> bool:
        load_builtins()
        if (hit := self._space(name)) is not None:
            return hit[1] in hit[0].names()
        return name in self._entries

    def names(self) -> list[str]:
        load_builtins()
        return list(self._entries)

    def describe(self) -> list[tuple[str, str]]:
        """(name, description) of every registered part, in registration order, then one row per namespace."""
        load_builtins()
        return [(e.name, e.description) for e in self._entries.values()] + self.namespaces()

    def namespaces(self) -> list[tuple[str, str]]:
        """(`prefix<any of N names>`, description) of every namespace; `prefix<name>` when its library is missing."""
        rows = []
        for ns in self._spaces.values():
            try:
                rows.append((f"{ns.prefix}<any of {len(ns.names())} names>", ns.description))
            except FlareError as e:
                rows.append((f"{ns.prefix}<name>", f"{ns.description} ({e.message})"))
        return rows

    def call_signature(self) -> str:
        """What an entry is, as one line (`flare parts`): the Protocol's call, or its attributes."""
        call = self.signature.__dict__.get("__call__")
        if call is not None:
            sig = inspect.signature(call)
            sig = sig.replace(parameters=list(sig.parameters.values())[1:])  # without self
            return "fn" + str(sig).replace("'", "")  # the annotations are strings (postponed evaluation)
        fields = ", ".join(f"{n}: {t}" for n, t in self.signature.__annotations__.items())
        return f"an object with {fields}"

    def option_rows(self, name: str) -> list[tuple[str, str, str]]:
        """(option, type, default) of every option the part takes (`flare parts`)."""
        model = self.entry(name).options or self.default_options
        if model is None:
            return []
        rows = []
        for opt, f in model.model_fields.items():
            t = f.annotation.__name__ if isinstance(f.annotation, type) else str(f.annotation).replace("typing.", "")
            default = "required" if f.is_required() else (
                repr(f.default) if f.default is not PydanticUndefined else "(computed)")
            rows.append((opt, t, default))
        return rows

    def unknown(self, name: object, key: str | None = None, also: tuple[str, ...] = ()) -> str:
        """The message for a name nobody registered: the key, the close matches, the registered names (and the
        other words the key accepts, `also`)."""
        return f"unknown {self.kind} {short(name)} for {key or self.key}{self._hint(name, also)}; {self._choices(also)}"

    def _hint(self, name: object, also: tuple[str, ...] = ()) -> str:
        hit = self._space(name)
        names = [hit[0].prefix + n for n in hit[0].names()] if hit else [*also, *self.names()]
        close = difflib.get_close_matches(str(name), names, n=3)
        return f" (did you mean {', '.join(close)}?)" if close else ""

    def _choices(self, also: tuple[str, ...] = ()) -> str:
        words = f"{' or '.join(also)} or " if also else ""
        spaces = "".join(f", {ns.prefix}<name> ({ns.description})" for ns in self._spaces.values())
        return (f"{words}registered: {', '.join(self.names()) or '(none)'}{spaces} (`flare parts` lists every part; a "
                "plugin's parts need its module in `plugins`)")

    def entry(self, name: str, key: str | None = None) -> Entry:
        load_builtins()
        if (hit := self._space(name)) is not None and hit[1] in hit[0].names():
            return hit[0].entry(hit[1])
        if name not in self._entries:
            raise FlareError(f"unknown {self.kind} {short(name)}{self._hint(name)}.", key=key or self.key,
                             fix=f"use a {self._choices()}.")
        return self._entries[name]

    def get(self, name: str, key: str | None = None) -> Any:
        """The registered object, or a FlareError naming `key` and listing the registered names."""
        return self.entry(name, key).obj

    def create(self, name: str, facts: Any, options: BaseModel | dict | None = None, key: str | None = None,
               where: str | None = None) -> Any:
        """`obj(facts, options)`: the part `name` built once for a run, a built-in as a plugin's (timm's
        `create_model`) — the one way any part is built. `facts`: the run facts the kind needs (`self.facts`, a
        frozen dataclass beside its Protocol), never the Config, so a part depends on no key it does not declare;
        `options`: a mapping validated here by the part's model (errors under `where`), or a model the config
        validated. `key` blames an unknown name (the registry's own key); a None entry builds None."""
        if self.facts is None or not isinstance(facts, self.facts):
            raise TypeError(f"{self.kind} '{name}' is built from {getattr(self.facts, '__name__', 'nothing')}, got "
                            f"{type(facts).__name__}")
        obj, where = self.get(name, key), where or self.key.rsplit(".", 1)[0] + ".options"
        opts = options if isinstance(options, BaseModel) else self.options(name, options, where)
        return obj(facts, opts) if obj is not None else None

    def check(self, name: str, cfg: Any) -> None:
        """Run the part's checks on the whole config (each raises a FlareError naming the key at fault)."""
        for fn in self.entry(name).checks:
            fn(cfg)

    def options(self, name: str, mapping: dict | None, key: str) -> BaseModel | None:
        """The part's options validated from `mapping` (None when it declares none, the registry has no default
        model, and none are given); errors name `<key>.<option>`. Raises KeyedValueError, a ValueError that
        carries the key, so the config reports it like any other bad value."""
        model = self.entry(name).options or self.default_options  # an unknown name is refused first
        mapping = mapping or {}
        if not isinstance(mapping, dict):
            raise KeyedValueError(key, f"{key} must be a mapping of option: value, got {short(mapping)}")
        if model is None:
            if mapping:
                raise KeyedValueError(key, f"{key}: {self.kind} '{name}' takes no options, got {sorted(mapping)}")
            return None
        for option, value in mapping.items():
            if why := boolean_number(model, option, value):
                raise KeyedValueError(f"{key}.{option}", f"{key}.{option}={short(value)}: {why}")
        try:
            opts = model.model_validate(mapping)
        except ValidationError as err:
            e = err.errors()[0]
            where = ".".join([key, *(str(x) for x in e["loc"])])
            raise KeyedValueError(where, f"{where}={short(e.get('input'))}: {e['msg']}") from None
        if (bad := nonfinite_option(opts)) is not None:
            raise KeyedValueError(f"{key}.{bad}", f"{key}.{bad}={getattr(opts, bad)!r}: give a finite number "
                                  f"(within ±{FLOAT32_MAX:.3g})")
        return opts


MODELS = Registry("model", "model.name", "flare.models:ModelBuilder", "ModelFacts")
DATASETS = Registry("dataset", "dataset.name", "flare.data.datasets:DatasetSource", "DatasetFacts")
PARTITIONS = Registry("partition", "partition.kind", "flare.data.partition:PartitionFn", "PartitionFacts")
# The reference code's draw of a partition kind, used instead of the kind's own with partition.rng=legacy.
REFERENCE_PARTITIONS = Registry("reference partition draw", "partition.kind", "flare.data.partition:PartitionFn",
                                "PartitionFacts")
ANCHORS = Registry("anchor kind", "align.anchors", "flare.client.terms.align:AnchorFn", "AnchorFacts")
SCALINGS = Registry("input scaling", "augment.input_scaling", "flare.data.scaling:ScalingFn", "ScalingFacts")
LAM_PROVIDERS = Registry("λ provider", "lam.learner", "flare.client.lam:LamProviderBuilder", "LamFacts")
SCHEDULES = Registry("schedule", "align.schedule", "flare.schedules:ScheduleFn", NoFacts)
PROGRESS = Registry("progress", "progress", "flare.schedules:ProgressFn", "ProgressFacts")
SURGERY = Registry("gradient surgery", "align.surgery", "flare.client.surgery:SurgeryFn", NoFacts)
CONTRAST = Registry("contrast bank", "loss.contrast", "flare.client.terms.banks:ContrastBankFn", "BankFacts")
OBJECTIVES = Registry("local objective", "loss.objective", "flare.client.objective:ObjectiveFn", "ObjectiveFacts")
LOSS_TERMS = Registry("loss term", "loss.terms", "flare.client.terms.extra:LossTermFn", NoFacts,
                      default_options=TermOptions)
STRATEGIES = Registry("server strategy", "server.primary", "flare.server.strategy:StrategyClass", "StrategyFacts")
# The client engines (`client_engine`, a closed choice: not a plugin point, so not in REGISTRIES, and not built
# here — the runner runs the one named): each engine's class states what it cannot run with `check(cfg)`, which the
# config's validation calls; nothing else is read of it, so it declares no signature and no facts.
CLIENT_ENGINES = Registry("client engine", "client_engine", None, None)
REGISTRIES = {"models": MODELS, "datasets": DATASETS, "partitions": PARTITIONS,
              "reference-partitions": REFERENCE_PARTITIONS, "input-scalings": SCALINGS, "anchors": ANCHORS,
              "lam-providers": LAM_PROVIDERS, "schedules": SCHEDULES, "progress": PROGRESS, "surgery": SURGERY,
              "contrast": CONTRAST,
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


def load_plugins(modules: object, key: str = "plugins") -> list[str]:
    """Import the config's `plugins` (module names) before the rest of the config is validated; returns them.
    `key`: what the user wrote them as (`plugins` in a config, `--plugin` on the command line), for the errors."""
    load_builtins()
    if modules is None:
        return []
    if not isinstance(modules, (list, tuple)) or not all(isinstance(m, str) for m in modules):
        raise FlareError(f"plugins must be a list of module names, got {short(modules)}.", key=key,
                         fix="write e.g. plugins: [my_pkg.my_methods].")
    example = "--plugin my_methods" if key.startswith("--") else "plugins: [my_methods]"
    for m in modules:
        if not m.strip():
            raise FlareError("a plugin module name is empty.", key=key,
                             fix=f"give the dotted module name, e.g. {example} for my_methods.py on PYTHONPATH.")
        if not _MODULE_NAME.match(m):
            raise FlareError(f"plugin '{m}' looks like a file path, not a module name.", key=key,
                             fix="put its folder on PYTHONPATH (or install it) and write the dotted module name, "
                                 f"e.g. {example} for my_methods.py.")
    _log([m for m in modules if _import_plugin(m, lambda m=m: importlib.import_module(m), "plugin module", key)])
    return list(modules)


def _log(new: list[str]) -> None:
    """One line on stderr naming the plugin modules this call imported (the CLI's `flare: ...` style)."""
    if new:
        print(f"flare: loaded plugin module{'s' if len(new) > 1 else ''} {', '.join(new)}", file=sys.stderr)


def _import_plugin(module: str, load: Callable[[], object], what: str, key: str = "plugins") -> bool:
    """Import a plugin once per process; True when this call imported it."""
    if module in LOADED_PLUGINS:
        return False
    try:
        load()
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise FlareError(f"{what} '{module}' cannot be found (no module named {e.name!r}).", key=key,
                             fix="check its spelling, and put its folder on PYTHONPATH or install its "
                                 "package.") from None
        raise FlareError(f"{what} '{module}' failed to import: {e}.", key=key,
                         fix="install what it needs, or fix the plugin.") from None
    except FlareError as e:  # the plugin's own message and fix, said once
        where = f"{e.key}: " if e.key else ""
        raise FlareError(f"{what} '{module}' failed to import: {where}{e.message}", key=key,
                         fix=e.fix or "fix the plugin.") from None
    except Exception as e:  # noqa: BLE001 — a broken plugin is the user's mistake, reported without a traceback
        raise FlareError(f"{what} '{module}' raised on import: {type(e).__name__}: {e}.", key=key,
                         fix="fix the plugin (import it in Python to see the traceback).") from None
    LOADED_PLUGINS.append(module)
    return True
