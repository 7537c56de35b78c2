"""The evaluation's cost, per shared pass and per rule (server/rounds.py rule_costs, the summary's table)."""
import json

from flare.server.rounds import rule_costs
from flare.server.rules import FeatureRule, IffiRule, RulePredictor
from flare.server.strategy import ModelPredictor

import torch


def test_a_rule_alone_costs_its_own_part_and_the_shared_passes_it_reads():
    w = torch.ones(2) / 2
    preds = {"feature": RulePredictor(FeatureRule, w, None), "iffi": RulePredictor(IffiRule, w, None),
             "fedavg": ModelPredictor(torch.nn.Identity())}
    parts = {"clients": 2.0, "noise": 3.0, "feature": 0.1, "iffi": 0.2, "fedavg": 1.5}
    assert rule_costs(parts, preds) == {"feature": 2.1, "iffi": 5.2, "fedavg": 1.5}
    parts["batch_bn"] = 4.0  # eval.bn=batch: the feature rules read the train-mode pass too
    assert rule_costs(parts, preds)["feature"] == 6.1


def test_a_cpu_run_records_and_shows_its_evaluation_cost(tiny_overrides, tmp_path):
    from flare.cli import main
    out = tmp_path / "r"
    tiny = [o for o in tiny_overrides if not o.startswith("rounds=")]
    assert main(["run", "--preset", "fafi", *tiny, "rounds=1", "--out", str(out), "--quiet"]) == 0
    rnd = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "round"][-1]
    parts, alone = rnd["seconds_eval_parts"], rnd["seconds_eval_rules"]
    assert {"clients", "noise", "feature", "iffi", "fedavg"} <= set(parts) and set(alone) == set(parts) - {
        "clients", "noise"}
    assert sum(parts.values()) <= rnd["seconds_eval"] + 1e-3   # the parts are inside the evaluation's time
    assert alone["iffi"] >= parts["clients"] + parts["noise"] - 1e-3
    summary = (out / "summary.md").read_text()
    assert "## Evaluation cost at the last round" in summary and "| noise |" in summary
