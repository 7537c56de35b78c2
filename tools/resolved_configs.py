"""Every preset's fully resolved config under each protocol and partition kind, and the protocol label of every
committed run record, the paper suite's reproduction plan and every sweep file's points, as one JSON document: run it on two trees and compare the files, to show that a change to
how configs are layered moved no resolved value and no label.

    PYTHONPATH=src:paper/src python tools/resolved_configs.py OUT.json      (in the tree's root)
    cmp BEFORE.json AFTER.json   (or: python tools/resolved_configs.py --compare BEFORE.json AFTER.json)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

ROOT = Path.cwd()  # the tree whose results/ are labelled
PROTOCOLS = ("clean", "reference")
KINDS = ("dirichlet", "dirichlet-fafi", "iid", "shards")
EXTRA = ([], ["loss.objective=ce"], ["lam.learner=uw"], ["lam.learner=decoupled"], ["progress=step"], ["amp=bf16"],
         ["server.strategies.output.ensemble=logits"], ["eval.bn=running", "drop_last=false"])


def resolved() -> dict:
    from flare.config import list_presets, load_config
    out = {}
    for preset in list_presets():
        for protocol in PROTOCOLS:
            for kind in KINDS:
                for extra in EXTRA:
                    ov = [f"protocol={protocol}", f"partition.kind={kind}", *extra]
                    try:
                        value = load_config(None, preset, ov).model_dump(mode="json")
                    except Exception as e:  # a combination the schema refuses: refused the same way on both trees
                        value = f"refused: {type(e).__name__}: {getattr(e, 'key', '')}"
                    out[" ".join([preset, *ov])] = value
    return out


def plans() -> dict:
    """The paper suite's reproduction (`--only reproduce`, both protocols, its one-item ablation) at every scale:
    each planned point's experiment, meaning and resolved config."""
    from flare_paper.options import parse_options
    from flare_paper.suite import plan_suite
    out = {}
    for scale in ("full", "cpu", "smoke"):
        plan = plan_suite(parse_options(scale, "/tmp/plan", "cifar10", "1,2", ["cifar10=/data/c10"], "reproduce",
                                        None, None, None, None, 1))
        out[scale] = {"planned": [[p.key, p.meta] for p in plan.planned],
                      "points": [[str(p.dir), p.config.model_dump(mode="json")] for p in plan.todo]}
    return out


def sweeps() -> dict:
    """Every point of every sweep file under configs/sweeps/ (`protocol: [clean, reference]` among them)."""
    from flare.experiments.sweep import expand, load_sweep
    out = {}
    for path in sorted((ROOT / "configs" / "sweeps").glob("*.yaml")):
        try:
            spec, base = load_sweep(path)
            out[path.name] = [[p.name, p.config.model_dump(mode="json")] for p in expand(spec, base)]
        except Exception as e:  # a sweep whose data is not here: refused the same way on both trees
            out[path.name] = f"refused: {type(e).__name__}: {getattr(e, 'key', '')}"
    return out


def labels() -> dict:
    from flare.config.protocol import protocol_label
    return {str(p.relative_to(ROOT)): protocol_label(yaml.safe_load(p.read_text()) or {})
            for p in sorted((ROOT / "results").rglob("config.yaml"))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--compare", nargs=2)
    a = ap.parse_args()
    if a.compare:
        before, after = (json.loads(Path(p).read_text()) for p in a.compare)
        for part in ("configs", "labels", "plans", "sweeps"):
            b, c = before[part], after[part]
            diff = sorted(k for k in b.keys() | c.keys() if b.get(k) != c.get(k))
            refused = sum(isinstance(v, str) for v in b.values()) if part != "labels" else 0
            print(f"{part}: {len(b)} compared ({refused} refused on both), {len(diff)} differ"
                  + ("" if diff else ": all equal"))
            for k in diff[:20]:
                print("  ", k)
        return 0
    Path(a.out).write_text(json.dumps({"configs": resolved(), "labels": labels(), "plans": plans(), "sweeps": sweeps()}, sort_keys=True, indent=0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
