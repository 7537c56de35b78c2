"""Building a config: presets, protocols, the layering defaults <- protocol <- preset <- file <- overrides, and error
messages.

A *method* is nothing but a preset: a few lines of YAML in `flare/presets/` that pick the composable parts
(objective, anchors, schedule, λ learner, gradient surgery, server rules). A *protocol* other than `clean` (the
schema's defaults) is the same kind of data: a YAML file in `flare/protocols/` of the keys it sets (its items),
layered under the preset, so that a key the preset, the file or an override sets wins — FedETF's preset keeps its
logit ensemble under either protocol, and a run's config.yaml, which holds every key, reloads as it ran. Every
mistake becomes a `FlareError` that names the key and the fix (the CLI prints it, exit code 2)."""
from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import re
import typing
from collections.abc import Hashable
from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from flare.config.schema import RENAMED, RENAMED_VALUES, Config
from flare.errors import FlareError, KeyedValueError, short
from flare.records import config_differences, flatten, get_key, set_key
from flare.registry import STRATEGIES


class DuplicateKey(yaml.YAMLError):
    def __init__(self, key, first: int, again: int):
        super().__init__(f"duplicate key {key!r} (lines {first} and {again})")
        self.key, self.first, self.again = key, first, again


class TooLarge(yaml.YAMLError):
    def __init__(self, values: int):
        super().__init__(f"it expands to more than {MAX_VALUES:,} values ({values:,} counted so far): its aliases "
                         "(*name) repeat anchored values (&name) inside each other")


MAX_VALUES = 100_000  # values a document may expand to; a config holds hundreds


def expanded_size(root: yaml.Node) -> int:
    """How many values the document under `root` holds once every alias is expanded, counted on the composed node
    graph (where an alias is a second reference to one node), stopping past MAX_VALUES: PyYAML expands aliases
    without bound, so a few lines of nested aliases (a "billion laughs") become gigabytes wherever the value is
    walked or echoed. Written here because PyYAML has no such limit."""
    size: dict[int, int] = {}
    stack = [(root, False)]
    while stack:  # post-order without recursion: a deeply nested document must not exhaust the stack
        node, children_done = stack.pop()
        if id(node) in size:
            continue
        kids = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else (
            node.value if isinstance(node, yaml.SequenceNode) else [])
        if children_done or not kids:
            size[id(node)] = total = 1 + sum(size[id(k)] for k in kids)
            if total > MAX_VALUES:
                raise TooLarge(total)
        else:
            stack.append((node, True))
            stack.extend((k, False) for k in kids if id(k) not in size)
    return size[id(root)]


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load keeps the last of two equal keys without a word; a config that says `rounds: 5` and later
    `rounds: 50` is a mistake to report, not to guess at. A document that expands past MAX_VALUES is refused before
    it is built (`expanded_size`)."""

    def construct_document(self, node):
        expanded_size(node)
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise DuplicateKey(key, seen[key] + 1, key_node.start_mark.line + 1)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_yaml_text(text: str):
    """YAML with every mapping's keys unique (else DuplicateKey naming the key and both lines)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


# ----------------------------------------------------------------------------------------------
# presets


# How reports draw a preset's runs (`label`, `color`): read by the reports through `preset_metadata`, never part of
# a run's config, so a new preset brings its own label and colour and a run's config.yaml holds only what it ran.
PRESET_METADATA = ("label", "color", "order")  # how reports show a method; not part of its config


def _preset_dir():
    return resources.files("flare") / "presets"


@functools.cache
def _parsed_presets() -> dict[str, dict]:
    """The package's preset files never change while a process runs: parsed once, not on every config built (a
    sweep builds one per point; parsing every preset was nearly all of `load_config`'s time)."""
    return {f.name[:-5]: load_yaml_text(f.read_text()) or {}
            for f in sorted(_preset_dir().iterdir(), key=lambda p: p.name) if f.name.endswith(".yaml")}


def list_presets() -> dict[str, dict]:
    """name -> the preset's YAML mapping (with its description and the notes' V-number); the caller's own copy."""
    return copy.deepcopy(_parsed_presets())


