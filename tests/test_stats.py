"""Paired statistics on constructed numbers: a known paired difference is found, a known null is not, and the
tables say what they cannot test."""
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from flare.report.compare import compare_markdown
from flare.report.runs import Row
from flare.report.tables import default_baseline, paired_rows, paired_table
from flare.rundata import RunData
from flare.stats import holm, paired, verdict


def test_a_known_paired_difference_is_found_though_seeds_differ_far_more():
    # Seeds move both methods together by up to 20 points; the method is 2 points better on every seed ± 0.3.
    rng = np.random.default_rng(0)
    seed_effect = {s: rng.uniform(0.2, 0.4) for s in range(1, 6)}
    base = {s: seed_effect[s] for s in seed_effect}
    noise = dict(zip(seed_effect, [0.003, -0.002, 0.001, -0.003, 0.001]))  # sums to 0: the true mean gap is 0.02
    method = {s: seed_effect[s] + 0.02 + noise[s] for s in seed_effect}
    r = paired(method, base)
    assert r.n == 5 and r.mean == pytest.approx(0.02) and 0 < r.low < 0.02 < r.high
    assert r.p < 0.001
    assert verdict(r, r.p) == "higher (significant)"
    # An unpaired test of the same numbers cannot see it: the seeds' spread swamps the gap.
    assert sps.ttest_ind(list(method.values()), list(base.values())).pvalue > 0.5


def test_a_known_null_is_not_significant_and_matches_scipy():
    base = {1: 0.30, 2: 0.42, 3: 0.25, 4: 0.38}
    method = {1: 0.31, 2: 0.41, 3: 0.27, 4: 0.36}   # differences +1, −1, +2, −2 points: mean 0
    r = paired(method, base)
    assert r.mean == pytest.approx(0.0, abs=1e-12)
    assert r.p == pytest.approx(1.0)
    assert r.p == pytest.approx(sps.ttest_rel(list(method.values()), list(base.values())).pvalue)
    d = np.array([method[s] - base[s] for s in base])
    half = sps.t.ppf(0.975, 3) * d.std(ddof=1) / 2
    assert (r.low, r.high) == pytest.approx((-half, half))
    assert verdict(r, r.p) == "not significant"


def test_pairs_only_common_finite_seeds_and_says_when_it_cannot_test():
    r = paired({1: 0.5, 2: 0.6, 7: 0.9}, {1: 0.4, 2: float("nan"), 3: 0.1})
    assert r.n == 1 and r.mean == pytest.approx(0.1) and math.isnan(r.p)
    assert verdict(r, r.p) == "1 seed: no test"
    assert verdict(paired({1: 0.5}, {2: 0.5}), math.nan) == "no common seed"


def test_identical_shift_on_every_seed_has_no_spread_and_is_reported_exactly():
    r = paired({1: 0.5, 2: 0.6, 3: 0.7}, {1: 0.4, 2: 0.5, 3: 0.6})
    assert r.mean == pytest.approx(0.1) and r.p == 0.0 and r.low == r.high == pytest.approx(0.1)
    assert paired({1: 0.5, 2: 0.6}, {1: 0.5, 2: 0.6}).p == 1.0


def test_holm_step_down():
    assert holm([0.01, 0.04, math.nan, 0.03]) == pytest.approx([0.03, 0.06, math.nan, 0.06], nan_ok=True)
    assert holm([0.5, 0.2]) == pytest.approx([0.5, 0.4])   # monotone, capped at 1
    assert holm([0.9, 0.8]) == pytest.approx([1.0, 1.0])


def _row(name: str, accs: dict) -> Row:
    runs = [RunData(Path(f"/x/{name}/{s}"), {"seed": s, "method": name}, [{"kind": "round", "round": 0,
                                                                            "primary": "feature", "acc_feature": a}],
                    [], {"status": "finished"}, {}) for s, a in accs.items()]
    return Row(name, name, {}, runs)


def test_paired_table_marks_the_real_gap_and_not_the_noise():
    rows = [_row("fafi", {1: 0.30, 2: 0.45, 3: 0.20}), _row("better", {1: 0.349, 2: 0.50, 3: 0.251}),
            _row("same", {1: 0.32, 2: 0.43, 3: 0.21})]
    cells = {r[0]: r for r in paired_rows(rows, "fafi")}
    assert set(cells) == {"better", "same"}
    assert cells["better"][3] == "+5.00" and cells["better"][-1] == "higher (significant)"
    assert cells["same"][-1] == "not significant"
    table = paired_table(rows, "fafi")
    assert table.splitlines()[0].startswith("| method | vs | paired seeds | Δ acc (points) | 95 % CI")


def test_one_seed_tables_say_so():
    rows = [_row("fafi", {1: 0.3}), _row("flare", {1: 0.4})]
    assert paired_rows(rows, "fafi")[0][-1] == "1 seed: no test"
    md = compare_markdown([({}, r) for r in rows])
    assert "Against fafi, paired by seed" in md and "1 seed: no test" in md


def test_default_baseline():
    assert default_baseline(["fedavg", "fafi", "flare"]) == "fafi"
    assert default_baseline(["fedavg", "ensemble"]) == "fedavg"
    assert default_baseline(["fedavg", "ensemble"], "ensemble") == "ensemble"
    assert default_baseline(["fedavg"], "fafi") is None


def test_mean_ci_is_scipys_t_interval_over_the_finite_values():
    from scipy import stats as st
    from flare.stats import mean_ci
    vals = [61.2, 58.9, 63.4, float("nan"), 60.0]
    mean, sd, half, n = mean_ci(vals)
    finite = [v for v in vals if v == v]
    low, high = st.t.interval(0.95, len(finite) - 1, loc=np.mean(finite), scale=st.sem(finite))
    assert n == 4 and mean == pytest.approx(np.mean(finite)) and sd == pytest.approx(np.std(finite, ddof=1))
    assert (mean - half, mean + half) == pytest.approx((low, high))
    assert mean_ci([5.0])[0] == 5.0 and math.isnan(mean_ci([5.0])[2]) and mean_ci([])[3] == 0
