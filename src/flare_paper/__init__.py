"""`flare paper`: the paper's experiments and the reproduction of the research notes, in one package apart from the
core. The core (every other module of flare) never imports it; only the command line (`flare.cli`), the tests,
tools/ and benchmarks/ do (tests/test_architecture.py holds this).

* `scales`       smoke / cpu / full: models, data sizes, the methods of each experiment, the notes' settings
* `options`      the command line's options, checked before the first run
* `suite`        the experiments as sweeps, planned, run and reported (`run_paper`)
* `reproduce`    `--only reproduce`: the notes' table under both protocols and the one-item protocol ablation
* `report`       the suite's report (Tables 1–3, Figures 1–3, the sweeps, the server strategies)
* `reproduction` the reproduction's report (`report/reproduction.md`)
* `reference`    the notes' numbers, each with the setting it came from
"""
