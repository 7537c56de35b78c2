"""Progress for long work: tqdm bars on a terminal; without one (bar refreshes in a log file are noise), a plain
line at most every `LINE_EVERY` seconds, and always for the last item.
"""
from __future__ import annotations

import os
import sys
import time

from tqdm.auto import tqdm

LINE_EVERY = 30.0  # seconds between plain progress lines (a bar's refreshes are free on a terminal, not in a log)


class _Bars:
    """What both kinds share, on stderr."""

    def __init__(self, disable: bool):
        self.stream = sys.stderr
        self.disable = disable or os.environ.get("FLARE_QUIET", "") not in ("", "0")
        self.bars = not self.disable and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = self.last_line = time.monotonic()
        self._tqdms: list[tqdm] = []

    def _tqdm(self, **kw) -> tqdm:
        bar = tqdm(disable=not self.bars, file=self.stream, dynamic_ncols=True, **kw)
        self._tqdms.append(bar)
        return bar

    def _line(self, text: str, last: bool) -> None:
        """`text` and the seconds so far as a plain line (no terminal), when LINE_EVERY s passed or on the `last`."""
        now = time.monotonic()
        if not self.disable and not self.bars and (now - self.last_line >= LINE_EVERY or last):
            print(f"{text}, {now - self.t0:.0f} s", file=self.stream, flush=True)
            self.last_line = now

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for bar in reversed(self._tqdms):
            bar.close()


class Progress(_Bars):
    """Rounds of a run, and the steps of the round under way."""

    def __init__(self, total_rounds: int, steps_per_round: int, start_round: int = 0, desc: str = "",
                 disable: bool = False):
        super().__init__(disable)
        self.total, self.done, self.desc = total_rounds, start_round, desc
        self.rounds = self._tqdm(total=total_rounds, initial=start_round, desc=f"{desc} rounds", unit="round",
                                 position=0)
        self.steps = self._tqdm(total=steps_per_round, desc="  steps", unit="batch", position=1, leave=False)

    def client(self, cid: int) -> None:
        self.steps.set_description(f"  client {cid}" if cid >= 0 else "  all clients")

    def step(self) -> None:
        self.steps.update(1)

    def round_done(self, acc: float) -> None:
        self.done += 1
        self.rounds.set_postfix(acc=f"{acc:.4f}")
        self.rounds.update(1)
        self.steps.reset()
        self._line(f"{self.desc}: round {self.done}/{self.total}, acc {100 * acc:.2f}%", self.done == self.total)


class Counter(_Bars):
    """Items of a longer job (sweep points, power iterations)."""

    def __init__(self, total: int, initial: int = 0, desc: str = "", unit: str = "item", disable: bool = False):
        super().__init__(disable)
        self.total, self.n, self.desc, self.unit, self.note = total, initial, desc, unit, ""
        self.bar = self._tqdm(total=total, initial=initial, desc=desc, unit=unit)

    def set_postfix_str(self, note: str) -> None:
        self.note = note
        self.bar.set_postfix_str(note)

    def update(self, k: int = 1) -> None:
        self.n += k
        self.bar.update(k)
        self._line(f"{self.desc}: {self.n}/{self.total} {self.unit}s{' (' + self.note + ')' if self.note else ''}",
                   self.n >= self.total)
