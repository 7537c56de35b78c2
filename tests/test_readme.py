"""The generated blocks of the README and the docs pages are current and untouched by hand (so docs cannot fall
behind the code), each on its one page."""
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("readme_tool", ROOT / "tools" / "readme.py")
tool = importlib.util.module_from_spec(spec)
sys.modules["readme_tool"] = tool  # dataclasses look their module up by name
spec.loader.exec_module(tool)
README = (ROOT / "README.md").read_text()


def page_text(block_id: str) -> str:
    """The text of the page a block lives on."""
    return (ROOT / tool.page_of(block_id)).read_text()


def test_generated_blocks_are_current_and_untouched():
    for page in tool.pages():  # the README and every docs page a results block lives on
        assert tool.problems((ROOT / page).read_text(), page) == [], page


def test_a_hand_edit_or_a_schema_change_is_caught():
    page = tool.page_of("config-reference")
    text = page_text("config-reference")
    sha, body = tool.blocks(text)["config-reference"]
    edited = text.replace(body, body.replace("| `seed` | int | `1` |", "| `seed` | int | `2` |"))
    assert edited != text
    assert any("edited by hand" in p for p in tool.problems(edited, page))
    regenerated_with_a_row_less = tool.replace_block(text, "config-reference", "\n".join(body.splitlines()[:-1]))
    assert any("stale" in p for p in tool.problems(regenerated_with_a_row_less, page))
    assert any("missing" in p for p in tool.problems(text.replace("config-reference", "config-ref"), page))


def test_every_preset_and_config_key_is_documented():
    for block in ("presets", "methods"):  # the README's overview and the methods page's table
        assert all(f"| `{p}` |" in page_text(block) for p in tool.list_presets()), block
    assert all(f"`{k}`" in page_text("config-reference") for k, *_ in tool.config_reference())


def test_a_block_lives_on_one_page_only():
    """Moving a block is changing its page in tools/readme.py; a copy left on another page is refused."""
    readme_with_a_copy = README + "\n" + "".join(
        m[0] for m in tool.PATTERN.finditer(page_text("methods")) if m["id"] == "methods")
    assert any("belongs on docs/methods.md" in p for p in tool.problems(readme_with_a_copy, "README.md"))


def test_figure_links_are_relative_to_the_block_page():
    """Renderers write figure links from the checkout's root; a block on docs/results/ reads them from ../img/."""
    body = "![f](docs/img/x.png)\n"
    assert tool.relink(body, "README.md") == body
    assert tool.relink(body, "docs/results/heterogeneous.md") == "![f](../img/x.png)\n"
    assert tool.relink(body, "docs/reproducibility.md") == "![f](img/x.png)\n"


def test_readme_starts_with_the_two_commands():
    head = README[:600]
    assert "make run" in head and "make test" in head


def test_make_run_is_the_command_of_the_main_results_block():
    """`make run` and the README's main table come from the same command (so the table is what it prints)."""
    make = (ROOT / "Makefile").read_text()
    var = dict(line.split(" ?= ") for line in make.splitlines() if " ?= " in line)
    recipe = next(line.strip() for line in make.splitlines() if "flare compare --config configs/main.yaml" in line)
    recipe = recipe.replace("$(BIN)/", "").split(" $$extra")[0]
    for k, v in var.items():
        recipe = recipe.replace(f"$({k})", v)
    (block_cmd,) = tool.RESULTS["main"].commands
    assert recipe == block_cmd, (recipe, block_cmd)


# ----------------------------------------------------------------------------------------------
# results blocks rendered from their committed records (results/<block>/)


def test_every_recorded_block_is_what_its_records_render_to():
    """A hash only proves the text came from the generator; the committed records prove where its numbers came
    from. The cheap blocks have records (kernels: two 5-round runs), and the README shows exactly their rendering."""
    assert {"kernels", "main", "kernel-paths"} <= set(tool.recorded())
    for b in tool.recorded():
        block, base = tool.RESULTS[b], tool.records_of(tool.RESULTS[b])
        page = (ROOT / block.page).read_text()
        assert tool.blocks(page)[b][1] == tool.render_block(block, base, copy_figures=False), b


