"""Real federation: one-shot FLARE as Flower apps (the optional extra `flare-ofl[flower]`).

* `core`        — the protocol without an engine: tasks, a node's data, client training, the server's
                  upload gate, evaluation and run directory (same code paths as `flare run`).
* `records`     — pickle-free conversion to Flower's ArrayRecord / ConfigRecord.
* `client_app`  — the ClientApp (`flare.flower.client_app:app`).
* `server_app`  — the ServerApp (`flare.flower.server_app:app`).
* `predictor`   — the saved global predictor (predictor.pt + predictor.json) and its loader.
* `federation`  — start a SuperLink and SuperNodes on loopback and run the app (`flare federate`).

The Flower app directory (the pyproject.toml that `flwr run` reads) is `flower-app/` at the repository
root; `flare.flower.federation.write_app_dir` writes the same file anywhere.
See docs/federation.md.
"""
