"""Real federation: one-shot FLARE as Flower apps (the optional extra `flare-ofl[flower]`).

* `protocol`    — the protocol on a node, without an engine: tasks, a node's data, client training.
* `server`      — the server without an engine: run settings, the upload gate, evaluation, run directory
                  (same code paths as `flare run`).
* `records`     — pickle-free conversion to Flower's ArrayRecord / ConfigRecord.
* `client_app`  — the ClientApp (`flare.flower.client_app:app`).
* `server_app`  — the ServerApp (`flare.flower.server_app:app`).
* `predictor`   — the saved global predictor (predictor.pt + predictor.json) and its loader.
* `federation`  — start a SuperLink and SuperNodes on loopback and run the app (`flare federate`).

The Flower app directory (the pyproject.toml that `flwr run` reads) ships inside the package, `flare/flower/app/`
(`flare.flower.federation.app_dir()`); `flower-app/` at the repository root links to it.
See docs/federation.md.
"""
