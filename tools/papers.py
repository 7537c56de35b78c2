"""Other papers' tables at their own settings (docs/papers.md): run the cells, keep their records, render the
comparison with the published numbers.

    python tools/papers.py run configs/papers/fedlpa-fmnist.yaml [--commit] [--runs runs/papers] [--dry-run]
                                                                 [--set KEY=VALUE ...] [--results results/papers]
    python tools/papers.py progress configs/papers/T.yaml [--commit]   # how far unfinished fusions got, recorded
    python tools/papers.py progress configs/papers/T.yaml --stopped "WHY" [--commit]   # their state is gone
    python tools/papers.py render                    # rewrite docs/papers.md's "Against the published numbers"
    python tools/papers.py render --check            # exit 1 if the committed block differs from the records

A table file (configs/papers/*.yaml) names the base config, the methods (a preset, overrides and the server
strategies scored afterwards with `flare fuse`), the α and seed grid, the columns and the paper's printed numbers.
Its keys are a schema (`Table`, docs/papers.md "Table files"), checked as FLARE checks a config before anything
runs: an unknown key, a value of the wrong type or range, an `extends` cycle, or a cell FLARE would refuse stops
the command with exit 2 and one paragraph naming the file, the key and the fix, before anything is written.
A cell is one method at one (α, seed): one `flare run` into runs/papers/<table>/<cell> — rerunning resumes an
unfinished one, a finished one is not recomputed — then `flare fuse` for its strategies (already fused ones are
skipped; an interrupted data-free fuse goes on from its last finished epoch). Cells run one at a time. A finished
cell's records (config, partition, metrics, fuse records, state, summary; never a checkpoint) are copied to
results/papers/<table>/<cell>/ with the table's spec beside them, and `--commit` commits that directory alone.
The spec keeps the seeds the table file gave at each α when its first cell there was recorded (`registered_seeds`):
those are the draws the block tests, and `run` refuses a table file that adds seeds at a recorded α (a new `table`
name is a new experiment). `render` reads results/papers/ and the runs of the papers' own code under
results/papers-reference/ (`reference_runs`) only. A command with nothing to do (every cell recorded; `--fuse-only` with no
recorded clients to fuse over; `progress` with no unfinished fusion) says what is missing and exits 2.
"""

import argparse
import difflib
import json
import math
import re
import shutil
import subprocess
import sys
import time
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import numpy as np
import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, Discriminator, Field, Tag, ValidationError,
                      ValidationInfo, field_validator, model_validator)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from flare.config.load import (build_config, experiment_differences, load_config, parse_overrides,  # noqa: E402
                               preset_mapping, read_yaml_mapping)
from flare.config.sections import Strict  # noqa: E402
from flare.errors import FlareError, KeyedValueError, check_path  # noqa: E402
from flare.registry import STRATEGIES  # noqa: E402
from flare.stats import mean_ci  # noqa: E402

RESULTS = ROOT / "results" / "papers"
REFERENCE = ROOT / "results" / "papers-reference"  # runs of the papers' own code (benchmarks/reference_*.py)
DOC = ROOT / "docs" / "papers.md"
RECORDS = ("config.yaml", "partition.json", "metrics.jsonl", "fuse.jsonl", "state.json", "summary.md")
PROGRESS = "fuse-progress.json"  # how far an unfinished data-free fusion has got (`progress`): curve, no weights
BEGIN, END = "<!-- BEGIN published -->", "<!-- END published -->"
KEYS_DOC = 'docs/papers.md, "Table files"'


