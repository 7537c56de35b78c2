"""User-facing errors.

Everything a user can get wrong (a config key, a missing dataset, an unreadable archive) raises
`FlareError`. The CLI turns it into one paragraph on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations


class FlareError(Exception):
    """A problem the user can fix. `key` names the config key at fault (if any), `fix` says how."""

    def __init__(self, message: str, *, key: str | None = None, fix: str | None = None):
        self.key, self.fix, self.message = key, fix, message
        super().__init__(self.render())

    def render(self) -> str:
        head = f"{self.key}: " if self.key else ""
        tail = f" Fix: {self.fix}" if self.fix else ""
        return f"{head}{self.message}{tail}"


class KeyedValueError(ValueError):
    """A validation error that knows which key to blame (cross-key checks, plugin names and options); a ValueError
    so pydantic reports it with the rest of the config."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


class TrainingDiverged(FlareError):
    """A loss went NaN/Inf. Names the client, round and loss term; metrics written so far stay intact."""
