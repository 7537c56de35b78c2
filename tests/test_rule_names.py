"""Core code names no server strategy: a built-in rule is read through the registry's class attributes
(`Strategy.primary_for`, `needs_prototypes`, …) exactly as a plugin's would be, so every string literal that equals
a registered strategy's name must sit in the module that defines (and registers) that strategy."""
import ast
from pathlib import Path

from flare.registry import STRATEGIES

SRC = Path(__file__).resolve().parents[1] / "src"


def named_strategies(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every string constant in the module equal to a built-in strategy's name (a plugin another
    test registered is not FLARE's to police). Docstrings and descriptions hold prose, never a bare name; a config
    key name is an identifier, not a constant."""
    names = {n for n in STRATEGIES.names() if STRATEGIES.entry(n).plugin is None}
    return [(n.lineno, n.value) for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names]


def test_no_strategy_name_outside_its_own_module():
    stray = []
    for path in sorted((SRC / "flare").rglob("*.py")):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        stray += [f"{path.relative_to(SRC)}:{line}: {name!r}" for line, name in named_strategies(path)
                  if STRATEGIES.get(name).__module__ != module]
    assert not stray, "server strategies named outside their own module (read them through the registry):\n" + \
        "\n".join(stray)


def test_the_check_sees_a_stray_name(tmp_path):
    """The scan would catch a core module that hard-codes a rule (the check can fail)."""
    f = tmp_path / "core.py"
    f.write_text('def primary(head):\n    """feature or output"""\n    return "feature" if head else "output"\n')
    assert named_strategies(f) == [(3, "feature"), (3, "output")]
