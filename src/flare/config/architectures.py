"""Which network each client runs (docs/heterogeneous.md): the resolution of `model.clients` / `model.mix` into one
`Architecture` per client, and of `server.model` into the architecture a distilling server trains.

A run is *mixed* when its clients do not all run one architecture (name, width, options and checkpoint alike). The
default — neither key set — is one architecture, the top-level `model`, for every client, exactly as before these
keys existed. `model.clients` is a list of K entries or a mapping client index → entry (the others run `model`);
`model.mix` a mapping name → number of clients, dealt to the clients by a permutation seeded with `seed`, so a
sweep over seeds also varies who runs what. An entry is a registered model name, or a mapping with `name` and any
of `width`, `options`, `checkpoint` (the missing ones taken from `model` when the name is `model.name`, else the
name's defaults; `width` always from `model`).
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from flare.registry import MODELS
from flare.rng import derived_seed

MIX_STREAM = 4101  # the seed stream of model.mix's assignment


@dataclass(frozen=True)
class Architecture:
    """One client's network: what `models.create_model` builds, plus the state dict it starts from. Hashable, so
    clients of one architecture share one seeded init. `label` names it in partition.json and reports."""

    name: str
    width: float
    options_json: str = "{}"
    checkpoint: str | None = None
    label: str = field(default="", compare=False)

    @property
    def options(self) -> dict:
        return json.loads(self.options_json)


def _architecture(model, entry) -> Architecture:
    """The Architecture of one entry (None: the top-level model), its missing fields filled from `model`."""
    if entry is None or entry.name == model.name and entry.width is None and not entry.options \
            and entry.checkpoint is None:
        name, width, options, checkpoint = model.name, model.width, model.options, model.checkpoint
    else:
        same = entry.name == model.name
        name = entry.name
        width = entry.width if entry.width is not None else model.width
        options = entry.options if entry.options or not same else model.options
        checkpoint = entry.checkpoint if entry.checkpoint is not None else (model.checkpoint if same else None)
    label = name if width == model.width else f"{name}@{width:g}"
    opts = MODELS.options(name, options, "model.options")  # defaults filled: a spelled-out default is the same net
    return Architecture(name, float(width), json.dumps(opts.model_dump(mode="json") if opts is not None else {},
                                                       sort_keys=True), checkpoint, label)


def client_architectures(cfg) -> list[Architecture]:
    """One Architecture per client (length `num_clients`), from `model.clients` or `model.mix` (neither: `model`)."""
    m, k = cfg.model, cfg.num_clients
    if m.mix:
        names = [name for name, count in m.mix.items() for _ in range(count)]
        order = np.random.default_rng(derived_seed(cfg.seed, MIX_STREAM)).permutation(len(names))
        from_mix = {name: _architecture(m, _Entry(name)) for name in m.mix}
        return [from_mix[names[j]] for j in order]
    if isinstance(m.clients, list):
        return [_architecture(m, e) for e in m.clients]
    entries = m.clients or {}
    return [_architecture(m, entries.get(i)) for i in range(k)]


@dataclass
class _Entry:  # a model.mix name, read like a model.clients entry that names only the model
    name: str
    width: float | None = None
    options: dict = field(default_factory=dict)
    checkpoint: str | None = None


def is_mixed(cfg) -> bool:
    """Whether the clients run more than one architecture."""
    return len(set(client_architectures(cfg))) > 1


def server_architecture(cfg) -> Architecture:
    """What a server that trains its own model (FedDF, DENSE, Co-Boosting, the public bank's teacher) builds:
    `server.model`, else the most common client architecture (ties: the one the lowest client index runs)."""
    if cfg.server.model is not None:
        return _architecture(cfg.model, cfg.server.model)
    archs = client_architectures(cfg)
    counts = Counter(archs)
    return max(archs, key=lambda a: (counts[a], -archs.index(a)))


def architecture_table(cfg) -> str:
    """"3 × resnet18, 2 × cnn": who runs what, for messages and summaries."""
    counts = Counter(a.label for a in client_architectures(cfg))
    return ", ".join(f"{n} × {label}" for label, n in counts.items())
