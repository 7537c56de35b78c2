"""How reports show methods and strategies comes from the parts themselves: a preset's `order` (with its label and
colour), a strategy class's `title` and `colour` — no report module names a strategy."""
import ast
import re
from pathlib import Path

import pytest

from flare.config import list_presets
from flare.registry import STRATEGIES
from flare.report.runs import Row, row_order
from flare.report.style import method_order, rule_colour, rule_title
from flare.server.strategy import Strategy

REPORT = Path(__file__).resolve().parents[1] / "src" / "flare" / "report"


def test_rows_follow_the_presets_order_baselines_then_the_notes_variants():
    """The presets' `order` keeps the order the notes' names gave: the plain baselines, V4 … V14, then the rest."""
    def by_notes_name(name: str, meta: dict) -> tuple:
        m = re.search(r"V(\d+)", str(meta.get("notes_name", "")))
        return (int(m.group(1)) if m else (-1 if name in ("fedavg", "ensemble") else 99), name)

    presets = list_presets()
    rows = [Row(name, name, {}, []) for name in presets]
    expected = sorted(presets, key=lambda n: by_notes_name(n, presets[n]))
    assert [r.method for r in sorted(rows, key=row_order)] == expected
    assert method_order("fedavg") < method_order("fafi") < method_order("etf-anneal") < method_order("flare")


def test_a_method_no_preset_orders_comes_after_those_that_do():
    stated = [method_order(n) for n, meta in list_presets().items() if "order" in meta]
    assert stated and method_order("a-plugin-method") > max(stated)


@pytest.fixture
def looked_after_strategy():
    class Looked(Strategy):
        """A strategy that says how reports show it."""
        title, colour = "a looked-after rule", "#123456"

    STRATEGIES.register("looked_after", Looked)
    yield Looked
    del STRATEGIES._entries["looked_after"]


def test_a_strategy_states_its_title_and_colour(looked_after_strategy):
    assert rule_title("looked_after") == "a looked-after rule"
    assert rule_colour("looked_after") == "#123456"


def test_a_strategy_without_them_leaves_the_choice_to_the_report():
    plain = next(n for n in STRATEGIES.names() if not getattr(STRATEGIES.get(n), "title", None))
    assert rule_title(plain) is None and rule_colour(plain) is None
    assert rule_title("no_such_rule") is None and rule_colour("no_such_rule") is None


def test_the_built_in_rules_bring_their_own_looks():
    for name in ("feature", "iffi", "output", "fedavg"):
        cls = STRATEGIES.get(name)
        assert rule_title(name) == cls.title and rule_colour(name) == cls.colour


def test_no_report_module_names_a_strategy():
    """A strategy's name in report/ would be a second place that knows about it; the strategy states it instead."""
    names = set(STRATEGIES.names()) | {f"acc_{n}" for n in STRATEGIES.names()}
    found = [f"{p.name}:{node.lineno}: {node.value!r}" for p in sorted(REPORT.glob("*.py"))
             for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names]
    assert not found, found
