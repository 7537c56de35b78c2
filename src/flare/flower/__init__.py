"""Real federation: one-shot FLARE as Flower apps (the optional extra `flare-ofl[flower]`; docs/federation.md).

`protocol` (a node) and `server` run the protocol without an engine, on the same code paths as `flare run`;
`client_app` and `server_app` wrap them in Flower's Message API; `federation` runs a loopback federation.
"""
