"""A plugin that raises on import (tests/test_bad_input.py)."""
raise RuntimeError("demo plugin is broken on purpose")
