"""`flare paper`: the paper's experiments and the reproduction of the research notes, a package built on flare and
apart from it. No flare module imports it (tests/test_import_graph.py holds this): its command reaches flare's
command line through the `flare.commands` entry point (paper/pyproject.toml), and `flare-paper` / `python -m
flare_paper` run the same command without it.

* `cli`          `flare paper`'s options and the command (`add_command`, `main`)
* `scales`       smoke / cpu / full: models, data sizes, the methods of each experiment, the notes' settings
* `options`      the command line's options, checked before the first run
* `suite`        the experiments as sweeps, planned, run and reported (`run_paper`)
* `reproduce`    `--only reproduce`: the notes' table under both protocols and the one-item protocol ablation
* `report`       the suite's report (Tables 1–3, Figures 1–3, the sweeps, the server strategies)
* `reproduction` the reproduction's report (`report/reproduction.md`)
* `reference`    the notes' numbers, each with the setting it came from
"""
