"""Is a gap between two methods real? Paired statistics over seeds.

Runs of one seed share the partition, the initial model and the anchors across methods, so a comparison is
*paired* by seed: the per-seed difference d_s = acc(method, s) − acc(baseline, s) removes what the seed does to
both (at α = 0.05 the seeds of one method end up to ~23 points apart; their differences vary far less).

The test is the paired t-test (`scipy.stats.ttest_rel`) with the 95 % confidence interval of mean(d) from the t
distribution with n − 1 degrees of freedom. Why not Wilcoxon's signed-rank test: with n seeds its smallest
two-sided p is 2/2ⁿ — 0.25 at 3 seeds, 0.0625 at 5 — so below 6 seeds it can never reject at 0.05, whatever the
gap. The t-test can, at the price of assuming the seed-level differences are roughly normal. A table that tests
several methods against one baseline also gives Holm's step-down adjustment of the p-values (family-wise error
0.05 over the table), and calls a difference significant only by that adjusted p."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ALPHA = 0.05


@dataclass(frozen=True)
class Paired:
    """method − baseline over the seeds both have."""

    n: int            # paired seeds
    mean: float       # mean difference
    low: float        # 95 % confidence interval of the mean difference
    high: float
    p: float          # two-sided p of the paired t-test (nan with fewer than 2 seeds)

    @property
    def testable(self) -> bool:
        return self.n >= 2


def mean_ci(values, confidence: float = 1 - ALPHA) -> tuple[float, float, float, int]:
    """(mean, std with n − 1, half-width of the t confidence interval, n) over the finite values; nan where n is
    too small for the statistic."""
    v = np.array([x for x in values if math.isfinite(x)], dtype=float)
    n = len(v)
    if n < 2:
        return (float(v[0]) if n else math.nan), math.nan, math.nan, n
    from scipy import stats  # lazy: scipy.stats is a second of start-up for every `flare` command otherwise

    sd = float(v.std(ddof=1))
    return float(v.mean()), sd, float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n), n


def paired(method: dict, baseline: dict, confidence: float = 1 - ALPHA) -> Paired:
    """Pair two {seed: value} mappings on their common seeds (non-finite values dropped) and test the mean
    difference against 0."""
    seeds = sorted(s for s in set(method) & set(baseline) if math.isfinite(method[s]) and math.isfinite(baseline[s]))
    mean, sd, half, n = mean_ci([method[s] - baseline[s] for s in seeds], confidence)
    if n < 2:
        return Paired(n, mean, math.nan, math.nan, math.nan)
    if sd == 0.0:  # every seed moved by exactly the same amount: no spread to test against (scipy gives nan)
        return Paired(n, mean, mean, mean, 1.0 if mean == 0 else 0.0)
    from scipy import stats  # lazy: as in mean_ci

    p = float(stats.ttest_rel([method[s] for s in seeds], [baseline[s] for s in seeds]).pvalue)
    return Paired(n, mean, mean - half, mean + half, p)


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (nan entries are left out of the family and stay nan). Written here
    because scipy has only Benjamini–Hochberg; it is five lines."""
    idx = sorted((i for i, p in enumerate(ps) if not math.isnan(p)), key=lambda i: ps[i])
    out = [math.nan] * len(ps)
    m, running = len(idx), 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (m - rank) * ps[i]))
        out[i] = running
    return out


def verdict(res: Paired, p_adjusted: float, alpha: float = ALPHA) -> str:
    """The cell a table prints for "is it real?"."""
    if res.n == 0:
        return "no common seed"
    if res.n == 1:
        return "1 seed: no test"
    if p_adjusted < alpha:
        return "higher (significant)" if res.mean > 0 else "lower (significant)"
    return "not significant"
