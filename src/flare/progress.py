"""Progress bars for long work (tqdm): rounds with ETA, and the steps of the round in progress."""
from __future__ import annotations

import os
import sys

from tqdm.auto import tqdm


def quiet_env() -> bool:
    return os.environ.get("FLARE_QUIET", "") not in ("", "0")


class Progress:
    def __init__(self, total_rounds: int, steps_per_round: int, start_round: int = 0, desc: str = "",
                 disable: bool = False):
        self.disable = disable or quiet_env()
        self.rounds = tqdm(total=total_rounds, initial=start_round, desc=f"{desc} rounds", unit="round",
                           position=0, disable=self.disable, file=sys.stderr, dynamic_ncols=True)
        self.steps = tqdm(total=steps_per_round, desc="  steps", unit="batch", position=1, leave=False,
                          disable=self.disable, file=sys.stderr, dynamic_ncols=True)

    def client(self, cid: int) -> None:
        self.steps.set_description(f"  client {cid}" if cid >= 0 else "  all clients")

    def step(self) -> None:
        self.steps.update(1)

    def round_done(self, acc: float) -> None:
        self.rounds.set_postfix(acc=f"{acc:.4f}")
        self.rounds.update(1)
        self.steps.reset()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.steps.close()
        self.rounds.close()
