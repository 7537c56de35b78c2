"""tools/kernel_paths.py: the spread of each method's mean across kernel paths, and the verdict it gives."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("kernel_paths", ROOT / "tools" / "kernel_paths.py")
kp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kp)


def _results(per_path: dict[str, dict[str, dict[int, float]]]) -> dict:
    return {p: {"acc": accs, "kernels": p.upper(), "final": "mean of rounds 7–8"} for p, accs in per_path.items()}


def test_spread_half_width_and_verdict():
    seeds = {1: 40.0, 2: 50.0, 3: 45.0}
    res = _results({"avx2": {"a": seeds, "b": seeds},
                    "avx512": {"a": {s: v + 0.5 for s, v in seeds.items()}, "b": {s: v + 1.5 for s, v in seeds.items()}},
                    "default": {"a": {s: v - 0.25 for s, v in seeds.items()}, "b": seeds}})
    rows = {r["method"]: r for r in kp.analyse(res, ["a", "b"])}
    assert rows["a"]["spread"] == pytest.approx(0.75) and rows["b"]["spread"] == pytest.approx(1.5)
    # t(0.975, 2) · sd / √3 with sd = 5 over the avx2 seeds
    assert rows["a"]["half_width"] == pytest.approx(4.302653 * 5 / 3 ** 0.5, rel=1e-5)
    assert rows["a"]["robust"] and not rows["b"]["robust"]  # b moved by more than a point
    md = kp.markdown(list(rows.values()), res, ["native"], "mean of rounds 7–8")
    assert "| a | 3 | 45.00 | 45.50 | 44.75 | 0.75 |" in md and "| **no** |" in md
    assert "Not run (this CPU lacks the instruction set): native." in md
    assert "moved by 1.50 points at the median of the 6 pairs and by 1.50 at the most (b, seed " in md


def test_a_spread_under_a_point_but_over_the_interval_is_not_robust():
    """Seeds that agree closely give a narrow interval: a 0.5-point spread then is not small against it."""
    tight = {1: 40.0, 2: 40.1, 3: 40.2}
    res = _results({"avx2": {"a": tight}, "avx512": {"a": {s: v + 0.5 for s, v in tight.items()}}})
    (row,) = kp.analyse(res, ["a"])
    assert row["spread"] == pytest.approx(0.5) and row["half_width"] < 0.5 and not row["robust"]


def test_bad_paths_are_refused_before_anything_runs(tmp_path, capsys):
    assert kp.main(["--paths", "avx2,avx9000", "--out", str(tmp_path / "o")]) == 2
    assert "avx9000" in capsys.readouterr().err and not (tmp_path / "o").exists()
    assert kp.main(["--paths", "avx2", "--out", str(tmp_path / "o")]) == 2