def preset_mapping(name: str) -> dict:
    presets = list_presets()
    if name not in presets:
        close = difflib.get_close_matches(name, presets, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise FlareError(f"unknown preset '{name}'.{hint}", key="preset",
                         fix=f"use one of: {', '.join(presets)} (`flare presets` lists them).")
    m = {k: v for k, v in presets[name].items() if k not in PRESET_METADATA}
    m.setdefault("method", name)
    m["preset"] = name
    return m


def preset_metadata(name: str) -> dict:
    """The report metadata (`PRESET_METADATA`) of preset `name`; {} for a name no preset has (a plugin's method)."""
    m = _parsed_presets().get(name, {})
    return {k: m[k] for k in PRESET_METADATA if k in m}


@functools.cache
def parsed_protocols() -> dict[str, dict]:
    """name -> the overlay of protocol `name` ({dotted key: value}, maybe with a `when` table), from flare/protocols/."""
    return {f.name[:-5]: load_yaml_text(f.read_text()) or {}
            for f in (resources.files("flare") / "protocols").iterdir() if f.name.endswith(".yaml")}


def protocol_overlay(mapping: dict) -> dict:
    """{dotted key: value} of every item the mapping's `protocol` sets, its `when` tables resolved against the
    mapping; {} for `clean` (and for a name no file has, which the schema then refuses).

    Why `when`, and why as data: some items' reference values depend on another key (the reference code changed
    between the notes' two batches of runs and the partition says which batch a setting belongs to; the λ learner
    says how its progress was logged). `when: {KEY: {VALUE: items}}` layers the items given for KEY's value (its
    default when nothing sets it), in the file's order, and items may hold a `when` of their own. One generic rule
    over data instead of a function per item: the notes' version labels stay in the overlay file, beside the
    evidence, and a new protocol is a new file."""
    name = mapping.get("protocol")
    return _resolve(parsed_protocols().get(name, {}) if isinstance(name, str) else {}, mapping)


def _resolve(overlay: dict, mapping: dict) -> dict:
    out = {k: v for k, v in overlay.items() if k != "when"}
    for key, by_value in (overlay.get("when") or {}).items():
        value = get_key(mapping, key, key_default(key))
        out.update(_resolve(by_value.get(value, {}) if isinstance(value, Hashable) else {}, mapping))
    return out


@functools.cache
def key_default(key: str):
    """What `key` is when no layer sets it: the schema's default, or a part's option's (read from a config validated
    with the sections around the key present and empty, which fills in the options' defaults)."""
    around: dict = {}
    if "." in key:
        set_key(around, key.rpartition(".")[0], {})
    return get_key(Config.model_validate(around).model_dump(mode="json"), key)


# ----------------------------------------------------------------------------------------------
# layering and validation


def deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_overrides(items: list[str]) -> dict:
    """`a.b=3 c=[1,2]` -> {'a': {'b': 3}, 'c': [1, 2]} (values parsed as YAML, every mapping's keys unique, as in a
    config file)."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise FlareError(f"override '{item}' is not of the form KEY=VALUE.", key=item,
                             fix="write e.g. partition.alpha=0.1")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise FlareError(f"override '{item}' has an empty key.", fix="write e.g. rounds=5")
        try:
            value = load_yaml_text(raw) if raw.strip() != "" else None
        except DuplicateKey as e:  # `model.clients={0: cnn, 0: wrn16_1}`: refused as in a config file
            raise FlareError(f"override {short(item)} sets the key {short(e.key)} twice; YAML would silently keep the "
                             "last.", key=key, fix="give each key once.") from None
        except TooLarge as e:
            raise FlareError(f"the value of override {short(key)}: {e}.", key=key, fix="write the value out.") from None
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise FlareError(f"override '{item}' conflicts with another override.", key=key)
        node[parts[-1]] = value
    return out


def parse_list(text: str, option: str, *, convert=str, duplicates: str = "refuse", example: str = "a,b") -> list:
    """A comma-separated command-line list (`--presets fafi,fedavg`), each element stripped and `convert`ed.

    Every list option of the CLI goes through here, so they all refuse the same things: an empty list, an empty
    element (`fafi,,fedavg` is a typo, never silently dropped), an element `convert` rejects, and a repeated element
    (`duplicates="refuse"`; `"drop"` keeps the first of each instead)."""
    items = [s.strip() for s in str(text).split(",")]
    if not any(items):
        raise FlareError("the list is empty.", key=option, fix=f"give a comma-separated list, e.g. {option} {example}.")
    if not all(items):
        pos = ", ".join(str(i + 1) for i, s in enumerate(items) if not s)
        raise FlareError(f"{text!r} has an empty element (position {pos}).", key=option,
                         fix=f"remove the extra comma, e.g. {option} {example}.")
    out = []
    for s in items:
        try:
            out.append(convert(s))
        except (TypeError, ValueError):
            raise FlareError(f"{text!r}: {s!r} is not a valid element.", key=option,
                             fix=f"write e.g. {option} {example}.") from None
    if len(set(out)) < len(out):
        if duplicates == "drop":
            return list(dict.fromkeys(out))
        raise FlareError(f"{text!r} names an element twice.", key=option, fix="list each element once.")
    return out


def _fields(model: type[BaseModel] = None, prefix: str = ""):
    """(dotted key, field) of every key of the schema, each section before the keys inside it."""
    for name, field in (model or Config).model_fields.items():
        yield prefix + name, field
        if _is_section(field.annotation):
            yield from _fields(field.annotation, prefix + name + ".")


def _is_section(ann) -> bool:
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def known_keys() -> list[str]:
    """Every dotted key of the schema (sections included)."""
    return [key for key, _ in _fields()]


def mapping_keys() -> list[str]:
    """The keys whose value is a free mapping (a part's `options`, `loss.terms`): the keys under them belong to the
    chosen parts and are validated by their options models."""
    return [key for key, field in _fields() if typing.get_origin(field.annotation) is dict]


def _explain(err: ValidationError) -> FlareError:
    """Turn pydantic's report into one paragraph that names the key and the fix."""
    lines, first_key, fix = [], None, None
    known = known_keys()
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"])
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, KeyedValueError):  # a cross-key check, a part name or a plugin option: its own key
            key = cause.key
        first_key = first_key or key
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(key, known, n=1)
            lines.append(f"unknown key '{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
            fix = fix or "remove it or correct its spelling; docs/configuration.md (or `flare config-reference`) lists every key."
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{msg}" if isinstance(cause, KeyedValueError) else f"{key}={short(e.get('input'))}: {msg}")
            fix = fix or "correct that value (docs/configuration.md gives types and ranges)."
    return FlareError("invalid configuration: " + "; ".join(lines) + ".", key=first_key, fix=fix)


def migrate(mapping: dict, refuse: bool = False) -> dict:
    """A copy of a recorded config (config.yaml, state.json, a checkpoint) with each renamed key moved to its new
    name and value, so a run recorded before a rename resumes, fuses and compares as the same experiment. `refuse`:
    a config given (file, preset, overrides) that writes an old key is refused, so it keeps one spelling."""
    out = copy.deepcopy(mapping)
    for old, new in RENAMED.items():
        section, _, name = old.rpartition(".")
        node = get_key(out, section) if section else out
        if isinstance(node, dict) and name in node:
            value = node.pop(name)
            value = RENAMED_VALUES.get(old, {}).get(value, value) if isinstance(value, (bool, int, str)) else value
            if refuse:
                raise FlareError(f"'{old}' was renamed to '{new}'.", key=old, fix=f"write {new}={value} instead.")
            set_key(out, new, value)
    return out


def build_config(mapping: dict) -> Config:
    """The config of a mapping (defaults <- preset <- file <- overrides) with its protocol's overlay under it."""
    migrate(mapping, refuse=True)
    below: dict = {}
    for key, value in protocol_overlay(mapping).items():
        set_key(below, key, value)
    try:
        return Config.model_validate(deep_merge(below, mapping))
    except ValidationError as err:
        raise _explain(err) from None


def read_yaml_mapping(path: str | Path, what: str = "config file", key: str = "--config") -> dict:
    """A YAML file holding a mapping, or a FlareError that says what is wrong with it (missing, a directory,
    not text, not YAML, not a mapping)."""
    path = Path(path)
    if path.is_dir():
        raise FlareError(f"{what} '{path}' is a directory, not a file.", key=key, fix="give the path of a YAML file.")
    if not path.is_file():
        raise FlareError(f"{what} '{path}' does not exist.", key=key, fix="give the path of a YAML file.")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise FlareError(f"{what} '{path}' is not a text file (it is not UTF-8).", key=key,
                         fix="give the path of a YAML file.") from None
    except OSError as e:
        raise FlareError(f"{what} '{path}' cannot be read: {e.strerror}.", key=key) from None
    try:
        mapping = load_yaml_text(text) or {}
    except DuplicateKey as e:
        raise FlareError(f"{what} '{path}' sets the duplicate key '{e.key}' twice (lines {e.first} and {e.again}); "
                         "YAML would silently keep the last.", key=key, fix="keep one of the two lines.") from None
    except TooLarge as e:
        raise FlareError(f"{what} '{path}' is refused: {e}.", key=key, fix="write the values out, or anchor smaller "
                                                                          "values.") from None
    except yaml.YAMLError as e:
        raise FlareError(f"{what} '{path}' is not valid YAML: {e}", key=key) from None
    if not isinstance(mapping, dict):
        raise FlareError(f"{what} '{path}' must hold a mapping of keys.", key=key)
    return mapping


def load_config(config_file: str | Path | None = None, preset: str | None = None,
                overrides: list[str] | dict | None = None) -> Config:
    """defaults <- protocol <- preset <- file <- overrides. The file may name a preset with `preset: NAME`."""
    file_map = read_yaml_mapping(config_file) if config_file is not None else {}
    ov = overrides if isinstance(overrides, dict) else parse_overrides(list(overrides or []))
    preset = preset or ov.get("preset") or file_map.get("preset")
    mapping = deep_merge(deep_merge(preset_mapping(preset) if preset else {}, file_map), ov)
    if preset:
        mapping["preset"] = preset
    return build_config(mapping)


def config_for_preset(base: dict, preset: str) -> Config:
    """The base mapping (user file + overrides) applied over a preset — `flare compare` and sweeps build each
    method's config this way, so every method shares the partition, seed and data."""
    m = deep_merge(preset_mapping(preset), {k: v for k, v in base.items() if k != "preset"})
    m["preset"] = preset
    return build_config(m)


def config_to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def config_reference() -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) for every key — docs/configuration.md's table is built from this."""
    rows, defaults = [], Config()
    for key, field in _fields():
        if _is_section(field.annotation):
            continue
        t = str(field.annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
        t = re.sub(r"Annotated\[(\w+), [^\]]*\]", r"\1", t)  # a part name inside a list: its plain type
        rows.append((key, t, repr(functools.reduce(getattr, key.split("."), defaults)), field.description or ""))
    return rows


def config_reference_markdown() -> str:
    """The table `flare config-reference` prints and docs/configuration.md embeds."""
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    rows += [f"| `{k}` | {t.replace('|', chr(92) + '|')} | `{d}` | {desc} |" for k, t, d, desc in config_reference()]
    return "\n".join(rows)


@functools.cache
def _default_values(strategies: tuple[str, ...]) -> dict:
    """The flattened default config and each strategy's default options: a strategy left out of
    `server.strategies` runs with them, so a config that spells them out is the same experiment."""
    out = flatten(Config().model_dump(mode="json"))
    for name in strategies:
        with contextlib.suppress(ValueError):  # an option without a default: nothing to assume
            opts = STRATEGIES.options(name, None, name)
            out.update(flatten(opts.model_dump(mode="json"), f"server.strategies.{name}.") if opts else {})
    return out


def experiment_differences(old: dict, new: dict | Config) -> list[str]:
    """The dotted keys in which a recorded config `old` and `new` (renamed keys migrated) describe different
    experiments. A key added to the schema after `old` was recorded counts only where `new` moves it off its default
    (the behaviour that existed before the key), so a new option never strands a half-finished run."""
    new = new.model_dump(mode="json") if isinstance(new, Config) else new
    return config_differences(migrate(old or {}), migrate(new or {}), _default_values(tuple(STRATEGIES.names())))
