"""Progress for long work: tqdm bars on a terminal, a few plain lines when the output goes to a file or a pipe.

Bar refreshes in a log file are noise (a redirected `make run` once wrote 1,264 of them); without a terminal a
run prints one line when a round ends, at most one every `LINE_EVERY` seconds, and always for the last round.
"""
from __future__ import annotations

import os
import sys
import time

from tqdm.auto import tqdm

LINE_EVERY = 30.0  # seconds between plain progress lines (a bar's refreshes are free on a terminal, not in a log)


def quiet_env() -> bool:
    return os.environ.get("FLARE_QUIET", "") not in ("", "0")


def interactive(stream=None) -> bool:
    stream = stream or sys.stderr
    return hasattr(stream, "isatty") and stream.isatty()


class Progress:
    def __init__(self, total_rounds: int, steps_per_round: int, start_round: int = 0, desc: str = "",
                 disable: bool = False, stream=None):
        self.stream = stream or sys.stderr
        self.disable = disable or quiet_env()
        self.bars = not self.disable and interactive(self.stream)
        self.total, self.done, self.desc = total_rounds, start_round, desc
        self.t0 = self.last_line = time.monotonic()
        self.rounds = tqdm(total=total_rounds, initial=start_round, desc=f"{desc} rounds", unit="round",
                           position=0, disable=not self.bars, file=self.stream, dynamic_ncols=True)
        self.steps = tqdm(total=steps_per_round, desc="  steps", unit="batch", position=1, leave=False,
                          disable=not self.bars, file=self.stream, dynamic_ncols=True)

    def client(self, cid: int) -> None:
        self.steps.set_description(f"  client {cid}" if cid >= 0 else "  all clients")

    def step(self) -> None:
        self.steps.update(1)

    def round_done(self, acc: float) -> None:
        self.done += 1
        self.rounds.set_postfix(acc=f"{acc:.4f}")
        self.rounds.update(1)
        self.steps.reset()
        now = time.monotonic()
        if not self.disable and not self.bars and (now - self.last_line >= LINE_EVERY or self.done == self.total):
            print(f"{self.desc}: round {self.done}/{self.total}, acc {100 * acc:.2f}%, {now - self.t0:.0f} s",
                  file=self.stream, flush=True)
            self.last_line = now

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.steps.close()
        self.rounds.close()


class Counter:
    """Items of a longer job (sweep points, power iterations): a bar on a terminal, a line per `LINE_EVERY` s (and
    the last item) otherwise."""

    def __init__(self, total: int, initial: int = 0, desc: str = "", unit: str = "item", disable: bool = False,
                 stream=None):
        self.stream = stream or sys.stderr
        self.disable = disable or quiet_env()
        self.bar = not self.disable and interactive(self.stream)
        self.total, self.n, self.desc, self.unit, self.note = total, initial, desc, unit, ""
        self.t0 = self.last = time.monotonic()
        self._tqdm = tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=not self.bar, file=self.stream,
                          dynamic_ncols=True)

    def set_postfix_str(self, note: str) -> None:
        self.note = note
        self._tqdm.set_postfix_str(note)

    def update(self, k: int = 1) -> None:
        self.n += k
        self._tqdm.update(k)
        now = time.monotonic()
        if not self.disable and not self.bar and (now - self.last >= LINE_EVERY or self.n >= self.total):
            print(f"{self.desc}: {self.n}/{self.total} {self.unit}s{' (' + self.note + ')' if self.note else ''}, "
                  f"{now - self.t0:.0f} s", file=self.stream, flush=True)
            self.last = now

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._tqdm.close()
