"""User-facing errors.

Everything a user can get wrong (a config key, a missing dataset, an unreadable archive) raises
`FlareError`. The CLI turns it into one paragraph on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import os
from pathlib import Path


SHORT = 80  # characters of a value an error message echoes


def short(value) -> str:
    """`repr(value)`, cut to its first SHORT characters: an error message names what the user wrote without echoing
    megabytes of it back (a YAML alias bomb under a known key expands to a value of any size)."""
    text = repr(value)
    return text if len(text) <= SHORT else f"{text[:SHORT]}… ({len(text):,} characters)"


class FlareError(Exception):
    """A problem the user can fix. `key` names the config key at fault (if any), `fix` says how."""

    def __init__(self, message: str, *, key: str | None = None, fix: str | None = None):
        self.key, self.fix, self.message = key, fix, message
        super().__init__(self.render())

    def render(self) -> str:
        """One paragraph, bounded: a part of it longer than MAX_PART (a value echoed whole somewhere) is cut."""
        head = f"{_cut(self.key)}: " if self.key else ""
        tail = f" Fix: {_cut(self.fix)}" if self.fix else ""
        return f"{head}{_cut(self.message)}{tail}"


MAX_PART = 4000  # characters of a message, a key or a fix; far above any message written on purpose


def _cut(text: str) -> str:
    text = str(text)
    return text if len(text) <= MAX_PART else f"{text[:MAX_PART]}… (cut: {len(text):,} characters)"


class KeyedValueError(ValueError):
    """A validation error that knows which key to blame (cross-key checks, plugin names and options); a ValueError
    so pydantic reports it with the rest of the config."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


class TrainingDiverged(FlareError):
    """A loss went NaN/Inf. Names the client, round and loss term; metrics written so far stay intact."""


ROOM = 200  # bytes of path a run writes below --out (compare's <preset>/seed=N/plots/<figure>.png)


def check_path(path: str, key: str) -> None:
    """Refuse a path the filesystem would refuse (a name over NAME_MAX bytes, a path that leaves no ROOM under
    PATH_MAX) before anything is read or written, instead of an OSError after the clients have trained."""
    name_max, path_max = os.pathconf("/", "PC_NAME_MAX"), os.pathconf("/", "PC_PATH_MAX")
    if long := next((p for p in Path(path).parts if len(p.encode()) > name_max), None):
        raise FlareError(f"{short(path)} holds a name of {len(long.encode())} bytes; this filesystem allows "
                         f"{name_max}.", key=key, fix="give a shorter name.")
    if len(os.path.abspath(path).encode()) > path_max - ROOM:
        raise FlareError(f"{short(path)} is {len(os.path.abspath(path).encode())} bytes long as an absolute path; "
                         f"this filesystem allows {path_max}, and a run writes up to {ROOM} more below it.", key=key,
                         fix="give a shorter path.")
