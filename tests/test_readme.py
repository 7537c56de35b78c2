"""The README documents every config key and every preset (so docs cannot fall behind the code)."""
from pathlib import Path

from flare.config import config_reference, list_presets

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_config_key_is_in_the_readme():
    missing = [k for k, *_ in config_reference() if f"`{k}`" not in README]
    assert not missing, f"README's configuration reference lacks {missing}: paste `flare config-reference`"


def test_every_preset_is_in_the_methods_table():
    missing = [p for p in list_presets() if f"| `{p}` |" not in README]
    assert not missing, f"README's methods table lacks presets {missing}"


def test_readme_starts_with_the_two_commands():
    head = README[:600]
    assert "make run" in head and "make test" in head