# ------------------------------------------------------------------------------------------------ the table file
def _number(value: Any) -> Any:
    """A number inside a list or a mapping: a boolean is refused there as `Strict` refuses it in a field (YAML
    writes `yes`, `on` and `true` alike, and pydantic would read them as 1)."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number; give a number")
    return value


def _unique(values: list) -> list:
    """A list whose repeats are a slip (an α or a seed given twice would run one cell twice under one name)."""
    if len(set(values)) < len(values):
        raise ValueError(f"{values} names an element twice; give each once")
    return values


def _one_of(shapes: dict[str, Any], what: str) -> Any:
    """A key that takes a list or a mapping (`seeds`, `paired_with`, a pairing's `columns`), validated as the shape
    given: an error then speaks of that shape alone, not of every shape the key could have taken."""
    def shape(value: Any) -> str | None:
        return "list" if isinstance(value, list) else "mapping" if isinstance(value, dict) else None
    return Annotated[Union[tuple(Annotated[t, Tag(k)] for k, t in shapes.items())],
                     Discriminator(shape, custom_error_type="shape", custom_error_message=f"give {what}")]


NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
Name = Annotated[str, Field(pattern=NAME)]                               # it names a directory: no '/', no space
Alpha = Annotated[float, BeforeValidator(_number), Field(gt=0)]          # a Dirichlet concentration
Seed = Annotated[int, BeforeValidator(_number), Field(ge=0)]             # the legacy RandomState takes no negative
Percent = Annotated[float, BeforeValidator(_number), Field(ge=0, le=100)]
Seeds = Annotated[list[Seed], Field(min_length=1), AfterValidator(_unique)]


class FixedKeyError(KeyedValueError):
    """A cross-key refusal that knows its own fix, where the generic "correct that value" would send the reader the
    wrong way (more draws at a recorded α are not a wrong value but another experiment)."""

    def __init__(self, key: Any, message: str, fix: str):
        super().__init__(key, message)
        self.fix = fix


class UnknownKey(ValueError):
    def __init__(self, name: Any, close: list[str]):
        super().__init__(f"unknown key {name!r}")
        self.name, self.close = name, close


class Section(Strict):
    """A table file's section. A key it does not have is refused with the nearest key of this section — pydantic's
    own refusal (Strict's extra="forbid") says nothing of what was meant, and `fuse_option:` for `fuse_options:`
    would otherwise be a DENSE at its full published budget."""

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        for name in data if isinstance(data, dict) else ():
            if name not in cls.model_fields:
                raise UnknownKey(name, difflib.get_close_matches(str(name), cls.model_fields, n=1))
        return data


class Column(Section):
    """A printed column: one value of each cell of one method, and the rule the paper chose it by."""

    method: Name = Field(description="the method (a key of `methods`) whose cells the column reads")
    key: str = Field(pattern=r"^(acc\w*|fuse:[\w.-]+)$",
                     description="the value: a round record's accuracy (`acc`, `acc_fedavg`, `acc_output`, ...) or "
                                 "`fuse:<server>`, a server of the method's `fuse`")
    paper_rule: Literal["final", "peak"] = Field(
        "final", description="the paper's selection: `final` (the last round's model, or the fused one) or `peak` "
                             "(the best evaluated round on the test set; a data-free server's best epoch)")


class Method(Section):
    """One client training run per (α, seed), and the servers scored over its clients afterwards."""

    preset: str = Field(description="the FLARE preset (`flare presets`) the method's cells start from")
    label: str | None = Field(None, description="the method's name as the paper prints it (kept with the table "
                                                "file; the block names columns, not methods)")
    fuse: Annotated[list[str], AfterValidator(_unique)] = Field(
        [], description="server strategies scored over the cells' clients with `flare fuse` after training")
    fuse_options: dict[str, dict[str, Any]] = Field(
        {}, description="per server of `fuse`: options given to `flare fuse` (`server.strategies.<server>.<option>`)"
                        " — the server's budget, never the clients'; checked against the server's options")
    config: dict[str, Any] = Field({}, description="FLARE config keys over `base` for this method's cells "
                                                   "(checked as `flare run` checks them)")

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, name: str) -> str:
        try:
            preset_mapping(name)
        except FlareError as e:
            raise ValueError(f"{e.message} {e.fix}") from None
        return name


class Pairing(Section):
    """Differences seed by seed between this table's columns and another recorded table's (or its own)."""

    table: Name = Field(description="the other table's `table` name (this table's own: a pairing within it)")
    columns: _one_of({"list": list[str], "mapping": dict[str, str]},
                     "a list of the other table's columns or a mapping of this table's column → the other's") = Field(
        description="a list of the other table's columns (each paired with every column of this table), or a "
                    "mapping of this table's column → the other table's")


class Table(Section):
    """A table file: the grid of cells, how each is configured and fused, and what the block prints of them."""

    extends: str | None = Field(None, description="a table file beside this one to start from: `base` and "
                                "`methods` merge key by key, every other key replaces, a method given as null is "
                                "not run; the table must give its own `table` name")
    table: Name = Field(description="the table's name: its cells run into `runs/papers/<table>/` and are "
                                    "recorded in `results/papers/<table>/`")
    paper: str | None = Field(None, description="the paper and table, as the block's heading prints it")
    note: str | None = Field(None, description="a note the block prints under the heading (a diagnostic says so)")
    alphas: Annotated[list[Alpha], Field(min_length=1), AfterValidator(_unique)] = Field(
        description="the Dirichlet α of each column group (`partition.alpha`), each > 0")
    seeds: _one_of({"list": Seeds, "mapping": dict[float, Seeds]},
                   "a list of seeds, or a mapping from each α to its list of seeds") = Field(
        description="the seeds run at every α, or a mapping α → seeds naming every α of `alphas`; registered when "
                    "the table's first cell at an α is recorded: `run` then refuses a seed added at that α (a new "
                    "`table` name is a new experiment)")
    spread: bool = Field(False, description="list every seed's value and their range beside the paper's number")
    base: dict[str, Any] = Field(description="FLARE config keys shared by every cell (checked as `flare run` "
                                             "checks them)")
    methods: Annotated[dict[Name, Method], Field(min_length=1)] = Field(
        description="the methods, by name (a cell is `<method>-a<α>-s<seed>`)")
    columns: dict[str, Column] = Field(description="the block's columns, by the name it prints")
    published: dict[str, dict[float, Percent | None]] = Field(
        {}, description="the paper's printed numbers (percent), column → α → value; null: printed but not found "
                        "in any source; a column left out is one the paper does not have")
    published_source: str | None = Field(None, description="where the published numbers were read, and how sure "
                                                           "that reading is")
    paired_with: _one_of({"mapping": Pairing, "list": list[Pairing]},
                         "a pairing (table, columns) or a list of them") | None = Field(
        None, description="pairings by seed with another table's columns (or this table's): one or a list")

    @model_validator(mode="after")
    def _keys_agree(self) -> "Table":
        """The keys that name each other: every name must be one the table has, or the column, number or
        pairing it belongs to would be silently empty."""
        if isinstance(self.seeds, dict) and set(self.seeds) != set(self.alphas):
            raise KeyedValueError(("seeds",), f"seeds given per α must name every α of alphas and no other "
                                              f"(alphas {self.alphas}, seeds for {list(self.seeds)})")
        for col, c in self.columns.items():
            if c.method not in self.methods:
                raise KeyedValueError(("columns", col, "method"), f"column {col} reads the method {c.method!r}, "
                                      f"which the table does not run{_close(c.method, self.methods)}")
            if c.key.startswith("fuse:") and c.key[5:] not in self.methods[c.method].fuse:
                raise KeyedValueError(("columns", col, "key"), f"column {col} reads the server {c.key[5:]!r}, "
                                      f"which {c.method} does not fuse (its fuse: {self.methods[c.method].fuse})")
        for col, by_alpha in self.published.items():
            if col not in self.columns:
                raise KeyedValueError(("published", col), f"published numbers for {col!r}, which is no column of "
                                      f"the table{_close(col, self.columns)}")
            for alpha in by_alpha:
                if alpha not in self.alphas:
                    raise KeyedValueError(("published", col, alpha), f"a published number at α = {alpha:g}, which "
                                          f"is not among the table's alphas {self.alphas}")
        pairings = (self.paired_with if isinstance(self.paired_with, list) else
                    [self.paired_with] if self.paired_with else [])
        for i, p in enumerate(pairings):
            where = ("paired_with", i) if isinstance(self.paired_with, list) else ("paired_with",)
            ours = list(p.columns) if isinstance(p.columns, dict) else []
            theirs = list(p.columns.values() if isinstance(p.columns, dict) else p.columns)
            for col in ours + (theirs if p.table == self.table else []):
                if col not in self.columns:
                    raise KeyedValueError((*where, "columns", col), f"the pairing names the column {col!r}, which "
                                          f"is no column of {self.table}{_close(col, self.columns)}")
        return self

    @model_validator(mode="after")
    def _draws_fixed(self, info: ValidationInfo) -> "Table":
        """The draws of a recorded α are the ones registered when its first cell was recorded (`registered` in the
        validation context: the records' `registered_seeds`). A seed added after looking at the first draws makes
        every test over them post hoc — a rank test reaches 0.05 at 19 draws, so extending 10 draws that fell short
        until it does is the garden of forking paths — so it is refused, and more draws are a new table."""
        registered = (info.context or {}).get("registered") or {}
        for alpha in self.alphas:
            reg = next((v for k, v in registered.items() if float(k) == float(alpha)), None)
            seeds = self.seeds[alpha] if isinstance(self.seeds, dict) else self.seeds
            added = [s for s in seeds if reg is not None and s not in reg]
            if added:
                raise FixedKeyError(
                    ("seeds", alpha) if isinstance(self.seeds, dict) else ("seeds",),
                    f"seeds at α = {alpha:g} add {seed_text(added)} to the draws {self.table} registered when its "
                    f"first α = {alpha:g} cell was recorded ({seed_text(reg)}): a table's draws are fixed before it "
                    "runs, and draws added after its first records make its tests post hoc",
                    f"give the table file a new `table:` name (a new pre-registered experiment; `extends:` this "
                    f"file keeps the rest of it), or restore the registered seeds ({seed_text(reg)}).")
        return self


def seed_text(seeds: typing.Iterable[int]) -> str:
    """Seeds as a reader scans them: runs of three or more consecutive seeds as a range (0–9), the rest listed."""
    seeds, parts, i = sorted(seeds), [], 0
    while i < len(seeds):
        j = i
        while j + 1 < len(seeds) and seeds[j + 1] == seeds[j] + 1:
            j += 1
        parts += [f"{seeds[i]}–{seeds[j]}"] if j - i >= 2 else [str(x) for x in seeds[i:j + 1]]
        i = j + 1
    return ",".join(parts)


def _close(name: str, names: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(str(name), list(names), n=1)
    return f" (did you mean '{close[0]}'?)" if close else f"; it has {', '.join(names) or 'none'}"


def table_keys() -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) of every key a table file may hold, each section before the keys inside it:
    docs/papers.md's "Table files" block is built from this (tools/readme.py), so it cannot fall behind the schema."""
    rows = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, f in model.model_fields.items():
            default = "required" if f.is_required() else "—" if f.default is None else f"`{json.dumps(f.default)}`"
            rows.append((prefix + name, _annotate(_type_text(f.annotation), f.metadata), default.replace('"', ""),
                         f.description or ""))
            for sub, suffix in dict(_sections(f.annotation)).items():
                walk(sub, f"{prefix}{name}{suffix}.")
    walk(Table, "")
    return rows


def table_keys_markdown() -> str:
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    rows += [f"| `{k}` | {t} | {d} | {m} |" for k, t, d, m in table_keys()]
    return "\n".join(rows) + "\n"


def _sections(ann: Any, suffix: str = "") -> list[tuple[type[BaseModel], str]]:
    """The sections (models) a key's type holds, each with the path from the key to it (`.<name>` per mapping)."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [(ann, suffix)]
    if origin is dict:
        return _sections(args[1], suffix + ".<name>")
    return [s for a in (args[:1] if origin is Annotated else args) for s in _sections(a, suffix)]


def _type_text(ann: Any) -> str:
    """A key's type read aloud, with the limits its annotation sets."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is Annotated:
        return _annotate(_type_text(args[0]), args[1:])
    if origin in (Union, types.UnionType):
        return " or ".join(_type_text(a) for a in args if a is not type(None)) + (
            " or null" if type(None) in args else "")
    if origin is list:
        return f"list of {_type_text(args[0])}"
    if origin is dict:
        return f"mapping {'α' if args[0] is float else 'name'} → {_type_text(args[1])}"
    if origin is Literal:
        return " or ".join(f"`{a}`" for a in args)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section"
    return {str: "text", float: "number", int: "whole number", bool: "true or false"}.get(ann, "any value")


def _annotate(text: str, metadata: typing.Iterable) -> str:
    """A type's text with the limits its metadata sets: a name's pattern, a number's bounds, a non-empty list."""
    limits, items = [], [i for m in metadata for i in getattr(m, "metadata", [m])]  # Field() carries its own
    for item in items:
        limits += [f"{sign} {getattr(item, attr):g}" for attr, sign in (("gt", ">"), ("ge", "≥"), ("le", "≤"))
                   if getattr(item, attr, None) is not None]
    if any(getattr(i, "pattern", None) == NAME for i in items):
        text = "name (letters, digits, `.`, `_`, `-`)"
    if any(getattr(i, "min_length", None) for i in items):
        text = f"non-empty {text}"
    return text + (f" ({', '.join(limits)})" if limits else "")


def load_table(path: str | Path, records: Path | None = None) -> dict:
    """A table file as a mapping, checked: its keys against `Table`, the files it extends (beside it) merged in,
    and each cell's FLARE config and fuse as `flare run` and `flare fuse` would check them — what they would refuse
    an hour into a table is refused before its first cell. With `records` (the records directory a command writes
    to), its seeds also against the draws registered there (`Table._draws_fixed`): only the table given, never a
    table it extends, whose records are another experiment's. A FlareError names the file, the key and the fix."""
    spec, chain = _resolve(Path(path), ())
    if records is not None:
        _validate(spec, chain, {"registered": registered_seeds(records / spec["table"] / "table.yaml")})
    _check_cells(spec, chain)
    return spec


def _resolve(path: Path, seen: tuple[Path, ...]) -> tuple[dict, list[tuple[Path, dict]]]:
    """The file's mapping with the tables it extends merged in and checked, and the files from it up the chain,
    each with what it wrote itself (to name the file an error is in). A variant of a table (a diagnostic at one
    setting changed) is the few keys it changes, never a copy: `base` and `methods` merge key by key (a cell's
    config), every other key replaces, and a method given as null is not run (a diagnostic of one method need
    not train the parent's others again)."""
    if path.resolve() in seen:
        loop = " → ".join(p.name for p in (*seen, path.resolve()))
        raise FlareError(f"table file {seen[-1]} extends itself through {loop}.", key="extends",
                         fix="extend a table that does not lead back to this one.")
    try:
        raw = read_yaml_mapping(path, "table file", "extends" if seen else None)
    except FlareError as e:  # YAML's message spans lines with a caret drawing: one paragraph here
        raise FlareError(" ".join(e.message.split()), key=e.key, fix=e.fix) from None
    spec, chain, parent = dict(raw), [(path, raw)], None
    if "extends" in spec:
        ext = spec.pop("extends")
        if not isinstance(ext, str) or not ext.strip():
            raise FlareError(f"table file {path}: extends={ext!r} is not a file name.", key="extends",
                             fix="give the name of the table file, beside this one, that this table starts from.")
        parent, up = _resolve(path.parent / ext, (*seen, path.resolve()))
        chain += up
        spec = {**parent, **spec}
        for k in ("base", "methods"):
            if isinstance(raw.get(k), dict):
                spec[k] = _merge(parent[k], raw[k])
        dropped = [m for m, v in raw["methods"].items() if v is None] if isinstance(raw.get("methods"), dict) else []
        for m in dropped:
            if m not in parent["methods"]:
                raise _error(chain, ("methods", m), f"methods.{m} is null, which drops a method of {ext}, and it has "
                             f"no method {m!r}{_close(m, parent['methods'])}", "name a method of the table it extends.")
            del spec["methods"][m]
    table = _validate(spec, chain)
    if parent is not None and table.table == parent["table"]:
        raise FlareError(f"table file {path} extends {parent['table']} without a `table` name of its own: its cells "
                         f"would be recorded as {parent['table']}'s.", key="table", fix="give it its own `table: NAME`.")
    for m, own in (raw.get("methods") or {}).items():  # each file's own server options: for servers fused there
        for s in (own or {}).get("fuse_options", {}):
            if s not in table.methods[m].fuse:
                raise _error(chain[:1], ("methods", m, "fuse_options", s), f"options for the server {s!r}, which "
                             f"{m} does not fuse (its fuse: {table.methods[m].fuse}): `flare fuse` would never get them",
                             f"add {s} to methods.{m}.fuse, or give the options under the server that is fused.")
    return spec, chain


def _validate(spec: dict, chain: list[tuple[Path, dict]], context: dict | None = None) -> Table:
    """`spec` as a `Table`, or pydantic's report as one paragraph naming the file, each key as the table file writes
    it and the fix (flare.config.load._explain's form, with the did-you-mean over the table files' keys)."""
    try:
        return Table.model_validate(spec, context=context)
    except ValidationError as err:
        lines, first, fix = [], None, None
        for e in err.errors():
            cause = (e.get("ctx") or {}).get("error")
            parts = (cause.key if isinstance(cause, KeyedValueError) else
                     _written((*e["loc"], cause.name) if isinstance(cause, UnknownKey) else e["loc"], spec, e["type"]))
            key = ".".join(map(str, parts))
            first = first or parts
            if isinstance(cause, UnknownKey):
                lines.append(f"unknown key '{key}'" + (f" (did you mean '{cause.close[0]}'?)" if cause.close else ""))
                fix = fix or f"remove it or correct its spelling ({KEYS_DOC}, lists every key)."
            elif e["type"] == "missing":
                lines.append(f"'{key}' is missing")
                fix = fix or f"add it ({KEYS_DOC}, says what it holds); a table that extends another takes it from there."
            else:
                msg = e["msg"].removeprefix("Value error, ")
                lines.append(msg if isinstance(cause, KeyedValueError) else f"{key}={e.get('input')!r}: {msg}")
                fix = fix or getattr(cause, "fix", None) or f"correct that value ({KEYS_DOC}, gives each key's type and range)."
        raise _error(chain, first, "; ".join(lines), fix) from None


def _written(loc: tuple, spec: dict, kind: str) -> tuple:
    """The key path of a pydantic error as the table file writes it: without the shape tags of a key that takes a
    list or a mapping (`seeds`, `paired_with`), and with a mapping's keys as written (α keys are numbers)."""
    parts, node = [], spec
    for i, x in enumerate(loc):
        if (entry := _entry(node, x)) is not None:
            parts.append(entry[0])
            node = entry[1]
        elif kind == "missing" and i == len(loc) - 1:
            parts.append(x)
    return tuple(parts)


def _holds(node: Any, parts: typing.Sequence) -> bool:
    """Whether a table file's mapping writes the key path `parts`."""
    for p in parts:
        if (entry := _entry(node, p)) is None:
            return False
        node = entry[1]
    return True


def _entry(node: Any, key: Any) -> tuple[Any, Any] | None:
    """The entry of a mapping or a list that a path element names, as (its key as written, its value); keys are
    compared as text, since pydantic and FLARE's keys give an α key (a number) as text."""
    if isinstance(node, dict):
        return next(((k, v) for k, v in node.items() if str(k) == str(key)), None)
    if isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
        return key, node[key]
    return None


def _error(chain: list[tuple[Path, dict]], parts: typing.Sequence, message: str, fix: str | None) -> FlareError:
    """A table file's error: the file given, and the file it extends that writes the key where that is another
    (the key may be right there and wrong only beside what the table given changes)."""
    path = next((p for p, raw in chain if _holds(raw, parts)), chain[0][0])
    where = "" if path == chain[0][0] else f" (the key is written in {path})"
    return FlareError(f"table file {chain[0][0]}{where}: {message}.", key=".".join(map(str, parts)), fix=fix)


def _check_cells(spec: dict, chain: list[tuple[Path, dict]]) -> None:
    """Every cell's FLARE config (base, preset, the method's config, α and seed) with its servers' options, and its
    servers, as `flare run` and `flare fuse` check them. The error names the table file's key: a server's option in
    `fuse_options`, a config key in the method's `config` or in `base` — the first that writes it — else the method,
    whose cells combine them."""
    for cell in cells(spec):
        m = cell["method"]
        try:
            cfg = build_config(_merge(cell["config"], {"server": {"strategies": cell["fuse_options"]}}))
            for s in cell["fuse"]:
                STRATEGIES.entry(s, key=f"methods.{m}.fuse")
                STRATEGIES.check(s, cfg)
        except FlareError as e:
            flare_key, written = (e.key or "").split("."), {"methods": {m: spec["methods"][m]}, "base": spec["base"]}
            candidates = [["methods", m, "config", *flare_key], ["base", *flare_key]]
            if flare_key[:2] == ["server", "strategies"]:
                candidates.insert(0, ["methods", m, "fuse_options", *flare_key[2:]])
            parts = next((p for p in candidates if _holds(written, p)),
                         flare_key if flare_key[0] == "methods" else ["methods", m])
            msg = e.message.removesuffix(".")
            if parts[2:3] == ["fuse_options"] and len(parts) == 5:  # a server's option: the options it has
                close = difflib.get_close_matches(parts[4], [o for o, *_ in STRATEGIES.option_rows(parts[3])], n=1)
                msg += f" (did you mean '{close[0]}'?)" if close else ""
            raise _error(chain, parts, f"cell {cell['name']}: {msg}", e.fix) from None


def seeds_for(spec: dict, alpha: float) -> list[int]:
    """The table's seeds at α: one list for every α, or a mapping α → list where one α needs more draws than the
    others (a diagnostic that must reach a test's power at one α only need not pay for it at every α)."""
    seeds = spec["seeds"]
    if isinstance(seeds, dict):
        return next((list(v) for k, v in seeds.items() if float(k) == float(alpha)), [])
    return list(seeds)


def cell_name(method: str, alpha: float, seed: int) -> str:
    return f"{method}-a{alpha:g}-s{seed}"


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in (b or {}).items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def cells(spec: dict) -> list[dict]:
    """Every (method, α, seed) of the table with its flare config (the base, the method's preset and overrides,
    α and seed), in the order they run: seeds outermost, so a partial table already pairs its methods by seed."""
    table, out = Table.model_validate(spec), []
    for seed in sorted({sd for a in table.alphas for sd in seeds_for(spec, a)}):
        for alpha in (a for a in table.alphas if seed in seeds_for(spec, a)):
            for method, m in table.methods.items():
                cfg = _merge(_merge(table.base, m.config), {"preset": m.preset, "seed": seed,
                                                            "partition": {"alpha": alpha}})
                out.append({"name": cell_name(method, alpha, seed), "method": method, "alpha": alpha, "seed": seed,
                            "config": cfg, "fuse": list(m.fuse),
                            "fuse_options": {k: dict(v) for k, v in m.fuse_options.items()}})
    return out


def finished(run_dir: Path) -> bool:
    state = run_dir / "state.json"
    if not state.is_file():
        return False
    try:
        return json.loads(state.read_text()).get("status") == "finished"
    except ValueError:
        return False


def stale(rec: Path, cell: dict, overrides: list[str]) -> list[str]:
    """The keys in which a recorded cell's config and the table's cell (with `overrides`) are different experiments:
    a table file edited after a cell was recorded. Such a cell is never skipped as done nor silently replaced."""
    if not (rec / "config.yaml").is_file():
        return []
    new = load_config(overrides=_merge(cell["config"], parse_overrides(list(overrides))))
    return experiment_differences(yaml.safe_load((rec / "config.yaml").read_text()), new)


def _key(strategy: str, options: dict) -> str:
    return strategy + json.dumps(options or {}, sort_keys=True)


def fused(run_dir: Path) -> set[str]:
    """The (strategy, options) pairs fused in a run or records directory, as `_key` strings."""
    f = run_dir / "fuse.jsonl"
    if not f.is_file():
        return set()
    out = set()
    for line in f.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("kind") == "fuse":
            out.add(_key(r.get("strategy"), r.get("options")))
    return out


def fuse_args(cell: dict, strategy: str) -> list[str]:
    """`flare fuse`'s overrides for one strategy of a cell: the table's server options given at fuse time (a
    shortened data-free budget, its curve) — they change what the server builds, never the clients."""
    return [f"server.strategies.{strategy}.{k}={v}" for k, v in cell["fuse_options"].get(strategy, {}).items()]


def copy_records(spec: dict, cell: dict, run_dir: Path, dest: Path, shown: dict | None = None) -> Path:
    """The cell's records (never a checkpoint) and what the cell is, under dest/<cell>/; the table's description
    (columns, the paper's numbers, notes) from `shown`, the table file as it reads now, when given."""
    d = dest / spec["table"] / cell["name"]
    d.mkdir(parents=True, exist_ok=True)
    for name in RECORDS:
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, d / name)
    meta = {k: cell[k] for k in ("method", "alpha", "seed", "fuse", "fuse_options")}
    meta["table"] = spec["table"]
    (d / "cell.json").write_text(json.dumps(meta, indent=1) + "\n")
    _drop_finished_progress(d)
    describe(spec, dest, shown)
    return d


def _drop_finished_progress(d: Path) -> None:
    """A fusion's progress note goes once its fuse record is in: the record is the result, the note was its way."""
    f = d / PROGRESS
    if not f.is_file():
        return
    left = {s: e for s, e in json.loads(f.read_text()).items() if not fuse_records(d, s)}
    if left:
        f.write_text(json.dumps(left, indent=1) + "\n")
    else:
        f.unlink()


def progress(spec: dict, runs: Path, dest: Path = RESULTS) -> tuple[list[Path], list[str]]:
    """Record how far each recorded cell's unfinished data-free fusion has got: its curve so far, epochs done and
    wall seconds, read from the build's state in the cell's run directory (`fuse-scratch/<strategy>/`), into
    dest/<table>/<cell>/fuse-progress.json. A fusion at the published budget spans sittings, and its state (weights
    included) is never committed, so without this a session that ends mid-fusion leaves no trace of where the
    student was heading. The note is no result: the block prints it apart from the columns, and the fuse record
    supersedes it. A cell whose strategy folder holds more than one state (a build at other options interrupted
    too) is named and skipped: which one is the table's cannot be told from the files. Returns the files written
    and the skipped cells' reasons."""
    import torch  # only here: rendering and running never need it

    written, skipped = [], []
    for cell in cells(spec):
        rec = dest / spec["table"] / cell["name"]
        if not (rec / "cell.json").is_file():
            continue
        notes, have = {}, fused(rec)  # the cell's fuse file read once
        for s in cell["fuse"]:
            if _key(s, cell["fuse_options"].get(s)) in have:
                continue
            states = sorted((runs / spec["table"] / cell["name"] / "fuse-scratch" / s).glob("*.pt"))
            if len(states) > 1:
                skipped.append(f"{cell['name']}: {len(states)} {s} build states ({', '.join(p.name for p in states)});"
                               " remove the ones not at the table's options")
                continue
            if not states:
                continue
            st = torch.load(states[0], map_location="cpu", weights_only=True)
            notes[s] = {"options": cell["fuse_options"].get(s) or {}, "epoch": int(st["epoch"]),
                        "curve": st["curve"], "seconds": round(float(st["seconds"]), 1),
                        "as_of": time.strftime("%Y-%m-%d %H:%M", time.gmtime(states[0].stat().st_mtime)) + " UTC"}
        if notes:
            (rec / PROGRESS).write_text(json.dumps(notes, indent=1) + "\n")
            written.append(rec / PROGRESS)
    return written, skipped


def stop(spec: dict, runs: Path, why: str, dest: Path = RESULTS, on: str | None = None) -> tuple[list[Path], list[str]]:
    """Mark each recorded unfinished fusion of the table as stopped, with `why` and the date: its state (weights
    included, never committed) is gone — the machine that held it was replaced — so it cannot go on, and the block
    must no longer price it as "≈ N h more". A fusion whose state is still on disk under `runs` is refused (named in
    the second list): it can go on, and marking it stopped would throw that away. Returns the notes written and the
    refusals; nothing is written when anything is refused."""
    on = on or time.strftime("%Y-%m-%d", time.gmtime())
    todo, refused = [], []
    for cell in cells(spec):
        rec = dest / spec["table"] / cell["name"]
        open_ = [s for s, e in in_progress(rec).items() if "stopped" not in e]
        for s in open_:
            states = sorted((runs / spec["table"] / cell["name"] / "fuse-scratch" / s).glob("*.pt"))
            if states:
                refused.append(f"{cell['name']}: its {s} build state is on disk ({states[0]}), so the fusion can go "
                               f"on (run --fuse-only), not stop")
        if open_:
            notes = json.loads((rec / PROGRESS).read_text())
            todo.append((rec, {s: {**e, "stopped": {"why": why, "on": on}} if s in open_ else e
                               for s, e in notes.items()}))
    if refused:
        return [], refused
    for rec, notes in todo:
        (rec / PROGRESS).write_text(json.dumps(notes, indent=1) + "\n")
    return [rec / PROGRESS for rec, _ in todo], []


def describe(spec: dict, dest: Path, shown: dict | None = None) -> Path:
    """dest/<table>/table.yaml: what the block shows of the table (columns, the paper's numbers and their source,
    notes), from `shown` when given. The renderer reads this, never the table file, so the block is the records'.
    It also keeps `registered_seeds`, α → the seeds the table file gave when the table's first cell at that α was
    recorded, never rewritten after: the draws its tests are pre-registered on (`Table._draws_fixed`, `registered`)."""
    shown = {**(shown or spec), "table": spec["table"]}
    path = dest / spec["table"] / "table.yaml"
    reg = registered_seeds(path)
    for alpha in sorted({float(m["alpha"]) for _, m in _metas(dest / spec["table"])} - set(reg)):
        reg[alpha] = seeds_for(shown, alpha)
    out = {k: shown[k] for k in ("table", "paper", "note", "spread", "alphas", "seeds") if k in shown}
    out["registered_seeds"] = {a: list(reg[a]) for a in sorted(reg)}
    out.update({k: shown[k] for k in ("columns", "published", "published_source", "paired_with") if k in shown})
    path.write_text(yaml.safe_dump(out, sort_keys=False))
    return path


def registered_seeds(description: Path) -> dict[float, list[int]]:
    """α → the registered draws of a recorded table (its table.yaml's `registered_seeds`; none before its first
    record). A description written before registration was kept registers, at each α with records, the seeds it
    lists: the best record left of what was planned before the draws were seen."""
    if not description.is_file():
        return {}
    shown = yaml.safe_load(description.read_text()) or {}
    if "registered_seeds" not in shown:
        recorded = {float(m["alpha"]) for _, m in _metas(description.parent)}
        return {a: seeds_for(shown, a) for a in sorted(recorded) if "seeds" in shown and seeds_for(shown, a)}
    return {float(a): [int(s) for s in v] for a, v in (shown.get("registered_seeds") or {}).items()}


def registered(spec: dict, alpha: float) -> list[int]:
    """The draws a recorded table's tests at α use: the seeds registered with its first cell at α, or, in a
    description that predates registration, its seeds."""
    reg = spec.get("registered_seeds") or {}
    return next((list(v) for k, v in reg.items() if float(k) == float(alpha)), None) or seeds_for(spec, alpha)


def _log(log: Path, msg: str) -> None:
    line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}"
    print(line, flush=True)
    with log.open("a") as f:
        f.write(line + "\n")


def _flare(*args: str) -> list[str]:
    return [sys.executable, "-m", "flare.cli", *args]


def _git_commit(paths: list[str], message: str, attempts: int = 20) -> None:
    """Commit these paths alone. A session may be committing in the same checkout while a table runs for hours:
    git's index lock is then held for a moment, so a refused commit is retried rather than ending the table."""
    for k in range(attempts):
        add = subprocess.call(["git", "add", "--", *paths], cwd=ROOT)
        if add == 0 and subprocess.call(["git", "commit", "-q", "-m", message, "--", *paths], cwd=ROOT) == 0:
            return
        time.sleep(min(60, 2 ** k))
    raise SystemExit(f"papers: could not commit {paths} after {attempts} attempts")


def _rel(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def _plan(spec: dict, i: int, n: int, cell: dict, runs: Path, dest: Path, overrides: list[str],
          defer: tuple[str, ...], fuse_only: bool) -> dict:
    """What a pass does with one cell, decided before anything is written: the line the dry run prints, whether the
    pass acts on it (`act`: train — resuming what is on disk — fuse the servers it lacks, record), whether that
    trains clients (`trains`), the servers it fuses, the keys in which its records are another experiment
    (`stale`: the pass is refused), and the line a pass logs for a cell it skips (`skip`)."""
    run_dir, rec = runs / spec["table"] / cell["name"], dest / spec["table"] / cell["name"]
    try:  # a --set FLARE refuses stops here, not in the first cell's `flare run`
        cfg = load_config(overrides=_merge(cell["config"], parse_overrides(list(overrides))))
    except FlareError as e:
        raise FlareError(f"with --set {' '.join(overrides)}, cell {cell['name']}'s config is refused: {e.message}",
                         key="--set", fix=e.fix) from None
    recorded, have, on_disk = (rec / "cell.json").is_file(), fused(rec), finished(run_dir)
    missing = [s for s in cell["fuse"] if s not in defer and _key(s, cell["fuse_options"].get(s)) not in have]
    changed = stale(rec, cell, overrides)
    head = f"[{i}/{n}] {cell['name']}"
    plan = {"head": head, "cell": cell, "run_dir": run_dir, "rec": rec, "recorded": recorded, "stale": changed,
            "done": recorded and not missing, "skip": None,  # the servers it fuses: all its run directory lacks
            "fuse": [s for s in cell["fuse"] if s not in defer and _key(s, cell["fuse_options"].get(s)) not in
                     fused(run_dir)]}
    if changed:
        status = (f"recorded at another setting (keys differ: {', '.join(changed)}); move {_rel(rec)} and {run_dir} "
                  "aside (or restore the table file) to run it at this one")
    elif recorded and not missing:
        status = "recorded"
    elif recorded:  # recorded without a strategy the table now fuses
        status = (f"recorded without {', '.join(missing)}; its clients "
                  + ("are on disk" if on_disk else "are not on disk (checkpoints are never committed): "
                     + ("skipped by --fuse-only" if fuse_only else "training them again")))
        if fuse_only and not on_disk:  # recorded on a machine that is gone: nothing here to fuse over
            plan["skip"] = (f"{head}: recorded without {', '.join(missing)}, but its clients are not on disk; skipped "
                            "(a pass without --fuse-only trains them again from the same seed)")
    else:
        rounds = sum(1 for r in _jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "round")
        status = ("finished, not recorded" if on_disk else
                  f"resumable ({rounds} of {cfg.rounds} rounds done)" if run_dir.exists() else "new")
        if fuse_only:  # the training process records, then fuses it
            status += "; left to the training pass (--fuse-only)"
    plan["status"] = status
    plan["act"] = not plan["done"] and not changed and (not fuse_only or (recorded and on_disk))
    plan["trains"] = plan["act"] and not fuse_only and not on_disk
    return plan


def _estimate(plan: dict, metas: list[tuple[Path, dict]]) -> tuple[float, list[str], list[str]]:
    """Wall hours a pass will take over one cell at the rates of the table's records (`metas`, as the block's cost
    line reads them), the parts priced, and the parts no record prices yet: clients at the method's mean cell, less
    the rounds a resumable run directory holds; a server at its mean fusion, or an unfinished one with a progress
    note over these clients at its own rate for the epochs left."""
    cell, hours, priced, unpriced = plan["cell"], 0.0, [], []
    mine = [d for d, m in metas if m["method"] == cell["method"]]
    if plan["trains"]:
        if rates := client_hours(mine):
            left = max(0.0, float(np.mean(rates)) - _cell_hours(plan["run_dir"]))
            hours += left
            priced.append(f"clients {_duration(left)}")
        else:
            unpriced.append("its clients")
    notes = in_progress(plan["rec"])
    for s in plan["fuse"]:
        if (e := notes.get(s)) and e["epoch"] and e["epochs"]:
            again = plan["trains"] or e.get("stopped")  # its state went with the clients it was built over
            left = _epoch_hours(e) * (e["epochs"] - (0 if again else e["epoch"]))
            hours += left
            priced.append(f"{s} {_duration(left)} (" + (f"all {e['epochs']} epochs" if again else
                                                        f"epochs {e['epoch'] + 1}–{e['epochs']}")
                          + " at its progress note's rate)")
        elif rates := fusion_hours([fuse_records(d, s) for d in mine]):
            hours += float(np.mean(rates))
            priced.append(f"{s} {_duration(float(np.mean(rates)))}")
        else:
            unpriced.append(f"its {s} fusion")
    return hours, priced, unpriced


def _n(k: int, word: str) -> str:
    return f"{k} {word}{'s' * (k != 1)}"


def _nothing_to_do(spec: dict, plans: list[dict], dest: Path, fuse_only: bool, only: tuple[str, ...]) -> FlareError:
    """Why a pass has no cell to act on, counted by what the cells lack."""
    k, table = len(plans), spec["table"]
    which = (f"the {_n(k, 'cell')} of {table} that --cells names" if only else
             f"all {k} cells of {table}" if k != 1 else f"the one cell of {table}")
    done = sum(p["done"] for p in plans)
    if not fuse_only:
        return FlareError(f"{which} {'is' if k == 1 else 'are'} recorded with every server in "
                          f"{_rel(dest / table)}: nothing to run.", key="run",
                          fix="`render` shows them; to run a cell again, move its records directory aside.")
    waiting, gone = sum(not p["recorded"] for p in plans), sum(p["skip"] is not None for p in plans)
    counts = [(waiting, "not recorded yet: no clients to fuse over"),
              (gone, "recorded without a server, their clients not on disk"), (done, "recorded with every server")]
    return FlareError(f"--fuse-only has nothing to fuse among {which}: no cell has recorded clients on disk with a "
                      f"server left to fuse ({'; '.join(f'{k} {why}' for k, why in counts if k)}).", key="--fuse-only",
                      fix="run the table without --fuse-only first (with --defer SERVER to record the clients before "
                          "the long fusions), on the machine that will fuse them." if waiting else
                          "a pass without --fuse-only trains their clients again from the same seed." if gone else
                          "`render` shows them.")


def show_plan(spec: dict, plans: list[dict], dest: Path, overrides: list[str], fuse_only: bool,
            only: tuple[str, ...]) -> None:
    """Each cell with its status and what the pass would cost, then the total — a table at its published budget
    runs for days, and the reader plans with this before starting one."""
    metas = _metas(dest / spec["table"])
    total, acts, unpriced = 0.0, [p for p in plans if p["act"]], []
    for p in plans:
        cost = ""
        if p["act"]:
            hours, priced, none = _estimate(p, metas)
            total += hours
            unpriced += [f"{p['cell']['name']}'s {x.removeprefix('its ')}" for x in none]
            cost = " — " + "; ".join(([f"≈ {_duration(hours)}: {', '.join(priced)}"] if priced else [])
                                      + ([f"no rate yet for {', '.join(none)}"] if none else []))
        print(f"{p['head']}: {p['status']}{cost}")
    if any(p["stale"] for p in plans):
        print(f"{_n(sum(bool(p['stale']) for p in plans), 'cell')} recorded at another setting: a pass refuses to start "
              "until they are moved aside.")
    if not acts:
        print(_nothing_to_do(spec, plans, dest, fuse_only, only).message)
        return
    print(f"{len(acts)} of {_n(len(plans), 'cell')} to run ({sum(p['trains'] for p in acts)} to train, "
          f"{_n(sum(len(p['fuse']) for p in acts), 'fusion')}): ≈ {_duration(total)} at the wall times recorded in "
          f"{_rel(dest / spec['table'])}" + (f"; no rate yet for {', '.join(unpriced)}" if unpriced else "")
          + ("; the --set overrides are not priced" if overrides else "") + ".")


def run(spec: dict, runs: Path, *, commit: bool, dry_run: bool, overrides: list[str], dest: Path = RESULTS,
        defer: tuple[str, ...] = (), fuse_only: bool = False, only: tuple[str, ...] = (),
        table_path: str | Path | None = None) -> int:
    """Run every cell not yet recorded. `defer` names server strategies left for a later pass (the data-free
    servers cost hours per cell): the cell is recorded without them, and a pass without `defer` fuses them over
    the kept run directory and records the cell again. `fuse_only`: train nothing — only fuse the cells whose
    clients have finished (a second process beside the one training). `only` names the cells this process takes,
    so that two processes can train two cells of one table at once without both resuming the same one.
    `table_path`: the table file, read again as each cell is recorded — a table runs for days, and a correction to
    what it shows (the paper's numbers, a note) made meanwhile must not be undone by a process started before it.
    Every cell is planned first: a cell recorded at another setting, or a pass with nothing to do, is refused (a
    FlareError) before anything is written."""
    every = cells(spec)
    plans = [_plan(spec, i, len(every), cell, runs, dest, overrides, defer, fuse_only)
             for i, cell in enumerate(every, 1) if not only or cell["name"] in only]
    if dry_run:
        show_plan(spec, plans, dest, overrides, fuse_only, only)
        return 0
    if changed := [p for p in plans if p["stale"]]:  # never skipped as done, nor replaced
        raise FlareError("recorded at another setting than the table file's now: " + "; ".join(
            f"{p['cell']['name']} (keys differ: {', '.join(p['stale'])})" for p in changed) + ".", key="run",
            fix=f"move {', '.join(str(_rel(p['rec'])) for p in changed)} and their run directories under {runs} "
                "aside (or restore the table file) to run them at this setting.")
    if not any(p["act"] for p in plans):
        raise _nothing_to_do(spec, plans, dest, fuse_only, only)
    table_runs = runs / spec["table"]
    table_runs.mkdir(parents=True, exist_ok=True)
    log = table_runs / "progress.log"
    for p in plans:
        cell, run_dir, head = p["cell"], p["run_dir"], p["head"]
        if p["done"]:
            _log(log, f"{head}: recorded, skipped")
        if p["skip"]:
            _log(log, p["skip"])
        if not p["act"]:
            continue
        cfg_path = table_runs / f"{cell['name']}.yaml"
        cfg_path.write_text(yaml.safe_dump(cell["config"], sort_keys=False))
        t0 = time.time()
        if not fuse_only:
            _log(log, f"{head}: {p['status']}, training")
            rc = subprocess.call(_flare("run", "--config", str(cfg_path), "--out", str(run_dir), *overrides), cwd=ROOT)
            if rc != 0:
                _log(log, f"{head}: flare run exited {rc}; stopping")
                return rc
        for s in p["fuse"]:
            if _key(s, cell["fuse_options"].get(s)) in fused(run_dir):
                continue
            _log(log, f"{head}: fusing {s} {' '.join(fuse_args(cell, s))}")
            rc = subprocess.call(_flare("fuse", str(run_dir), "--strategies", s, *fuse_args(cell, s)), cwd=ROOT)
            if rc != 0:
                _log(log, f"{head}: flare fuse {s} exited {rc}; stopping")
                return rc
        shown = None
        if table_path is not None:
            try:
                shown = load_table(table_path, records=dest)
            except FlareError as e:  # the records still land; the description stays as this process read it
                _log(log, f"{head}: {e}; recording the table as it read at the start")
        d = copy_records(spec, cell, run_dir, dest, shown)
        _log(log, f"{head}: done in {time.time() - t0:.0f} s → {_rel(d)}")
        if commit:  # the records and the docs block rendered from them, in one commit: never a stale block.
            # Rendered by a fresh process: a table runs for days, and the block must be what the checked-out
            # renderer makes of the records, not what the renderer was when this process started.
            subprocess.check_call([sys.executable, str(Path(__file__).resolve()), "render", "--results", str(dest)],
                                  cwd=ROOT)
            _git_commit([str(d), str(d.parent / "table.yaml"), str(DOC), str(DOC.parent / "img")],
                        f"papers: {spec['table']} {cell['name']} records")
    return 0


# ------------------------------------------------------------------------------------------------ the block
def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _metas(table_dir: Path) -> list[tuple[Path, dict]]:
    """A records directory's cells, each with its cell.json (none for a table with no records yet)."""
    if not table_dir.is_dir():
        return []
    return [(d, json.loads((d / "cell.json").read_text())) for d in sorted(table_dir.iterdir())
            if (d / "cell.json").is_file()]


def fuse_records(cell_dir: Path, strategy: str) -> list[dict]:
    """A cell's fuse records of one strategy, oldest first, with the cell's budget options only: the last is the
    one the table reports."""
    meta = json.loads((cell_dir / "cell.json").read_text()) if (cell_dir / "cell.json").is_file() else {}
    want = (meta.get("fuse_options") or {}).get(strategy, {})
    return [r for r in _jsonl(cell_dir / "fuse.jsonl") if r.get("kind") == "fuse" and r.get("strategy") == strategy
            and (r.get("options") or {}) == want]


def cell_value(cell_dir: Path, key: str, rule: str) -> float:
    """The accuracy (percent) of one column in one cell: `key` a round record's key (acc_fedavg, acc_output, acc)
    or `fuse:<strategy>`; `rule` final (the last round's / the fused model) or peak (the best evaluated round —
    a selection on the test set)."""
    if key.startswith("fuse:"):
        recs = fuse_records(cell_dir, key[5:])
        if not recs:
            return float("nan")
        best = recs[-1].get(f"{key[5:]}.best_epoch_acc")  # a data-free server's best epoch on the test curve
        return 100 * float(best if rule == "peak" and best is not None else recs[-1]["acc"])
    curve = [r.get(key) for r in _jsonl(cell_dir / "metrics.jsonl") if r.get("kind") == "round"]
    curve = [float(v) for v in curve if isinstance(v, (int, float))]
    if not curve:
        return float("nan")
    return 100 * (max(curve) if rule == "peak" else curve[-1])


def summarise(values: list[float]) -> tuple[float, float, float, int]:
    """mean, std (n − 1), half-width of the 95 % t interval, n — over the finite values."""
    return mean_ci(values)


def _ms(m: float, sd: float, n: int) -> str:
    if n == 0:
        return "—"
    return f"{m:.2f}" if n == 1 else f"{m:.2f} ± {sd:.2f}"


# The column a run of the paper's own code (benchmarks/reference_dense.py's and reference_fedlpa.py's record.json)
# fills, by the FLARE column's key: the method of the reference run and its record's key at each selection rule
# (DENSE's script scores FedAvg and the ensemble once, after training; DENSE's student every epoch: its last and its
# best, the paper's rule; FedLPA's script prints the better of its two solutions, one value).
REFERENCE_KEYS = {"acc_fedavg": ("fedavg", {"final": "fedavg", "peak": "fedavg"}),
                  "acc_output": ("fedavg", {"final": "ensemble", "peak": "ensemble"}),
                  "fuse:dense": ("dense", {"final": "student_final", "peak": "student_best"}),
                  "fuse:fedlpa": ("fedlpa", {"final": "fedlpa", "peak": "fedlpa"})}


def reference_runs(table_dir: Path) -> list[dict]:
    """The runs of a paper's own code for a table (results/papers-reference/<table>/<method>-a<α>-s<seed>/): each a
    dict with method, alpha, seed and either `record` (record.json, a finished run) or `progress` (progress.json, a
    run under way whose sitting committed it). Read tolerantly — the keys read are record.json's `method`, `alpha`,
    `seed` (else the directory's name), `accuracy_unit` (percent unless `fraction`), `partition.used` (a run on the
    script's own split, `own`, is another experiment and left out), `table_setting` (false: a shortened smoke of
    the code, never read) and the value keys of REFERENCE_KEYS; and progress.json's `num_clients`,
    `local_epochs` and `server_epochs` (else the `argv` flags `--num_users`, `--local_ep`, `--epochs`), `clients`
    (a client with `seconds` is finished; `acc_per_epoch` or `loss_per_epoch` its epochs so far) and
    `student_curve`. A file that does not parse is skipped."""
    out = []
    for d in sorted(table_dir.iterdir()) if table_dir.is_dir() else []:
        name = re.fullmatch(r"(\w+)-a([0-9.]+)-s(\d+)", d.name)
        for fname, kind in (("record.json", "record"), ("progress.json", "progress")):
            try:
                body = json.loads((d / fname).read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(body, dict):
                continue
            try:
                run = {"method": body.get("method") or name.group(1), "alpha": float(body.get("alpha") or
                                                                                     name.group(2)),
                       "seed": int(body["seed"] if body.get("seed") is not None else name.group(3)), kind: body}
            except (AttributeError, TypeError, ValueError):
                continue
            own_split = (body.get("partition") or {}).get("used", "flare") != "flare"
            if not own_split and body.get("table_setting") is not False:
                out.append(run)
            break  # a record replaces its progress file
    return out


def reference_values(refs: list[dict], column: dict, alpha: float) -> dict[int, float]:
    """seed → the paper's code's finished value (percent) for a FLARE column at α, at the column's paper rule."""
    method, keys = REFERENCE_KEYS.get(column["key"], (None, {}))
    key, out = keys.get(column.get("paper_rule", "final")), {}
    for r in refs:
        rec = r.get("record")
        if rec is None or r["method"] != method or float(r["alpha"]) != float(alpha):
            continue
        v = rec.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[r["seed"]] = float(v) * (100 if rec.get("accuracy_unit") == "fraction" else 1)
    return out


def _reference_progress(run: dict) -> str:
    """How far an unfinished run of the paper's code got, from its progress file: clients finished (and the one
    training, at its epoch) for the clients' run, epochs for the server's."""
    p, argv = run["progress"], [str(x) for x in run["progress"].get("argv") or []]

    def flag(name: str) -> str | None:
        return argv[argv.index(name) + 1] if name in argv[:-1] else None

    clients = p.get("clients") or {}
    if run["method"] == "dense" and (p.get("student_curve") or p.get("phase") == "kd_train" or not clients):
        epochs = p.get("server_epochs") or flag("--epochs") or "?"
        return f"running, epoch {len(p.get('student_curve') or [])} of {epochs}"
    done = sum(1 for c in clients.values() if isinstance(c, dict) and "seconds" in c)
    going = [(k, len(c.get("acc_per_epoch") or c.get("loss_per_epoch") or [])) for k, c in clients.items()
             if isinstance(c, dict) and "seconds" not in c]
    local = p.get("local_epochs") or flag("--local_ep") or "?"
    return (f"running, {done} of {p.get('num_clients') or flag('--num_users') or '?'} clients"
            + "".join(f" (client {k} at epoch {e} of {local})" for k, e in going[:1]))


def reference_text(refs: list[dict], column: dict, alpha: float, values: dict[int, float]) -> str:
    """The "their code" cell: the finished runs' value at the paper's rule (mean ± SD over several seeds) with the
    seeds, then each unfinished run's progress; "not run" where the table has no run of the paper's code here."""
    method = REFERENCE_KEYS.get(column["key"], (None,))[0]
    parts = []
    if values:
        m, sd, _, n = summarise(list(values.values()))
        parts.append(f"{_ms(m, sd, n)} (seed{'s' * (n > 1)} {seed_text(values)})")
    parts += [f"seed {r['seed']}: {_reference_progress(r)}" for r in refs if "progress" in r
              and r["method"] == method and float(r["alpha"]) == float(alpha) and r["seed"] not in values]
    return "; ".join(parts) or "not run"


def render(results: Path = RESULTS, img_dir: Path | None = None, reference: Path = REFERENCE) -> str:
    """The markdown block: per table, column and α, the paper's printed number, the paper's own code's (its runs
    under `reference`, `reference_runs`) and FLARE's — n, mean, SD and 95 % t interval over the registered draws,
    and whether n can separate the mean from the paper's number at all; the data-free servers' budgets and budget
    curves (figures drawn into `img_dir`; None: only named); FAFI and FLARE paired by seed with the baselines of
    the table they share a setting with."""
    lines = []
    tables = sorted(p for p in results.iterdir() if (p / "table.yaml").is_file()) if results.is_dir() else []
    if not tables:
        return "No cell has finished yet: the tables appear here as results/papers/ fills.\n"
    for tdir in tables:
        spec = yaml.safe_load((tdir / "table.yaml").read_text())
        metas = _metas(tdir)
        refs = reference_runs(reference / spec["table"])
        lines += [f"### {spec['table']} — {spec.get('paper', '')}", ""]
        if spec.get("note"):
            lines += [f"*{spec['note'].strip()}*", ""]
        lines += post_hoc_lines(spec, metas)
        lines += ["| column | α | paper | their code | FLARE: seeds | n | mean ± SD (final) | 95 % t interval | "
                  "FLARE: paper's rule | FLARE − paper |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        rows = []
        for col, c in spec["columns"].items():
            rule = c.get("paper_rule", "final")
            for alpha in spec["alphas"]:
                pre, post = split_draws(spec, alpha, [(m["seed"], d) for d, m in metas if m["method"] == c["method"]
                                                      and float(m["alpha"]) == float(alpha)])
                final = {s: v for s, v in ((s, cell_value(d, c["key"], "final")) for s, d in pre) if math.isfinite(v)}
                chosen = {s: cell_value(d, c["key"], rule) for s, d in pre}
                mf, sf, hf, n = summarise(list(final.values()))
                mr, sr, _, nr = summarise(list(chosen.values()))
                pub = published(spec, col, alpha)
                theirs = reference_values(refs, c, alpha)
                rows.append({"col": col, "key": c["key"], "alpha": alpha, "rule": rule, "pub": pub, "final": final, "mean": mf,
                             "half": hf, "n": n, "chosen": {s: v for s, v in chosen.items() if math.isfinite(v)},
                             "theirs": theirs})
                seeds = seed_text(final) + (f" (+{seed_text(s for s, _ in post)} post hoc)" if post else "")
                lines.append(f"| {col} | {alpha:g} | {published_text(spec, col, alpha)} | "
                             f"{reference_text(refs, c, alpha, theirs)} | {seeds or '—'} | {n} | {_ms(mf, sf, n)} | "
                             f"{_interval(mf, hf, n)} | {_ms(mr, sr, nr)} ({rule}) | "
                             f"{'—' if pub is None or n == 0 else f'{mf - pub:+.2f}'} |")
        lines += separation_lines(rows)
        lines += gap_lines(rows, [r for _, r in oracle_records(reference / spec["table"])])
        lines += oracle_lines(reference / spec["table"])
        if spec.get("published_source"):  # where the paper column's numbers were read, and how sure that is
            lines += ["", f"The paper's numbers: {' '.join(spec['published_source'].split())}"]
        lines += spread_lines(spec, metas)
        lines += budget_notes(spec, metas)
        lines += progress_lines(spec, metas)
        lines += other_servers(spec, metas)
        cost = cost_lines(spec, metas)
        lines += ([""] if cost and lines[-1] else []) + cost
        lines += paired_rows(spec, metas, results)
        fig = three_numbers_figure(spec, rows, img_dir)
        if fig is not None:
            lines += [f"![{spec['table']}: the paper's number, its own code's seeds and FLARE's, cell by cell]"
                      f"(img/{fig.name})", ""]
        fig = spread_figure(spec, metas, img_dir)
        if fig is not None:
            lines += [f"![{spec['table']}: every draw beside the paper's single run](img/{fig.name})", ""]
        fig = curve_figure(spec, metas, img_dir)
        if fig is not None:
            lines += [f"![{spec['table']}: test accuracy against the data-free server's generator steps]"
                      f"(img/{fig.name})", ""]
        lines.append("")
    lines.append("final: the last round's model (or the fused model); peak: the best evaluated round (a data-free "
                 "server: its best epoch on the test curve), a selection on the test set. n, the mean ± SD, the 95 % "
                 "t interval (n − 1 degrees of freedom) and FLARE − paper use the final values of the registered "
                 "draws; draws added after a table's first records are named post hoc and left out of them. Paper: "
                 "not found — the paper prints this cell but no stored source gave its number; not in the paper — a "
                 "column the paper does not have (an extra column, or a method it does not run). Their code: the "
                 "paper's own released code run at the cell's setting (results/papers-reference/), at the paper's "
                 "rule; not run — no run of it for this cell.")
    return "\n".join(lines) + "\n"


def _interval(mean: float, half: float, n: int) -> str:
    """The 95 % t interval of the mean, as its ends and its half-width; none below two draws."""
    if n < 2 or not math.isfinite(half):
        return "—"
    return f"{mean - half:.2f} – {mean + half:.2f} (±{half:.2f})"


def split_draws(spec: dict, alpha: float, seeded: list[tuple[int, Any]]) -> tuple[list, list]:
    """(seed, x) pairs in seed order, split into the registered draws at α (`registered`) and those added after the
    table's first records (post hoc): every test of the block uses the first alone."""
    reg = set(registered(spec, alpha))
    seeded = sorted(seeded, key=lambda t: t[0])
    return [t for t in seeded if t[0] in reg], [t for t in seeded if t[0] not in reg]


def post_hoc_lines(spec: dict, metas: list[tuple[Path, dict]]) -> list[str]:
    """A table whose recorded draws at an α go beyond those registered with its first record there is flagged
    above its rows: which seeds were added, and each column's figures over all its draws, marked post hoc — shown,
    never tested."""
    out = []
    for alpha in spec["alphas"]:
        recorded = {m["seed"] for _, m in metas if float(m["alpha"]) == float(alpha)}
        added = sorted(recorded - set(registered(spec, alpha)))
        if not added:
            continue
        reg = sorted(recorded & set(registered(spec, alpha)))
        figures = []
        for col, c in spec["columns"].items():
            vals = [cell_value(d, c["key"], "final") for d, m in metas
                    if m["method"] == c["method"] and float(m["alpha"]) == float(alpha)]
            m_, sd, h, n = summarise(vals)
            if n >= 2:
                figures.append(f"{col} {m_:.2f} ± {sd:.2f}, 95 % t interval ±{h:.2f}")
        out += [f"**Draws added after the first records — post hoc.** At α = {alpha:g} the table registered seeds "
                f"{seed_text(registered(spec, alpha))} with its first α = {alpha:g} record; "
                f"{'seeds' if len(added) > 1 else 'seed'} {seed_text(added)} {'were' if len(added) > 1 else 'was'} "
                f"added after {_n(len(reg), 'draw')} had been recorded. The rows, their intervals and every test "
                f"below use the {len(reg)} registered draws; over all {len(reg) + len(added)}, post hoc and not a "
                f"test: {'; '.join(figures)}.", ""]
    return out


def separation_lines(rows: list[dict]) -> list[str]:
    """For every multi-draw cell with a published number: whether n draws can separate FLARE's mean from the
    paper's number at all. Where the 95 % interval's half-width is wider than the distance, the paper's number
    lying inside the interval is what any n that small gives, not a finding, and the line says so."""
    out = []
    for r in rows:
        if r["pub"] is None or r["n"] < 2 or not math.isfinite(r["half"]):
            continue
        dist, head = abs(r["mean"] - r["pub"]), f"{r['col']}, α = {r['alpha']:g}: n = {r['n']}"
        out.append(f"{head} cannot separate {r['mean']:.2f} from the paper's {r['pub']:.2f}: the interval is "
                   f"±{r['half']:.2f} points, the distance {dist:.2f}." if r["half"] > dist else
                   f"{head} separates {r['mean']:.2f} from the paper's {r['pub']:.2f}: {dist:.2f} points apart, "
                   f"beyond the interval's ±{r['half']:.2f}.")
    return ["", "FLARE's mean against the paper's number (final values, the registered draws):", "",
            *[f"* {line}" for line in out]] if out else []


GAP = 3.0  # points: a cell further than this from the paper is a gap the docs explain


def gap_lines(rows: list[dict], oracles: list[dict] = ()) -> list[str]:
    """For a cell more than GAP points from the paper (FLARE at the paper's rule) that has a finished run of the
    paper's code: which of the two steps holds the gap — "paper ↔ its code" (the code, run at the stated setting,
    misses the paper's number: the paper ran something its code does not state) and "its code ↔ FLARE" (FLARE
    misses the code on the same seeds: FLARE computes something else) — each with its numbers. A code ↔ FLARE pair
    beyond GAP is then placed by the table's identical-tensors oracles (`oracle_part`)."""
    out = []
    for r in rows:
        theirs, ours = r["theirs"], r["chosen"]
        if r["pub"] is None or not theirs or not ours or abs(float(np.mean(list(ours.values()))) - r["pub"]) <= GAP:
            continue
        fm, tm = float(np.mean(list(ours.values()))), float(np.mean(list(theirs.values())))
        common = sorted(set(theirs) & set(ours))
        head = (f"{r['col']}, α = {r['alpha']:g} ({r['rule']}): FLARE {fm:.2f} is {abs(fm - r['pub']):.2f} points "
                f"{'under' if fm < r['pub'] else 'over'} the paper's {r['pub']:.2f}; their code reads {tm:.2f} "
                f"(seed{'s' * (len(theirs) > 1)} {seed_text(theirs)})")
        pairs, close, other = [], [], []
        gap = abs(tm - r["pub"])
        (pairs if gap > GAP else close).append(f"paper ↔ its code ({r['pub']:.2f} against {tm:.2f}, {gap:.2f} points)")
        if common:
            a, b = float(np.mean([theirs[s] for s in common])), float(np.mean([ours[s] for s in common]))
            (pairs if abs(a - b) > GAP else close).append(
                f"its code ↔ FLARE ({a:.2f} against {b:.2f} on seed{'s' * (len(common) > 1)} {seed_text(common)}, "
                f"{abs(a - b):.2f} points)")
            deltas = {s: ours[s] - theirs[s] for s in common}
            where = f" Where it differs: {oracle_part(oracles, r, deltas)}." if abs(a - b) > GAP else ""
        else:
            other.append("its code ↔ FLARE: no seed run by both")
            where = ""
        parts = ([f"differs: {'; '.join(pairs)}"] if pairs else
                 [f"neither pair differs by more than {GAP:g} points"] if close and not other else [])
        parts += ([f"within {GAP:g} points: {'; '.join(close)}"] if close else []) + other
        out.append(f"{head}. " + "; ".join(parts)[:1].upper() + "; ".join(parts)[1:] + "." + where)
    return ["", f"Where the gap lies, for cells more than {GAP:g} points from the paper with a finished run of its "
                "code (each side at the paper's rule):", "", *[f"* {line}" for line in out]] if out else []


def oracle_records(table_dir: Path) -> list[tuple[Path, dict]]:
    """The identical-tensors oracles' records of a table (<table>/oracle/*.json) that parse, with their files."""
    out = []
    for f in sorted((table_dir / "oracle").glob("*.json")) if (table_dir / "oracle").is_dir() else []:
        try:
            out.append((f, json.loads(f.read_text())))
        except (OSError, ValueError):
            continue
    return out


def _script_file(reference: str | None) -> str | None:
    """The script a record's `reference` ("owner/repo script.py [flags]") names."""
    words = (reference or "").split()
    return words[1] if len(words) > 1 else None


def _step_phrase(r: dict) -> str:
    """An oracle's client step on identical tensors, as the gap line says it."""
    pair = r["local"].get("script_vs_flare") or r["local"].get("our_script_vs_flare")
    script = _script_file(r.get("reference"))
    whose = f"`{script}`'s" if script else "the"
    return f"on identical tensors (below) {whose} client step is {_steps_verdict(pair)}"


def _oracle_servers(r: dict, rule: str = "final") -> dict[str, tuple[float, float]]:
    """An oracle's server comparison over the clients the script trained, per table column key: (the script's own
    value, FLARE's server as the table runs it), each at the column's `rule` where the record holds both."""
    srv = r.get("server") or {}
    if r.get("tool") == "benchmarks/reference_fuse.py":  # one strategy, its last epoch and its best
        pick = "best" if rule == "peak" else "final"
        theirs, ours = (r.get("script") or {}).get(pick), (r.get("flare") or {}).get(pick)
        return {f"fuse:{r['strategy']}": (theirs, ours)} if theirs is not None and ours is not None else {}
    if r.get("tool") == "benchmarks/reference_dense_oracle.py" and srv:
        return {"acc_fedavg": (srv["script"]["fedavg"], srv["flare"]["fedavg"]),
                "acc_output": (srv["script"]["ensemble"], srv["flare"]["ensemble"])}
    if srv:  # FedLPA's script prints the better of its two solutions; the table runs FLARE's `fedlpa`
        return {"fuse:fedlpa": (max(srv["script"]["biased"], srv["script"]["newton"]), srv["flare_fedlpa"]["acc"])}
    return {}


def oracle_part(oracles: list[dict], row: dict, deltas: dict[int, float]) -> str:
    """Which part holds a code ↔ FLARE difference, from an oracle of the same α: the client step on identical
    tensors (the same or not) and the server over the script's own clients (its value against FLARE's); what neither
    explains lies in the runs' random draws, the one input the oracle made equal. `deltas`: FLARE − code per seed
    both ran. The server's share is taken from the difference on the oracle's own seed — its clients are that seed's
    — and the line names that seed when more than one was run. An oracle of another α or another seed, or one that
    does not compare this column's server, places nothing: the text says so."""
    same_alpha = [r for r in oracles if float(r.get("alpha", -1)) == float(row["alpha"])]
    if not same_alpha:
        at = sorted({float(r["alpha"]) for r in oracles if "alpha" in r})
        return ("not measured at this α" + (f" (the oracle ran at α = {', '.join(f'{a:g}' for a in at)}, below)"
                                            if at else ": no identical-tensors oracle ran"))
    stepped = [r for r in same_alpha if "local" in r]
    step = _step_phrase(stepped[0]) if stepped else "the client step was not compared at this α"
    placed = [(r, _oracle_servers(r, row["rule"])) for r in same_alpha]
    placed = [(r, servers[row["key"]]) for r, servers in placed if row["key"] in servers]
    if not placed:
        return f"not placed — {step}, but no oracle runs this column's server over the script's clients"
    usable = [(r, pair) for r, pair in placed if int(r.get("seed", -1)) in deltas]
    if not usable:
        seed = int(placed[0][0].get("seed", -1))
        return (f"not placed — {step}; its server ran over the seed-{seed} clients, a seed the code and FLARE did "
                "not both run")
    shares = [_server_share(r, theirs, ours, deltas) for r, (theirs, ours) in usable]
    remarks = [remark for _, remark in shares]
    once = len(shares) > 1 and len(set(remarks)) == 1  # one remark on every seed's draws: said once, at the end
    clauses = [share + (f" — {remark}" if remark and (not once or i == len(shares) - 1) else "")
               for i, (share, remark) in enumerate(shares)]
    if usable[0][0].get("tool") == "benchmarks/reference_fuse.py":  # the script's clients came from its own run
        script = _script_file((usable[0][0].get("reference") or {}).get("reference"))
        same = [o for o in stepped if _script_file(o.get("reference")) == script]  # not another script's client
        step = _step_phrase(same[0]) if same else f"`{script}`'s client step was not compared on identical tensors"
        return f"{step}; " + "; ".join(clauses)
    return f"{step} and " + "; and ".join(clauses)


def _server_share(r: dict, theirs: float, ours: float, deltas: dict[int, float]) -> tuple[str, str]:
    """One oracle's server over the script's clients of its seed against the script's own, and what that leaves of
    the seed's code ↔ FLARE difference to the clients (the seed named when the pair stands on more than one); with
    the remark on which of the seed's draws differ ("" where the oracle does not say)."""
    seed = int(r["seed"])
    rest = deltas[seed] - (ours - theirs)
    at_seed = f" on seed {seed}, where FLARE − code is {deltas[seed]:+.2f}," if len(deltas) > 1 else ","
    if r.get("tool") == "benchmarks/reference_fuse.py":
        return (f"FLARE's `{r['strategy']}` over the clients the script trained reads {ours:.2f} against its "
                f"{theirs:.2f} ({ours - theirs:+.2f}, the server's share){at_seed} which leaves {rest:+.2f} points to "
                "the clients (the script's training code and its random draws against FLARE's)"), ""
    own = r.get("own_draws") or {}
    differ = [name for name, same in (("initial weights", own.get("init_max_abs_diff", 1) == 0),
                                      ("split", own.get("split_equals_flare", False)),
                                      ("batch order", own.get("first_epoch_order_equals_flare", False)))
              if not same]
    draws = (f"at seed {seed} the script's {' and '.join(differ)} {'is' if len(differ) == 1 else 'are'} not "
             "FLARE's, the rest of its draws are" if own and differ else
             f"at seed {seed} the script draws what FLARE draws" if own else
             "the oracle gave the script FLARE's initial weights and batch order, so which draw it is was not measured")
    return (f"FLARE's server over the script's own clients reads {ours:.2f} against its {theirs:.2f} "
            f"({ours - theirs:+.2f}){at_seed} which leaves {rest:+.2f} points to the clients' random draws"), draws


def oracle_lines(table_dir: Path) -> list[str]:
    """What an identical-tensors oracle (benchmarks/reference_*_oracle.py) measured: its records under
    <table>/oracle/*.json, each rendered by its tool's own lines (`ORACLE_LINES`). A file that does not parse, or
    whose tool has no lines here, is skipped."""
    out, tools = [], []
    for f, r in oracle_records(table_dir):
        try:
            lines = ORACLE_LINES[r.get("tool", "benchmarks/reference_fedlpa_oracle.py")](
                r, f"`{f.relative_to(table_dir.parent).as_posix()}`")
        except (ValueError, KeyError, TypeError):
            continue
        out += lines
        tools.append(r.get("tool", "benchmarks/reference_fedlpa_oracle.py"))
    fused = ", or FLARE's server over the very clients the paper's code trained" * any(
        t == "benchmarks/reference_fuse.py" for t in tools)
    return ["", f"On identical tensors ({', '.join(f'`{t}`' for t in dict.fromkeys(tools))}: the paper's code and "
                f"FLARE in one process, from the same weights over the same batches{fused}):", "",
            *[f"* {line}" for line in out]] if out else []


def _steps_verdict(pair: dict) -> str:
    """An oracle's comparison of two runs, step by step, in words."""
    d = pair["first_divergence"]
    if d is None:
        top = max(row["max_abs_diff"] for row in pair["steps"])
        return "bit-identical" if top == 0 else f"the same (largest difference {top:.1e})"
    return f"apart from step {d['step']} on ({d['max_abs_diff']:.1e} in `{d['worst_tensor']}`)"


def _fedlpa_oracle(r: dict, name: str) -> list[str]:
    """benchmarks/reference_fedlpa_oracle.py: FedLPA's client code against FLARE's and against its own FedAvg script,
    step by step, and its aggregation against FLARE's over the clients its own run trained."""
    loc, out = r["local"], []
    acc = loc["test_accuracy"]
    out.append(
        f"Client {loc['client']} ({loc['samples']:,} images, seed {r['seed']}, β = {r['alpha']:g}), "
        f"{loc['epochs']} local epochs ({loc['optimizer_steps']['flare']} steps"
        + (f"; in FLARE {r['flare_rounds']} of the cell's rounds, one optimiser across them"
           if r.get("flare_rounds", 1) > 1 else "") +
        f") from FLARE's init over FLARE's batch order, the "
        f"script's own loader serving them: `experiments_our.py` ↔ FLARE {_steps_verdict(loc['our_script_vs_flare'])}, "
        f"`experiments_our.py` ↔ `experiments.py` {_steps_verdict(loc['our_script_vs_fedavg_script'])} (parameters "
        f"after steps 1, 2, 5 and every epoch; \"same\" up to {r['same_threshold']:g}); test accuracy "
        f"{acc['our_script']:.2f} (`experiments_our.py`), {acc['fedavg_script']:.2f} (`experiments.py`) and "
        f"{acc['flare']:.2f} (FLARE) ({name}).")
    srv = r.get("server")
    if srv:
        sc, cf, rf = srv["script"], srv["flare_merge_closed_form"], srv["flare_merge_refined"]
        out.append(
            f"Over the {len(srv['weights'])} clients `experiments_our.py` trained at the cell, with its K-FAC "
            f"factors: its own aggregation scores FedAvg {sc['fedavg']:.2f}, biased {sc['biased']:.2f} and newton "
            f"{sc['newton']:.2f} (the newton steps move the closed form by at most "
            f"{sc['newton_vs_biased_max_abs_diff']:.1e}); FLARE's `merge` on the same weights and factors: closed "
            f"form {cf['acc']:.2f} (at most {cf['max_abs_diff_vs_script_biased']:.1e} from the script's), "
            f"refined {rf['acc']:.2f}; `fedlpa_reference`'s factors within "
            f"{srv['flare_fedlpa_reference']['factors_max_relative_diff_vs_script']:.1e} (relative) of the "
            f"script's, {srv['flare_fedlpa_reference']['acc']:.2f}; the table's `fedlpa` with its own factors "
            f"{srv['flare_fedlpa']['acc']:.2f} ({name}).")
    return out


def _train_epochs(rows: list[dict], side: int) -> str:
    """The epochs in which an oracle's run trained in train mode, from its compared steps' modes."""
    epochs = sorted({math.ceil(row["epoch"]) for row in rows if row["train_mode"][side]})
    return seed_text(epochs) if epochs else "none"


def _dense_oracle(r: dict, name: str) -> list[str]:
    """benchmarks/reference_dense_oracle.py: DENSE's client code against FLARE's step by step (BatchNorm's mode and
    statistics included), the script's own init, split and batch order against FLARE's, and its FedAvg and ensemble
    against FLARE's server over the clients its own run trained."""
    loc, own, out = r["local"], r["own_draws"], []
    acc, pair = loc["test_accuracy"], loc["script_vs_flare"]
    ts, tf = _train_epochs(pair["steps"], 0), _train_epochs(pair["steps"], 1)
    modes = (f"BatchNorm in train mode in epoch {ts} on both sides, eval mode after" if ts == tf else
             f"BatchNorm in train mode in epochs {ts} in the script, {tf} in FLARE")
    out.append(
        f"Client {loc['client']} ({loc['samples']:,} images, seed {r['seed']}, α = {r['alpha']:g}), "
        f"{loc['epochs']} local epochs ({loc['optimizer_steps']['flare']:,} steps; {modes}) from FLARE's init over "
        f"FLARE's batch order, the script's own loader serving them: `loop_df_fl.py` ↔ FLARE "
        f"{_steps_verdict(pair)} (every state entry, BatchNorm's statistics included, after steps 1, 2, 5 and "
        f"every epoch; \"same\" up to {r['same_threshold']:g}); test accuracy {acc['script']:.2f} "
        f"(`loop_df_fl.py`) and {acc['flare']:.2f} (FLARE) ({name}).")
    order = ("" if "first_epoch_order_equals_flare" not in own else
             f"; client {loc['client']}'s first-epoch batch order "
             + ("is FLARE's" if own["first_epoch_order_equals_flare"] else
                f"is not ({own['first_epoch_positions_equal']:,} of {loc['samples']:,} positions agree)"))
    out.append(
        f"The script's own draws at seed {r['seed']}: its initial model "
        + ("is FLARE's, bit for bit" if own["init_max_abs_diff"] == 0 else
           f"differs from FLARE's (largest difference {own['init_max_abs_diff']:.1e})")
        + f"; its split {'is' if own['split_equals_flare'] else 'is not'} FLARE's{order} ({name}).")
    srv = r.get("server")
    if srv:
        sc, fl = srv["script"], srv["flare"]
        out.append(
            f"Over the {len(srv['client_sizes'])} clients `loop_df_fl.py` trained at the cell: its own pretrain "
            f"statements (`average_weights`, `Ensemble`, `test`) score FedAvg {sc['fedavg']:.2f} and the ensemble "
            f"{sc['ensemble']:.2f}; FLARE's server as the table runs it, over the same clients: FedAvg "
            f"{fl['fedavg']:.2f} (its average within {srv['average_max_abs_diff']:.1e} of the script's) and the "
            f"ensemble {fl['ensemble']:.2f} ({name}).")
    return out


def _fuse_oracle(r: dict, name: str) -> list[str]:
    """benchmarks/reference_fuse.py: FLARE's server strategy over the clients a run of the paper's code trained,
    against what the script's own server made of them (and the same clients' FedAvg and ensemble on both sides)."""
    sc, fl = r["script"], r["flare"]
    budget = ", ".join(f"{k} {v}" for k, v in sorted(r.get("fuse_options", {}).items()))
    script = _script_file(r["reference"].get("reference")) or "the script"
    return [f"Over the {len(fl['client_sizes'])} clients `{script}` trained at α = {r['alpha']:g}, seed {r['seed']}: "
            f"FLARE's `{r['strategy']}` as the column runs it ({budget or 'the table options'}) reads "
            f"{fl['final']:.2f} at its last epoch and {fl['best']:.2f} at its best, against the script's "
            f"{sc['final']:.2f} and {sc['best']:.2f}; the same clients' FedAvg {fl['fedavg']:.2f} and ensemble "
            f"{fl['ensemble']:.2f} in FLARE, {sc['fedavg']:.2f} and {sc['ensemble']:.2f} in the script "
            f"({fl['cpu_seconds'] / 3600:.2f} CPU-hours; {name})."]


ORACLE_LINES = {"benchmarks/reference_fedlpa_oracle.py": _fedlpa_oracle,
                "benchmarks/reference_dense_oracle.py": _dense_oracle,
                "benchmarks/reference_fuse.py": _fuse_oracle}


def _cell_config(d: Path) -> dict:
    return yaml.safe_load((d / "config.yaml").read_text()) if (d / "config.yaml").is_file() else {}


def published(spec: dict, col: str, alpha: float) -> float | None:
    """The paper's printed number for a column at α (YAML may key α as a number or a string), or None."""
    by_alpha = (spec.get("published") or {}).get(col) or {}
    pub = by_alpha.get(alpha, by_alpha.get(str(alpha)))
    return None if pub is None else float(pub)


def published_text(spec: dict, col: str, alpha: float) -> str:
    """The paper column's text. A column the table's `published` does not list is one the paper has no such column
    for (an extra column, or a method the paper does not run); a listed column whose value is null is one the
    paper prints but no stored source gave us. The reader must be able to tell the two apart."""
    pub = published(spec, col, alpha)
    if pub is not None:
        return f"{pub:.2f}"
    return "not found" if col in (spec.get("published") or {}) else "not in the paper"


def draws(spec: dict, metas: list[tuple[Path, dict]]) -> list[tuple[str, float, list[tuple[int, float]],
                                                                  list[tuple[int, float]]]]:
    """`spread: true`: per column and α that has values, every seed's final value in seed order, as the registered
    draws and those added post hoc (`split_draws`)."""
    if not spec.get("spread"):
        return []
    out = []
    for col, c in spec["columns"].items():
        for alpha in spec["alphas"]:
            vals = [(m["seed"], cell_value(d, c["key"], "final")) for d, m in metas
                    if m["method"] == c["method"] and float(m["alpha"]) == float(alpha)]
            pre, post = split_draws(spec, alpha, [(sd, v) for sd, v in vals if math.isfinite(v)])
            if pre or post:
                out.append((col, alpha, pre, post))
    return out


def rank_p(values: list[float], pub: float) -> tuple[str, int, float]:
    """Were the paper's run one more draw of our setting (exchangeable with our draws), the chance that it lies at
    least as far out on its side of our draws as it does: (our draws at or beyond it + 1) / (our draws + 1). A rank
    test: it assumes nothing of the draws' distribution (they are skewed, so a normal interval would mislead), and
    with every draw on one side it is 1 / (n + 1) — so n draws can reject "one lucky draw" at 0.05 only when
    n ≥ 19. Returns the side ('above' or 'below' the median of our draws), the draws at or beyond it, and p."""
    side = "above" if pub >= float(np.median(values)) else "below"
    beyond = sum(1 for v in values if (v >= pub if side == "above" else v <= pub))
    return side, beyond, (beyond + 1) / (len(values) + 1)


def rank_verdict(n: int, beyond: int, p: float) -> str:
    """What the rank test can say with n draws: reject at 0.05, or not — and, with every draw on one side, that n
    is too small for it to reject at all (1/(n + 1) > 0.05 below 19 draws), which is no finding about the paper."""
    if p <= 0.05:
        return f"at or under 0.05: {n} draws reject it as one more draw of ours"
    if beyond == 0:
        return (f"the smallest p that {n} draws allow, and above 0.05: {n} draws cannot reject it whatever the "
                "paper ran (19 could)")
    return f"{n} draws cannot tell it from ours"


def spread_lines(spec: dict, metas: list[tuple[Path, dict]]) -> list[str]:
    """Every draw's value and their range beside the paper's number. A paper that prints one run is one draw: the
    question is whether it could be one of our draws, answered by `rank_p` over the registered draws and said as
    what n draws can and cannot reject (`rank_verdict`); the draws added post hoc are listed, and the test over
    all draws is given apart, marked post hoc."""
    out = []
    for col, alpha, pre, post in draws(spec, metas):
        pub = published(spec, col, alpha)
        line = f"{col}, α = {alpha:g}, by seed: " + ", ".join(f"{sd}: {v:.2f}" for sd, v in pre)
        if post:
            line += "; added post hoc: " + ", ".join(f"{sd}: {v:.2f}" for sd, v in post)
        if pre:
            lo, hi = min(v for _, v in pre), max(v for _, v in pre)
            line += f" — range {lo:.2f}–{hi:.2f} over {'the ' * bool(post)}{len(pre)} {'registered ' * bool(post)}draw" \
                    + "s" * (len(pre) != 1)
        if pub is not None and pre:
            side, beyond, p = rank_p([v for _, v in pre], pub)
            line += (f". Were the paper's {pub:.2f} one more draw of this setting, one at least this "
                     f"{'high' if side == 'above' else 'low'} has rank probability ({beyond} + 1)/({len(pre)} + 1) = "
                     f"{p:.3f} (one-sided): {rank_verdict(len(pre), beyond, p)}")
            if post:
                every = [v for _, v in pre + post]
                side, beyond, p = rank_p(every, pub)
                line += (f". Over all {len(every)} draws, post hoc and not a test: ({beyond} + 1)/({len(every)} + 1) "
                         f"= {p:.3f}")
        out += [line + ".", ""]
    return [""] + out if spec.get("spread") else []


def _axes(height: float, width: float = 7.4):
    """A figure `width` × `height` inches on matplotlib's file-only backend (the block is drawn where no display
    is)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(figsize=(width, height))


def _save(fig, path: Path) -> Path:
    """Write `fig` to `path` at the block's resolution, free it, and give back the name the block links."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path.name)


def three_numbers_figure(spec: dict, rows: list[dict], img_dir: Path | None) -> Path | None:
    """One row per cell that has a finished run of the paper's code: its seeds (triangles) and FLARE's (dots), each
    at the paper's rule and labelled with its seed, and the paper's number as a mark — where the gap lies is read off
    which pair stands apart. None when no cell of the table has a run of the code."""
    rows = [r for r in rows if r["theirs"]]
    if not rows:
        return None
    out = Path(f"papers-{spec['table']}-three-numbers.png")
    if img_dir is None:
        return out
    fig, ax = _axes(1.3 + 0.8 * len(rows))
    said: set[str] = set()

    def once(label: str) -> str | None:  # each legend entry once
        if label in said:
            return None
        said.add(label)
        return label

    for y, r in enumerate(rows):
        for off, values, marker, colour, label in ((-0.15, r["theirs"], "^", "C1", "their code, a seed"),
                                                   (0.15, r["chosen"], "o", "C0", "FLARE, a seed")):
            xs = list(values.values())
            ax.scatter(xs, [y + off] * len(xs), marker=marker, color=colour, zorder=3, label=once(label))
            for sd, v in values.items():
                ax.annotate(str(sd), (v, y + off), textcoords="offset points", xytext=(0, -11 if off > 0 else 5),
                            ha="center", fontsize=7)
        if r["pub"] is not None:
            ax.vlines(r["pub"], y - 0.38, y + 0.38, colors="C3", linestyles="--", zorder=1,
                      label=once("the paper's number"))
    ax.set_yticks(range(len(rows)), [f"{r['col']}, α = {r['alpha']:g} ({r['rule']})" for r in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the first row on top
    ax.set_xlabel("test accuracy (%), at the paper's rule; each marker one seed (labelled)")
    ax.set_title(f"{spec['table']}: the paper, its own code and FLARE", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return _save(fig, img_dir / out)


def spread_figure(spec: dict, metas: list[tuple[Path, dict]], img_dir: Path | None) -> Path | None:
    """One row of dots per column and α (a dot per seed, labelled; a draw added post hoc hollow) with the paper's
    number as a mark on the same row; None when the table lists no spread or has no value yet."""
    rows = [(f"{col}, α = {alpha:g}", pre + post, published(spec, col, alpha), {sd for sd, _ in post})
            for col, alpha, pre, post in draws(spec, metas)]
    if not rows:
        return None
    out = Path(f"papers-{spec['table']}-spread.png")
    if img_dir is None:
        return out
    fig, ax = _axes(1.2 + 0.7 * len(rows))
    for y, (label, vals, pub, late) in enumerate(rows):
        pre = [v for sd, v in vals if sd not in late]
        ax.scatter(pre, [y] * len(pre), color="C0", zorder=3, label="our registered draws" if y == 0 else None)
        if late:
            ax.scatter([v for sd, v in vals if sd in late], [y] * len(late), facecolors="none", edgecolors="C0",
                       zorder=3, label="draws added post hoc" if not any(r[3] for r in rows[:y]) else None)
        last, up = None, True
        for sd, v in sorted(vals, key=lambda t: t[1]):  # neighbours closer than 1.5 points: labels above and below
            up = not up if last is not None and v - last < 1.5 else True
            ax.annotate(str(sd), (v, y), textcoords="offset points", xytext=(0, 7 if up else -14), ha="center",
                        fontsize=7)
            last = v
        if pub is not None:
            ax.vlines(pub, y - 0.35, y + 0.35, colors="C3", linestyles="--", zorder=1,
                      label="the paper's run" if not any(r[2] is not None for r in rows[:y]) else None)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.set_ylim(len(rows) - 0.4, -0.6)  # the first row on top
    ax.set_xlabel("test accuracy (%), each dot one seed (labelled)" + ("; hollow: added post hoc" if any(
        r[3] for r in rows) else ""))
    ax.set_title(f"{spec['table']}: the spread of partition draws", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return _save(fig, img_dir / out)


def budget_notes(spec: dict, metas: list[tuple[Path, dict]]) -> list[str]:
    """One line per fused data-free server: the generator steps it ran (the fuse record's options over the cell's
    config) against those of the cell's config, which are the paper's."""
    out = []
    for col, c in spec["columns"].items():
        if not c["key"].startswith("fuse:"):
            continue
        name = c["key"][5:]
        ran, paper = set(), set()
        for d, m in metas:
            if m["method"] != c["method"]:
                continue
            opts = _cell_config(d).get("server", {}).get("strategies", {}).get(name, {})
            for r in fuse_records(d, name)[-1:]:
                used = {**opts, **(r.get("options") or {})}
                if "g_steps" in used or "g_steps" in opts:
                    ran.add((used.get("epochs"), used.get("g_steps")))
                    paper.add((opts.get("epochs"), opts.get("g_steps")))
        for (e, g), (pe, pg) in zip(sorted(ran), sorted(paper)):
            if None in (e, g, pe, pg):
                continue
            short = "" if (e, g) == (pe, pg) else " — **a shortened budget**; the curve below shows where it was heading"
            out.append(f"{col}'s server: {e} epochs × {g} generator steps = {e * g:,} (the paper's: {pe} × {pg} = "
                       f"{pe * pg:,}){short}.")
    return ([""] + out + [""]) if out else []


def in_progress(cell_dir: Path) -> dict[str, dict]:
    """A cell's unfinished fusions (`progress`), each with the budget it runs to (`epochs`, `g_steps`: the cell's
    config under the note's options); a strategy whose fuse record is in has none."""
    f = cell_dir / PROGRESS
    if not f.is_file():
        return {}
    out = {}
    for s, e in json.loads(f.read_text()).items():
        if fuse_records(cell_dir, s):
            continue
        used = {**_cell_config(cell_dir).get("server", {}).get("strategies", {}).get(s, {}), **e["options"]}
        out[s] = {**e, "epochs": used.get("epochs"), "g_steps": used.get("g_steps")}
    return out


def progress_lines(spec: dict, metas: list[tuple[Path, dict]]) -> list[str]:
    """One line per unfinished fusion of a table's column: how far it got and its curve so far — no result (its
    column stays empty), the way the budget was heading when the last sitting ended."""
    out = []
    for col, c in spec["columns"].items():
        if not c["key"].startswith("fuse:"):
            continue
        for d, m in sorted(metas, key=lambda t: (float(t[1]["alpha"]), t[1]["seed"])):
            e = in_progress(d).get(c["key"][5:]) if m["method"] == c["method"] else None
            if e is None:
                continue
            steps = ("" if e["g_steps"] is None else
                     f" ({e['epoch'] * e['g_steps']:,} of {e['epochs'] * e['g_steps']:,} generator steps)")
            curve = ", ".join(f"{100 * p[2]:.2f}" for p in e["curve"])
            best = max(e["curve"], key=lambda p: p[2]) if e["curve"] else None
            head = (f"**stopped, not a result** — at epoch {e['epoch']} of {e['epochs']}{steps}, after "
                    f"{_duration(e['seconds'] / 3600)} (state of {e['as_of']}); stopped on {e['stopped']['on']}: "
                    f"{e['stopped']['why']}" if e.get("stopped") else
                    f"**in progress, not a result** — epoch {e['epoch']} of {e['epochs']}{steps}, "
                    f"{_duration(e['seconds'] / 3600)} so far (state of {e['as_of']})")
            out.append(f"{col} over the {m['method']} α = {float(m['alpha']):g}, seed-{m['seed']} clients: {head}"
                       + (f"; the student's test accuracy every {e['curve'][0][1]:,} steps: {curve} (highest "
                          f"{100 * best[2]:.2f} at step {best[1]:,})" if best else "") + ".")
    return ([""] + out + [""]) if out else []


def other_servers(spec: dict, metas: list[tuple[Path, dict]]) -> list[str]:
    """Every fuse record of a cell that is not one of the table's servers at the table's options — a server fused
    over the same clients by hand (another option, a plugin's strategy): a diagnostic, listed, never a column."""
    rows = []
    for d, m in sorted(metas, key=lambda t: (float(t[1]["alpha"]), t[1]["seed"], t[1]["method"])):
        table_keys = {_key(s, (m.get("fuse_options") or {}).get(s)) for s in m.get("fuse", [])}
        for r in _jsonl(d / "fuse.jsonl"):
            if r.get("kind") != "fuse" or _key(r.get("strategy"), r.get("options")) in table_keys:
                continue
            opts = ", ".join(f"{k}={v}" for k, v in sorted((r.get("options") or {}).items())) or "its defaults"
            rows.append(f"| {m['method']} | {float(m['alpha']):g} | {m['seed']} | {r['strategy']} | {opts} | "
                        f"{100 * float(r['acc']):.2f} | {_duration(float(r.get('seconds', 0)) / 3600)} |")
    if not rows:
        return []
    return ["", "Other servers fused over the same clients (by hand, `flare fuse`; diagnostics, not columns):", "",
            "| clients | α | seed | server | options | accuracy | wall |", "| --- | --- | --- | --- | --- | --- | --- |",
            *rows]


def _cell_hours(cell_dir: Path) -> float:
    """A cell's clients and evaluation in wall hours: the sum of its round records' `seconds` (local training,
    aggregation, evaluation). Resumed runs keep every finished round's record, so the sum is the cell's cost
    however often it was interrupted."""
    return sum(float(r.get("seconds", 0.0)) for r in _jsonl(cell_dir / "metrics.jsonl")
               if r.get("kind") == "round") / 3600


def client_hours(cell_dirs: list[Path]) -> list[float]:
    """Each recorded client cell's wall hours (`_cell_hours`; a cell without timings left out): the rate the block's
    cost line and the dry run price a method's cells at."""
    return [h for h in map(_cell_hours, cell_dirs) if h > 0]


def fusion_hours(records: list[list[dict]]) -> list[float]:
    """Each cell's last fuse record of one server (`fuse_records`: at the table's options) in wall hours."""
    return [float(r[-1].get("seconds", 0.0)) / 3600 for r in records if r]


def _epoch_hours(note: dict) -> float:
    """An unfinished fusion's rate (its progress note): wall hours an epoch so far."""
    return note["seconds"] / note["epoch"] / 3600


def _duration(hours: float) -> str:
    return f"{hours:.2f} h" if hours >= 1 else f"{hours * 60:.0f} min" if hours * 60 >= 1 else f"{hours * 3600:.0f} s"


def _rate(values: list[float], unit: str) -> str:
    """Mean duration per unit, with the range and the count where there is more than one."""
    if len(values) == 1:
        return f"{_duration(values[0])} a {unit} (1)"
    spread = f"{_duration(min(values))}–{_duration(max(values))}"
    return f"{_duration(float(np.mean(values)))} a {unit} ({spread}, {len(values)})"


def cost_lines(spec: dict, metas: list[tuple[Path, dict]]) -> list[str]:
    """What the table's cells cost, measured from the records' own timings, and what its unrecorded cells and
    fusions would cost at those rates: the budget a reader plans with, from runs rather than from an estimate made
    before them. The table's cells are its columns' methods × α × seeds. Wall time, not CPU time: a process that
    shared its core or was paused reads slower, so the range is printed with the mean."""
    recorded = {d.name for d, _ in metas}
    plan: dict[str, set[str]] = {}                       # method -> the servers its columns fuse
    for c in spec["columns"].values():
        plan.setdefault(c["method"], set()).update([c["key"][5:]] if c["key"].startswith("fuse:") else [])
    parts, todo_h, todo_n, unknown = [], 0.0, 0, []
    for method, servers in plan.items():
        mine = [d for d, m in metas if m["method"] == method]
        hours = client_hours(mine)
        todo = [cell_name(method, a, sd) for a in spec["alphas"] for sd in seeds_for(spec, a)
                if cell_name(method, a, sd) not in recorded]
        if hours:
            parts.append(f"{method} clients {_rate(hours, 'cell')}")
            todo_h, todo_n = todo_h + np.mean(hours) * len(todo), todo_n + len(todo)
        elif todo:
            unknown.append(f"{len(todo)} {method} cell{'s' * (len(todo) != 1)}")
        for server in sorted(servers):
            recs = [fuse_records(d, server) for d in mine]  # each cell's fuse file read once
            secs = fusion_hours(recs)
            notes = [(d, e) for d, e in ((d, in_progress(d).get(server)) for d in mine)
                     if e and e["epoch"] and e["epochs"]]
            for d, e in notes:
                rate = _epoch_hours(e)
                if e.get("stopped"):  # its state is gone with its clients: both from the start again
                    again = _cell_hours(d) + rate * e["epochs"]
                    parts.append(f"its {server} server stopped at epoch {e['epoch']} of {e['epochs']} after "
                                 f"{_duration(e['seconds'] / 3600)} (to finish: the clients trained again and the "
                                 f"fusion from its first epoch, ≈ {_duration(again)} at their own rates)")
                    todo_h, todo_n = todo_h + again, todo_n + 2
                else:
                    left = rate * (e["epochs"] - e["epoch"])
                    parts.append(f"its {server} server in progress, epoch {e['epoch']} of {e['epochs']} after "
                                 f"{_duration(e['seconds'] / 3600)} (≈ {_duration(left)} more at its own rate)")
                    todo_h, todo_n = todo_h + left, todo_n + 1
            missing = len(todo) + sum(1 for r in recs if not r) - len(notes)
            if secs:
                parts.append(f"its {server} server {_rate(secs, 'fusion')}")
                todo_h, todo_n = todo_h + np.mean(secs) * missing, todo_n + missing
            elif missing:
                unknown.append(f"{missing} {server} fusion{'s' * (missing != 1)}")
    if not parts:
        return []
    rest = (f"still to run: {todo_n} {'client cell or fusion' if todo_n == 1 else 'client cells and fusions'}, "
            f"≈ {_duration(todo_h)} at these rates"
            if todo_n else "nothing left to run")
    if unknown:
        rest += f"; no rate yet for {', '.join(unknown)}"
    return [f"Cost, in wall hours from the records' own timings (one thread per process, on a machine shared with the "
            f"other tables' runs): {'; '.join(parts)}; {rest}.", ""]


def curve_figure(spec: dict, metas: list[tuple[Path, dict]], img_dir: Path | None) -> Path | None:
    """Test accuracy against generator steps of each fused data-free server (the records' `<name>.curve`), one
    line per α (the mean over the seeds) over thin per-seed lines, and the paper's printed value for that column and
    α dotted in the same colour, so the gap is read off the figure; None when no record has a curve."""
    curves: dict[tuple[str, float], list[list]] = {}
    going: list[tuple[str, float, str, list]] = []  # unfinished fusions (column, α, label, curve so far): dashed
    for col, c in spec["columns"].items():
        if not c["key"].startswith("fuse:"):
            continue
        for d, m in metas:
            if m["method"] != c["method"]:
                continue
            for r in fuse_records(d, c["key"][5:])[-1:]:
                if r.get(f"{c['key'][5:]}.curve"):
                    curves.setdefault((col, float(m["alpha"])), []).append(r[f"{c['key'][5:]}.curve"])
            e = in_progress(d).get(c["key"][5:])
            if e and e["curve"]:
                state = "stopped at" if e.get("stopped") else "in progress:"
                going.append((col, float(m["alpha"]), f"{col}, α = {float(m['alpha']):g}, seed {m['seed']} ({state} "
                              f"epoch {e['epoch']} of {e['epochs']})", e["curve"]))
    if not curves and not going:
        return None
    out = Path(f"papers-{spec['table']}-curve.png")
    if img_dir is None:  # the block names the figure; only `render` draws it
        return out
    pubs = []

    def paper_line(col: str, alpha: float, colour: str) -> None:
        if (pub := published(spec, col, alpha)) is not None:
            ax.axhline(pub, color=colour, ls=":", lw=1.2, label=f"{col}, α = {alpha:g}: the paper's {pub:.2f}")
            pubs.append(pub)

    fig, ax = _axes(3.6, width=6.4)
    for i, ((col, alpha), cs) in enumerate(sorted(curves.items())):
        colour = f"C{i}"
        for cv in cs:
            ax.plot([p[1] for p in cv], [100 * p[2] for p in cv], color=colour, lw=0.6, alpha=0.35)
        n = min(len(cv) for cv in cs)
        ax.plot([p[1] for p in cs[0][:n]], [100 * float(np.mean([cv[k][2] for cv in cs])) for k in range(n)],
                color=colour, lw=2, label=f"{col}, α = {alpha:g} ({len(cs)} seed{'s' if len(cs) > 1 else ''})")
        paper_line(col, alpha, colour)
    for j, (col, alpha, label, cv) in enumerate(going, len(curves)):
        ax.plot([p[1] for p in cv], [100 * p[2] for p in cv], color=f"C{j}", lw=1.5, ls="--", marker=".", label=label)
        if (col, alpha) not in curves:
            paper_line(col, alpha, f"C{j}")
    if pubs:  # a dotted line on the frame's edge is not seen
        ax.set_ylim(top=max(ax.get_ylim()[1], max(pubs) + 2))
    ax.set_xlabel("generator steps")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"{spec['table']}: the data-free server's student during its budget", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, img_dir / out)


def paired_rows(spec: dict, metas: list[tuple[Path, dict]], results: Path) -> list[str]:
    """`paired_with: {table: T, columns: [...]}` (or a list of such): each of this table's columns minus each of T's,
    seed by seed at the same α (the same partition and initial weights), final values: mean ± std and the 95 %
    half-width. `columns: {OURS: THEIRS, ...}` pairs only those; T may be this table itself (FLARE − FAFI). Entries
    naming the same T share one table (a dict holds one pair per key, so two pairs of one column need two entries)."""
    pws, grouped = spec.get("paired_with") or [], {}
    for pw in pws if isinstance(pws, list) else [pws]:
        grouped.setdefault(pw["table"], []).extend(
            list(pw["columns"].items()) if isinstance(pw["columns"], dict)
            else [(col, ocol) for col in spec["columns"] for ocol in pw["columns"]])
    return [line for table, pairs in grouped.items() if (results / table / "table.yaml").is_file()
            for line in _paired_with(spec, metas, results, table, pairs)]


def _paired_with(spec: dict, metas: list[tuple[Path, dict]], results: Path, table: str,
                 pairs: list[tuple[str, str]]) -> list[str]:
    if table == spec["table"]:  # a pairing within the table: its spec and cells are already read
        other, theirs = spec, metas
    else:
        other = yaml.safe_load((results / table / "table.yaml").read_text())
        theirs = _metas(results / table)
    where = "within" if table == spec["table"] else "with"
    out = ["", f"Paired {where} {table} by seed (ours − theirs, final values; the seeds both tables registered):", "",
           "| ours | theirs | α | seeds | mean difference ± std | 95 % half-width |", "| --- | --- | --- | --- | --- | --- |"]
    for col, ocol in pairs:
        c, oc = spec["columns"][col], other["columns"][ocol]
        for alpha in spec["alphas"]:
            mine = {m["seed"]: cell_value(d, c["key"], "final") for d, m in metas
                    if m["method"] == c["method"] and float(m["alpha"]) == float(alpha)}
            them = {m["seed"]: cell_value(d, oc["key"], "final") for d, m in theirs
                    if m["method"] == oc["method"] and float(m["alpha"]) == float(alpha)}
            seeds = sorted(k for k in mine.keys() & them.keys() if math.isfinite(mine[k]) and math.isfinite(them[k])
                           and k in registered(spec, alpha) and k in registered(other, alpha))
            mean, sd, hw, n = summarise([mine[k] - them[k] for k in seeds])
            out.append(f"| {col} | {ocol} | {alpha:g} | {seed_text(seeds) or '—'} | "
                       f"{'—' if n == 0 else (f'{mean:+.2f}' if n == 1 else f'{mean:+.2f} ± {sd:.2f}')} | "
                       f"{'—' if not math.isfinite(hw) else f'±{hw:.2f}'} |")
    return out + [""]


def replace_block(text: str, body: str) -> str:
    i, j = text.index(BEGIN), text.index(END)
    return text[:i + len(BEGIN)] + "\n" + body + text[j:]


def committed_block(text: str) -> str:
    i, j = text.index(BEGIN), text.index(END)
    return text[i + len(BEGIN) + 1:j]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/papers.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a table's cells one at a time, resumably")
    r.add_argument("table")
    r.add_argument("--runs", default=str(ROOT / "runs" / "papers"))
    r.add_argument("--commit", action="store_true", help="git-commit each finished cell's records directory")
    r.add_argument("--dry-run", action="store_true", help="list the cells and their status, run nothing")
    r.add_argument("--defer", action="append", default=[], metavar="STRATEGY",
                   help="leave this server strategy for a later pass; the cell is recorded without it")
    r.add_argument("--fuse-only", action="store_true",
                   help="train nothing: fuse (and record) only the cells whose clients have finished")
    r.add_argument("--cells", action="append", default=[], metavar="NAME",
                   help="take only this cell (repeatable; names as --dry-run lists them): two processes, two cells")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a flare override for every cell (a shortened budget: it lands in each cell's config)")
    r.add_argument("--results", default=str(RESULTS), help="the records directory (default results/papers)")
    t = sub.add_parser("describe", help="rewrite a recorded table's description (the paper's numbers, notes) "
                                        "from its table file, without running a cell")
    t.add_argument("table")
    t.add_argument("--results", default=str(RESULTS), help="the records directory (default results/papers)")
    q = sub.add_parser("progress", help="record how far the table's unfinished data-free fusions have got (their "
                                        "curve so far, no weights), for a sitting that ends before they do")
    q.add_argument("table")
    q.add_argument("--runs", default=str(ROOT / "runs" / "papers"))
    q.add_argument("--results", default=str(RESULTS), help="the records directory (default results/papers)")
    q.add_argument("--commit", action="store_true", help="render the block and commit it with the notes")
    q.add_argument("--stopped", metavar="WHY", help="mark the recorded unfinished fusions as stopped for this reason "
                   "(their state is gone, e.g. the machine that held it was replaced): the block stops pricing them "
                   "as going on; refused where a state is still on disk")
    g = sub.add_parser("render", help="rewrite docs/papers.md's block from results/papers/")
    g.add_argument("--check", action="store_true", help="exit 1 if the committed block is stale")
    g.add_argument("--results", default=str(RESULTS), help="the records directory (default results/papers)")
    g.add_argument("--reference", default=str(REFERENCE), help="the runs of the papers' own code (default "
                                                               "results/papers-reference)")
    a = ap.parse_args(argv)
    try:
        for option in ("table", "runs", "results"):  # a path the filesystem would refuse, refused as flare's are
            if getattr(a, option, None):
                check_path(getattr(a, option), option if option == "table" else f"--{option}")
        return _command(a)
    except FlareError as e:  # a user's error: one paragraph, exit 2, never a traceback
        print(f"papers: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def _command(a: argparse.Namespace) -> int:
    """One command; what it refuses (a table file, a cell name, nothing to do) raises a FlareError before it writes."""
    spec = (load_table(a.table, records=Path(a.results) if a.cmd in ("run", "describe") else None)
            if a.cmd in ("run", "describe", "progress") else None)
    if a.cmd == "run":
        names = [c["name"] for c in cells(spec)]
        if unknown := [n for n in a.cells if n not in names]:
            raise FlareError(f"{a.table} has no cell {', '.join(unknown)}; its cells are {', '.join(names)}.",
                             key="--cells", fix="name cells as --dry-run lists them.")
        return run(spec, Path(a.runs), commit=a.commit, dry_run=a.dry_run, overrides=a.set, dest=Path(a.results),
                   defer=tuple(a.defer), fuse_only=a.fuse_only, only=tuple(a.cells), table_path=a.table)
    if a.cmd == "progress":
        if a.stopped is None:
            written, skipped = progress(spec, Path(a.runs), Path(a.results))
            if not written:
                raise FlareError(f"nothing recorded: " + ("; ".join(f"skipped {why}" for why in skipped) or
                                 f"no cell of {spec['table']} recorded in {a.results} has a server left to fuse "
                                 f"whose build state is under {Path(a.runs) / spec['table']}/<cell>/fuse-scratch/") + ".",
                                 key="progress", fix="record progress after a sitting that ends mid-fusion "
                                                     "(`run --fuse-only` starts one).")
            for why in skipped:
                print(f"papers: skipped {why}", file=sys.stderr)
        elif not a.stopped.strip():
            raise FlareError("--stopped needs the reason, as the block will print it.", key="--stopped",
                             fix='write --stopped "WHY".')
        else:
            written, refused = stop(spec, Path(a.runs), a.stopped.strip(), Path(a.results))
            if refused or not written:
                why = "; ".join(refused) or f"{spec['table']} has no recorded unfinished fusion not stopped already"
                raise FlareError(f"nothing marked stopped — {why}.", key="--stopped")
        for f in written:
            print(f)
        if a.commit and written:
            subprocess.check_call([sys.executable, str(Path(__file__).resolve()), "render", "--results", a.results],
                                  cwd=ROOT)
            _git_commit([*map(str, written), str(DOC), str(DOC.parent / "img")],
                        f"papers: {spec['table']} fusions {'stopped' if a.stopped else 'in progress'} "
                        f"({len(written)} cell{'s' * (len(written) != 1)})")
        return 0
    if a.cmd == "describe":
        if not (Path(a.results) / spec["table"]).is_dir():
            raise FlareError(f"{spec['table']} has no records under {a.results} yet; its first cell writes the "
                             "description.", key="describe", fix="run a cell of the table first.")
        print(describe(spec, Path(a.results)))
        return 0
    text = DOC.read_text()
    body = render(Path(a.results), img_dir=None if a.check else DOC.parent / "img", reference=Path(a.reference))
    if a.check:
        if committed_block(text) != body:
            print("papers: docs/papers.md's block differs from results/papers/ (run tools/papers.py render)")
            return 1
        return 0
    DOC.write_text(replace_block(text, body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
