"""A run directory read back for reports, with "final" and "peak" defined once. Works on old, partial and foreign
runs alike (it never writes), and refuses a run whose config.yaml disagrees with its results' config."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flare.config.protocol import protocol_label
from flare.errors import FlareError
from flare.records import flatten
from flare.rundir import DIAG, FUSE, METRICS, PARTITION, RunDir, read_jsonl


def num(v: Any) -> float:
    """metrics.jsonl keeps non-finite floats as strings ("nan", "inf"); None → nan."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def peak_index(values) -> int | None:
    """Where a curve peaks, in every report: the first index of its largest finite value (None if it has none)."""
    a = np.array([num(v) for v in values], dtype=float)
    return None if not len(a) or np.isnan(a).all() else int(np.nanargmax(a))


@dataclass
class RunData:
    """One run directory's records, read once: what every report reads a run through."""
    dir: Path
    cfg: dict
    rounds: list[dict]
    clients: list[dict]
    state: dict
    partition: dict
    flat: dict = field(default_factory=dict)
    fused: list[dict] = field(default_factory=list)  # fuse.jsonl: `flare fuse` over the saved last-round states

    @classmethod
    def load(cls, d: str | Path) -> "RunData":
        rd = RunDir(d)
        try:
            cfg = rd.read_config() or {}
        except FlareError:
            cfg = {}
        if cfg:
            rd.check_consistent(key="DIR")  # never report one experiment's numbers under another's config
        recs = read_jsonl(rd.file(METRICS))
        flat = flatten(cfg)
        flat["protocol"] = protocol_label(cfg)  # the protocol and the items set away from it, in one value
        # Rounds skipped by eval.every carry no accuracy: reports read the evaluated rounds (their `round` keeps
        # the x position), so curves, peaks and finals never see a hole.
        return cls(Path(d), cfg, [r for r in recs if r.get("kind") == "round" and r.get("evaluated", True)],
                   [r for r in recs if r.get("kind") == "client"], rd.read_state(), rd.read_json(PARTITION), flat,
                   [r for r in read_jsonl(rd.file(FUSE)) if r.get("kind") == "fuse"])

    @property
    def method(self) -> str:
        return str(self.cfg.get("method") or self.cfg.get("preset") or self.dir.name)

    @property
    def seed(self):
        return self.cfg.get("seed")

    @property
    def protocol(self) -> str:
        """`clean`, `reference`, or the protocol plus the items this run set away from it (config/protocol.py); a
        run from before the switch existed is clean."""
        return str(self.flat.get("protocol", "clean"))

    @property
    def models(self) -> str:
        """Which network the clients ran: `cnn×0.125`, or who ran what (`1 × cnn, 2 × wrn16_1`); `→ d` when
        model.feature_dim projects to a shared d."""
        m = self.cfg.get("model", {})
        labels = [c["model"] for c in (self.partition or {}).get("clients", []) if "model" in c]
        d = f" → d={m['feature_dim']}" if m.get("feature_dim") else ""
        if len(set(labels)) > 1:
            return ", ".join(f"{labels.count(a)} × {a}" for a in dict.fromkeys(labels)) + f" (width {m.get('width')}{d})"
        width = m.get("width")
        return f"{m.get('name')}" + (f"×{width:g}" if isinstance(width, (int, float)) and width != 1.0 else "") + d

    @property
    def notes_name(self) -> str:
        return str(self.cfg.get("notes_name") or "")

    @property
    def backend(self) -> str:
        """How the run computed, in one line (state.json's `backend`, written by runs from the CPU-pinning on)."""
        b = self.state.get("backend") or {}
        if not b:
            return "not recorded (a run from before kernels were pinned)"
        rules = ", ".join(b.get("eval_rules") or [])
        mkl = f" (MKL: {b['mkl']})" if "mkl" in b else ""
        return (f"speed={b.get('speed')}, cpu_isa={b.get('cpu_isa')} → {b.get('cpu_kernels')} CPU kernels{mkl}, "
                f"amp={b.get('amp')}, channels_last={b.get('channels_last')}, evaluated every "
                f"{b.get('eval_every')} round(s) (the last always), rules: {rules}"
                + (f" — on {b['machine']}" if "machine" in b else ""))

    @property
    def speed_choice(self) -> str | None:
        """speed=fast on CPU: what its probe chose and the figures it chose from, in one line (None otherwise)."""
        c = (self.state.get("backend") or {}).get("speed_choice")
        if not c:
            return None
        figures = ", ".join(f"{k} {v:.1f}" for k, v in c.get("samples_per_s", {}).items())
        p = c.get("probe", {})
        if p.get("skipped"):
            return f"{c.get('statement')} (CPU: {c.get('cpu')})"
        return (f"{c.get('statement')}. Probe on {c.get('cpu')}: {figures} samples/s ({p.get('images_per_step')} "
                f"images per step, fastest of {p.get('steps')}; exact = fp32 NCHW on {p.get('exact_level')} kernels; "
                f"{'from the cache, measured' if c.get('cached') else 'measured'} in {p.get('seconds')} s)")

    @property
    def primary(self) -> str:
        return self.rounds[-1].get("primary", "") if self.rounds else ""  # every round record names it

    @property
    def finished(self) -> bool:
        return self.state.get("status") == "finished"

    @property
    def learner(self) -> str:
        return str(self.cfg.get("lam", {}).get("learner", "none"))

    def _key(self, key: str) -> str:
        return f"acc_{self.primary}" if key == "acc" else key

    def curve(self, key: str = "acc") -> np.ndarray:
        key = self._key(key)
        return np.array([num(r.get(key)) for r in self.rounds])

    def round_numbers(self) -> list[int]:
        """Rounds as people count them: round r is the evaluation after r rounds of training (1..R). metrics.jsonl's
        `round` field is the 0-based index, r − 1."""
        return [int(r["round"]) + 1 for r in self.rounds]

    def client_curve(self, key: str) -> np.ndarray | None:
        """rounds × clients array of a client-record value (nan where missing), None if never logged."""
        recs = [c for c in self.clients if key in c]
        if not recs:
            return None
        ids = sorted({c["client"] for c in self.clients})
        col = {cid: j for j, cid in enumerate(ids)}
        row = {int(r["round"]): i for i, r in enumerate(self.rounds)}
        out = np.full((len(self.rounds), len(ids)), np.nan)
        for c in recs:
            if c["round"] in row:
                out[row[c["round"]], col[c["client"]]] = num(c[key])
        return out

    def final(self, key: str) -> float:
        if not self.rounds:
            return float("nan")
        if key in ("lambda_raw", "lambda_eff", "lambda"):
            src = "lambda_raw_end" if key == "lambda_raw" and self.client_curve("lambda_raw_end") is not None else key
            cc = self.client_curve(src)
            return float(np.nanmean(cc[-1])) if cc is not None and np.isfinite(cc[-1]).any() else float("nan")
        if not (key == "acc" or key.startswith("acc_")):  # diagnostics: the last round's state
            return num(self.rounds[-1].get(key))
        tail = [num(r.get(self._key(key))) for r in self.rounds[-self.final_rounds:]]
        tail = [v for v in tail if math.isfinite(v)]
        return float(np.mean(tail)) if tail else float("nan")

    @property
    def final_rounds(self) -> int:
        """How many of the last evaluated rounds the final accuracy averages (config `eval.final_rounds`; 1 for a
        run from before the key existed)."""
        return max(1, int((self.cfg.get("eval") or {}).get("final_rounds") or 1))

    @property
    def final_label(self) -> str:
        """What "final" means for this run, in words: the last round, or the mean of rounds a–b."""
        rounds = self.round_numbers()[-self.final_rounds:]
        return "last round" if len(rounds) <= 1 else f"mean of rounds {rounds[0]}–{rounds[-1]}"

    def peak(self, key: str = "acc") -> tuple[float, int | None]:
        """The best value of a round metric and the round it was reached in (`peak_index`)."""
        c = self.curve(key)
        i = peak_index(c)
        return (float("nan"), None) if i is None else (float(c[i]), self.round_numbers()[i])

    def summary(self) -> dict:
        """Final and peak accuracy of the primary rule, the last round's accuracies and diagnostics."""
        if not self.rounds:
            return {}
        last = self.rounds[-1]
        out = {"method": self.method, "primary": self.primary, "rounds": len(self.rounds)}
        for k, v in last.items():
            if k.startswith("acc_") or k in DIAG:
                out[k] = self.final(k) if k.startswith("acc_") else v
        out["acc"] = self.final("acc")
        out["final"] = self.final_label
        out["peak_acc"], out["peak_round"] = self.peak("acc")
        return out
