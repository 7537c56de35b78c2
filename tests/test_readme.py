"""The README's generated blocks are current and untouched by hand (so docs cannot fall behind the code)."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("readme_tool", ROOT / "tools" / "readme.py")
tool = importlib.util.module_from_spec(spec)
sys.modules["readme_tool"] = tool  # dataclasses look their module up by name
spec.loader.exec_module(tool)
README = (ROOT / "README.md").read_text()


def test_generated_blocks_are_current_and_untouched():
    assert tool.problems(README) == []


def test_a_hand_edit_or_a_schema_change_is_caught():
    sha, body = tool.blocks(README)["config-reference"]
    edited = README.replace(body, body.replace("| `seed` | int | `1` |", "| `seed` | int | `2` |"))
    assert any("edited by hand" in p for p in tool.problems(edited))
    regenerated_with_a_row_less = tool.replace_block(README, "config-reference", "\n".join(body.splitlines()[:-1]))
    assert any("stale" in p for p in tool.problems(regenerated_with_a_row_less))


def test_every_preset_and_config_key_is_documented():
    assert all(f"| `{p}` |" in README for p in tool.list_presets())
    assert all(f"`{k}`" in README for k, *_ in tool.config_reference())


def test_readme_starts_with_the_two_commands():
    head = README[:600]
    assert "make run" in head and "make test" in head


def test_make_run_is_the_command_of_the_main_results_block():
    """`make run` and the README's main table come from the same command (so the table is what it prints)."""
    make = (ROOT / "Makefile").read_text()
    var = dict(line.split(" ?= ") for line in make.splitlines() if " ?= " in line)
    recipe = next(line.strip() for line in make.splitlines() if "flare compare --config configs/main.yaml" in line)
    recipe = recipe.replace("$(BIN)/", "").split(" $$extra")[0]
    for k, v in var.items():
        recipe = recipe.replace(f"$({k})", v)
    (block_cmd,) = tool.RESULTS["main"].commands
    assert recipe == block_cmd, (recipe, block_cmd)