def test_records_keep_the_paths_relative_to_runs():
    """What a command writes to runs/X is recorded at results/<block>/X: every path a recorded block renders from is
    there, and a command writing anywhere but runs/ is refused where its block is defined."""
    assert tool.record_paths(tool.RESULTS["kernels"]) == ["readme/kernels.json", "readme/ux-pinned",
                                                          "readme/ux-native"]
    for b in tool.recorded():
        records = tool.records_of(tool.RESULTS[b])
        assert [rel for rel in tool.record_paths(tool.RESULTS[b]) if not (records / rel).exists()] == [], b
    for cmd in ("flare compare --out elsewhere/x", "python bench.py > /tmp/x.out", "python b.py --record x.json"):
        with pytest.raises(ValueError, match="under runs/"):
            tool.Results("x", [cmd], lambda base: "")


def test_no_committed_record_is_ignored_by_the_checkout():
    """The records sit at paths the checkout's ignore rules leave alone: none under a runs/ directory (which the
    top-level .gitignore ignores), so no tracked file under results/ looks like generated output."""
    if shutil.which("git") is None or subprocess.run(["git", "rev-parse", "--git-dir"], cwd=ROOT,
                                                     capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "ls-files", "-ci", "--exclude-standard", "--", "results"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    assert ignored == ""
    # nor re-included from under one by an exception (`!runs/`): the path itself would still read as generated
    tracked = subprocess.run(["git", "ls-files", "--", "results"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.splitlines()
    assert tracked and [f for f in tracked if "runs" in Path(f).parts[:-1]] == []


def _round_records(path):
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def test_an_edited_record_or_a_block_from_older_runs_is_caught(tmp_path):
    block = tool.RESULTS["kernels"]
    page = page_text("kernels")
    records = shutil.copytree(tool.records_of(block), tmp_path / "kernels")
    _, body = tool.blocks(page)["kernels"]
    assert tool.render_block(block, records, copy_figures=False) == body
    # one record edited: the pinned run's last evaluated accuracy moves by a point
    metrics = records / "readme/ux-pinned/metrics.jsonl"
    recs = _round_records(metrics)
    last = max(i for i, r in enumerate(recs) if r["kind"] == "round")
    recs[last]["acc_feature"] += 0.01  # the primary rule's accuracy, which the table's final column shows
    metrics.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert tool.render_block(block, records, copy_figures=False) != body
    # a block whose numbers are not its records' (as if rendered from older runs), regenerated so its hash matches
    older = tool.replace_block(page, "kernels", body.replace("| 32.70 |", "| 32.75 |"))
    assert older != page and tool.blocks(older)["kernels"][0] == tool._digest(tool.blocks(older)["kernels"][1])
    assert any("not what its records" in p for p in tool.problems(older, block.page))


def _checkout(monkeypatch, root):
    """The tool pointed at a stand-in checkout: its runs/ and results/ under root."""
    monkeypatch.setattr(tool, "ROOT", root)
    monkeypatch.setattr(tool, "RUNS", root / "runs")
    monkeypatch.setattr(tool, "OUT", root / "runs" / "readme")
    monkeypatch.setattr(tool, "RESULTS_DIR", root / "results")


def test_records_are_what_a_block_renders_from_and_never_checkpoints(tmp_path, monkeypatch):
    """`--run` copies configs, partitions, metrics, fuse records, states and summaries, and the figures the block
    shows, each at its path relative to runs/ (runs/x/… → results/x/x/…); checkpoints, plots and lock files stay
    behind."""
    _checkout(monkeypatch, tmp_path)
    run = tmp_path / "runs" / "x" / "fafi" / "seed=1"
    kept = ["config.yaml", "partition.json", "metrics.jsonl", "fuse.jsonl", "state.json", "summary.md"]
    for name in kept + ["checkpoint.pt", "checkpoints/round_1.pt", "plots/accuracy.png", ".lock"]:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(name)
    (tmp_path / "runs" / "x" / "compare_accuracy.png").write_text("figure")
    (tmp_path / "runs" / "readme").mkdir(parents=True)
    (tmp_path / "runs" / "readme" / "x.json").write_text("{}")
    (tmp_path / "runs" / "readme" / "x.out").write_text("printed")
    block = tool.Results("x", ["flare compare --out runs/x", "python bench.py > runs/readme/x.out"], lambda base: "",
                         {"x/compare_accuracy.png": "x.png"})
    dest = tool.record(block)
    assert dest == tmp_path / "results" / "x"
    got = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert got == sorted([f"x/fafi/seed=1/{k}" for k in kept] + ["x/compare_accuracy.png", "readme/x.json",
                                                                 "readme/x.out"])
    assert all((dest / g).read_bytes() == (tmp_path / "runs" / g).read_bytes() for g in got)
    (dest / "x/fafi/seed=1/stale.json").write_text("{}")  # a record the next run no longer writes
    assert not (tool.record(block) / "x/fafi/seed=1/stale.json").exists()
    (dest / "bounds").mkdir()  # a record the block reads that none of its commands writes: left alone
    (dest / "bounds" / "b.json").write_text("{}")
    assert (tool.record(block) / "bounds" / "b.json").read_text() == "{}"


def test_a_block_that_keeps_its_benchmark_outputs_records_its_facts_file_alone(tmp_path, monkeypatch):
    """A block with `keep`: its `--record` outputs (timings every run rewrites) are read into its facts file at
    --run and not copied to results/; its table renders from the facts file."""
    _checkout(monkeypatch, tmp_path)
    monkeypatch.setattr(tool, "machine", lambda: {"cpu": "test"})
    out = tmp_path / "runs" / "readme"
    out.mkdir(parents=True)
    cmd = "python -c \"open('runs/readme/b-1.json', 'w').write('{\\\"v\\\": 7}')\" --record runs/readme/b-1.json"
    block = tool.Results("b", [cmd], lambda base: str(json.loads((base / "readme/b.json").read_text())["kept"]),
                         keep=lambda base: {"1": json.loads((base / "readme/b-1.json").read_text())})
    assert tool.record_paths(block) == ["readme/b.json"]
    tool.run_block(block)
    dest = tool.records_of(block)
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == ["readme/b.json"]
    assert block.render(dest) == "{'1': {'v': 7}}"


def test_records_leave_out_the_reports_a_command_derives_from_its_runs():
    """A run's config, partition and metrics are records; the compare.md `flare compare` renders from them is not."""
    assert tool._is_record(Path("fafi/seed=1/metrics.jsonl")) and tool._is_record(Path("fafi/seed=1/config.yaml"))
    assert not tool._is_record(Path("compare.md"))


def test_the_full_scale_table_follows_the_gpu_records(tmp_path):
    """The α = 0.05 full-scale table and its sentence are read from the committed GPU runs: a changed final accuracy
    moves the FLARE − FAFI gap, and a run that did not finish is not counted."""
    lease = tool._script("tools/gpu_lease.py")
    base = tmp_path / "gpu-lease"
    shutil.copytree(ROOT / "results" / "gpu-lease" / "gpu-lease", base)
    calls = ["call1", "call2", "call3", "call4"]
    text = lease.full_scale(base, calls)
    assert "FLARE − FAFI is -0.97 points over 1 paired seed" in text
    assert "etf-anneal" not in text  # V7 seed 1 was cut at round 14
    flare = base / "call3" / "table" / "alpha005-full" / "flare_protocol=clean_seed=1" / "metrics.jsonl"
    rows = [json.loads(line) for line in flare.read_text().splitlines()]
    rows[-1].update(acc=0.5314, acc_feature=0.5314)
    flare.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "FLARE − FAFI is +2.00 points over 1 paired seed" in lease.full_scale(base, calls)
    state = flare.parent / "state.json"
    state.write_text(state.read_text().replace('"status": "finished"', '"status": "interrupted"'))
    assert "FLARE and FAFI have not both finished a seed" in lease.full_scale(base, calls)
