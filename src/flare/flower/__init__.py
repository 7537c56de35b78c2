"""Real federation: one-shot FLARE as Flower apps (the optional extra `flare-ofl[flower]`; docs/federation.md).

`protocol` (a node) and `server` run the protocol without an engine, on the same code paths as `flare run`;
`client_app` and `server_app` wrap them in Flower's Message API, `records` converts to Flower's records without
pickles, `predictor` saves the global predictor, `federation` runs a loopback federation (`flare federate`). The app
directory `flwr run` reads ships inside the package, `flare/flower/app/`; `flower-app/` at the repository root
links to it.
"""
