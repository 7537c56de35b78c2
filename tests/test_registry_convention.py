"""One calling convention for every registry: a part is built by `REGISTRY.create(name, facts, options)` — its
entry is a factory `(facts, options) -> part`, `facts` the frozen dataclass its registry declares — and no module of
flare calls a registry's entry any other way (`get` and `entry` only read what validation needs)."""
from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from flare.registry import CLIENT_ENGINES, REGISTRIES, Registry, load_builtins

SRC = Path(__file__).resolve().parents[1] / "src" / "flare"
ALL = REGISTRIES


def _takes_facts_and_options(obj) -> bool:
    """Whether `obj` is called as `obj(facts, options)`: exactly two positional parameters (a class: its
    constructor's, without self)."""
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required_rest = [p for p in params if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
    return len(positional) == 2 and not required_rest and not any(p.kind == p.VAR_POSITIONAL for p in params)


@pytest.mark.parametrize("kind", ALL)
def test_every_entry_is_built_from_facts_and_options(kind):
    load_builtins()
    reg: Registry = ALL[kind]
    facts = reg.facts
    assert dataclasses.is_dataclass(facts) and facts.__dataclass_params__.frozen, f"{kind}: facts not frozen"
    bad = [n for n in reg.names() if reg.get(n) is not None and not _takes_facts_and_options(reg.get(n))]
    assert not bad, f"{kind}: entries not of the form (facts, options) -> part: {bad}"


def test_create_refuses_other_facts():
    load_builtins()
    with pytest.raises(TypeError, match="AnchorFacts"):
        REGISTRIES["anchors"].create("etf", object())


def test_the_client_engines_are_read_not_built():
    """`client_engine` picks the runner's loop (runner.py); its registry holds each engine's `check(cfg)` only, so it
    declares no facts and builds nothing."""
    load_builtins()
    assert CLIENT_ENGINES.facts is None and set(CLIENT_ENGINES.names()) == {"sequential", "threads", "batched"}
    with pytest.raises(TypeError, match="nothing"):
        CLIENT_ENGINES.create("sequential", object())


REGISTRY_NAMES = {"MODELS", "DATASETS", "PARTITIONS", "REFERENCE_PARTITIONS", "ANCHORS", "SCALINGS", "LAM_PROVIDERS",
                  "SCHEDULES", "PROGRESS", "SURGERY", "CONTRAST", "OBJECTIVES", "LOSS_TERMS", "STRATEGIES",
                  "CLIENT_ENGINES"}
# what reading an entry for validation may call: a part's own checks, and a strategy's options as a config sets them
METADATA_CALLS = {"check", "options_in", "native_resolution", "names", "entry"}


def _lookup(node: ast.AST) -> str | None:
    """`REG.get(...)` or `REG.entry(...).obj`: the registry's name, else None."""
    if isinstance(node, ast.Attribute) and node.attr == "obj":
        node = node.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "entry")
            and isinstance(node.func.value, ast.Name) and node.func.value.id in REGISTRY_NAMES):
        return node.func.value.id
    return None


def entry_calls(tree: ast.AST) -> list[int]:
    """Lines that build a part other than through `create`: a looked-up entry called (directly, through a method
    other than the validation metadata, or through a name bound to it in the same function)."""
    lines = []
    for fn in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        bound = {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) and _lookup(n.value)
                 for t in n.targets if isinstance(t, ast.Name)}
        for n in ast.walk(fn):
            if not isinstance(n, ast.Call):
                continue
            f = n.func
            if _lookup(f) or (isinstance(f, ast.Name) and f.id in bound):
                lines.append(n.lineno)
            elif isinstance(f, ast.Attribute) and f.attr not in METADATA_CALLS and (
                    _lookup(f.value) or (isinstance(f.value, ast.Name) and f.value.id in bound)):
                lines.append(n.lineno)
    return sorted(set(lines))


def test_the_walk_sees_a_call_around_create():
    """The checker itself: it flags each way of calling an entry, and passes `create` and metadata reads."""
    code = ("def f(cfg):\n    SURGERY.get(cfg.x)(1, 2)\n    s = SCALINGS.get('a')\n    s(1)\n"
            "    OBJECTIVES.get('fafi').terms(1)\n    MODELS.entry('cnn').obj(3, 1.0)\n"
            "    PROGRESS.create('epoch', facts)\n    OBJECTIVES.get('fafi').head\n    STRATEGIES.get('x').check(cfg)\n"
            "    e = DATASETS.get('mnist')\n    e.build(None)\n    e.kind\n")
    assert entry_calls(ast.parse(code)) == [2, 4, 5, 6, 11]


def test_no_module_calls_an_entry_around_create():
    offenders = {str(p.relative_to(SRC)): lines for p in sorted(SRC.rglob("*.py"))
                 if (lines := entry_calls(ast.parse(p.read_text())))}
    assert not offenders, f"registry entries called outside `create`: {offenders}"
