"""`flare paper --only reproduce`: the notes' CIFAR-10 table under both protocols, and a one-item protocol ablation.

Runs (all on one dataset, CIFAR-10 unless --datasets says otherwise; seeds from --seeds):

* **main table** (`reproduce`): α ∈ {0.05, 0.1, 0.3, 0.5} × {FedAvg, Ensemble, FAFI (V4), V7, FLARE} × the
  settings of the protocols asked for —
  `clean` (our protocol, card dealer), `reference` (protocol=reference on the official FAFI partition: the
  notes' first batch, docs/method.md#reference-numbers) — and, with `reference`, `reproduce-later`:
  protocol=reference on the card dealer (the notes' later batch) at the α where the notes have later-batch numbers
  (0.05, 0.3).
  Every run evaluates every fusion rule, so the IFFI columns need no runs of their own.
* **one-item ablation** (`ablation-from-<base>-<item>`): at α = 0.05 every protocol item flipped alone, from the
  clean setting to its reference value and from the reference setting to its clean value, on the methods the
  item can change (`AFFECTS`); the bases are the main table's runs.

`reproduce.json` in the output directory lists every point with its role, setting, item and run directory;
`flare_paper.reproduction.write_reproduction_report(out)` turns it into `report/reproduction.md` (the table, the
ablation, the figure of every fusion rule against rounds, the protocol of each column and the command).
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from flare.config import config_for_preset
from flare.config.load import key_default
from flare.config.protocol import ITEM_KEYS
from flare.errors import FlareError
from flare.experiments.sweep import SweepSpec, unflatten
from flare.records import flatten
from flare.rundir import atomic_write_text

from flare_paper.reproduction import MANIFEST

METHODS = ["fedavg", "ensemble", "fafi", "etf-anneal", "flare"]
# the config keys the report needs to match a point with the notes' numbers (paper/reference.py)
MATCH_KEYS = ("preset", "protocol", "dataset.name", "partition.", "progress", "rounds", "local_epochs", "batch_size",
              "seed", "align.", "lam.") + ITEM_KEYS

# setting name -> the keys that make it (beside the scale's common keys)
SETTINGS = {
    "clean": {"protocol": "clean", "partition.kind": "dirichlet"},
    "reference": {"protocol": "reference", "partition.kind": "dirichlet-fafi"},
    "reference-later": {"protocol": "reference", "partition.kind": "dirichlet"},
}
SETTING_TEXT = {
    "clean": "protocol=clean, card dealer (partition.kind=dirichlet)",
    "reference": "protocol=reference, official FAFI partition (dirichlet-fafi): the notes' first batch",
    "reference-later": "protocol=reference, card dealer (dirichlet): the notes' later batch",
}


def _anneals(c) -> bool:
    return c.align.anchors != "none" and (c.align.schedule != "constant" or c.align.target == "progressive"
                                          or (c.lam.learner != "none" and c.lam.anneal != "constant"))


# item key -> whether flipping it can change the primary accuracy of a run with config `c` (the base's)
AFFECTS: dict[str, Callable] = {
    "eval.bn": lambda c: c.head == "prototype",
    "augment.input_scaling": lambda c: True,
    "augment.per_image": lambda c: c.loss.objective == "fafi" or c.loss.ce_input == "augmented",
    "loss.ce_input": lambda c: c.loss.objective == "ce",
    "server.strategies.output.ensemble": lambda c: c.loss.objective == "ce" and c.server.primary == "output",
    "server.strategies.fedavg.buffers": lambda c: c.server.primary == "fedavg",
    "progress": _anneals,
    "align.target_progress": lambda c: c.align.anchors != "none" and c.align.target == "progressive",
    "server.protos_flow": lambda c: c.server.protos == "trainable",
    "amp": lambda c: c.device != "cpu",
    "drop_last": lambda c: True,
    "partition.rng": lambda c: c.partition.kind != "shards",
}


@dataclass
class Planned:
    """One experiment of the reproduction: its key, title, sweep and what each of its points stands for."""

    key: str
    title: str
    spec: SweepSpec
    meta: dict = field(default_factory=dict)  # role, setting / item, from, value


def settings_for(protocols: list[str]) -> list[str]:
    bad = [p for p in protocols if p not in ("clean", "reference")]
    if bad or not protocols:
        raise FlareError(f"--protocol {','.join(protocols)}: unknown protocol(s) {', '.join(bad) or '(none)'}.",
                         key="--protocol", fix="use clean, reference or clean,reference.")
    return [p for p in ("clean", "reference") if p in protocols]


def _flip(key: str, base_name: str, preset: str, base_flat: dict) -> object:
    """The value an item takes when flipped away from a base setting: from clean, the value the reference setting
    of this preset resolves it to; from reference, its clean value (the key's default)."""
    if base_name != "clean":
        return key_default(key)
    ref = {k: v for k, v in {**base_flat, **SETTINGS["reference"]}.items() if k not in ITEM_KEYS}
    return _get(config_for_preset(unflatten(ref), preset).model_dump(mode="json"), key)


def plan(scale, dataset: str, zip_values: dict, seeds: list[int], protocols: list[str], common: dict,
         overrides: dict) -> list[Planned]:
    """Every experiment of the reproduction as sweeps. `zip_values`: the flat dataset keys of the scale
    (`suite.dataset_mapping`); `common`: the scale's common keys; `overrides`: the user's KEY=VALUE."""
    names = settings_for(protocols)
    methods = list(scale.reproduce_methods)
    base = {**common, **zip_values}
    if scale.reproduce_rounds:
        base["rounds"] = scale.reproduce_rounds
    alphas = list(scale.reproduce_alphas)
    out = [Planned("reproduce", "protocol clean vs reference — main table",
                   SweepSpec(name="reproduce", description=f"{', '.join(methods)} × α × {', '.join(names)} on "
                             f"{dataset}", base=dict(base), presets=methods, seeds=seeds,
                             grid={"partition.alpha": alphas},
                             zip={k: [SETTINGS[n][k] for n in names] for k in ("protocol", "partition.kind")}),
                   {"role": "main", "settings": names})]
    if "reference" in names and scale.later_alphas:
        out.append(Planned("reproduce-later", "protocol=reference on the card dealer (the notes' later batch)",
                           SweepSpec(name="reproduce-later", description="reference protocol, card dealer",
                                     base={**base, **SETTINGS["reference-later"]}, presets=methods, seeds=seeds,
                                     grid={"partition.alpha": list(scale.later_alphas)}),
                           {"role": "main", "settings": ["reference-later"]}))
    a = scale.hard_alpha
    user = flatten(overrides)
    for base_name in names:
        bflat = {**base, **SETTINGS[base_name], "partition.alpha": a}
        for item in ITEM_KEYS:
            if item not in scale.ablation_items or item in user:
                continue
            by_value: dict = {}
            for m in methods:
                cfg = config_for_preset(unflatten({**bflat, **user}), m)
                if not AFFECTS.get(item, lambda c: True)(cfg):  # an item not listed: any method
                    continue
                value = _flip(item, base_name, m, {**bflat, **user})
                if value != _get(cfg.model_dump(mode="json"), item):
                    by_value.setdefault(json.dumps(value), []).append(m)
            for vj, ms in by_value.items():
                value = json.loads(vj)
                key = f"ablation-from-{base_name}-{item}" + (f"-{value}" if len(by_value) > 1 else "")
                out.append(Planned(key, f"{item} flipped alone from {base_name}",
                                   SweepSpec(name=key, description=f"{base_name} with {item}={value}",
                                             base=dict(bflat), presets=ms, seeds=seeds, grid={item: [value]}),
                                   {"role": "ablation", "from": base_name, "item": item, "value": value}))
    return out


def _get(m: dict, key: str):
    for p in key.split("."):
        m = m.get(p) if isinstance(m, dict) else None
    return m


def order(points: list, hard_alpha: float) -> list:
    """Run order: every setting at the hard α for the first seed, then its ablation, then the other α; then the
    next seed — so a run cut short by a lease still holds complete comparisons."""
    def key(p):
        v = p.values
        return (v.get("seed", 0), "partition.alpha" in v and float(v["partition.alpha"]) != hard_alpha)
    return sorted(points, key=key)


def write_manifest(out: Path, planned: list[Planned], points_of: dict[str, list], command: str, scale_name: str,
                   dataset: str, seeds: list[int], protocols: list[str]) -> Path:
    """reproduce.json: what every point of the reproduction stands for (the report reads only this and the runs)."""
    rows = []
    for pl in planned:
        for p in points_of[pl.key]:
            meta = dict(pl.meta)
            if meta["role"] == "main":
                meta["setting"] = ("reference-later" if pl.key == "reproduce-later" else
                                   next(n for n in SETTINGS if SETTINGS[n]["protocol"] == p.values.get("protocol")))
                meta.pop("settings", None)
            flat = flatten(p.mapping)
            rows.append({**meta, "experiment": pl.key, "preset": p.values.get("preset"),
                         "alpha": float(p.config.partition.alpha), "seed": p.config.seed, "dir": str(p.dir),
                         "config": {k: v for k, v in flat.items() if k.startswith(MATCH_KEYS)}})
    doc = {"command": command, "scale": scale_name, "dataset": dataset, "seeds": seeds, "protocols": protocols,
           "settings": {k: SETTING_TEXT[k] for k in SETTINGS}, "points": rows}
    path = out / MANIFEST
    atomic_write_text(path, json.dumps(doc, indent=1))
    return path


def command_line(scale: str, datasets: list[str], seeds: list[int], protocols: list[str], data_root: list[str],
                 out: Path, overrides: list[str]) -> str:
    """The `flare paper` invocation that (re)makes this reproduction."""
    args = ["flare", "paper", "--scale", scale, "--only", "reproduce", "--datasets", ",".join(datasets),
            "--protocol", ",".join(protocols), "--seeds", ",".join(map(str, seeds)), "--out", str(out)]
    for r in data_root:
        args += ["--data-root", r]
    return " ".join(shlex.quote(a) for a in args + list(overrides))
