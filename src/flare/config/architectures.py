"""Which network each client runs (docs/heterogeneous.md): the resolution of `model.clients` / `model.mix` into one
`Architecture` per client, and of `server.model` into the architecture a distilling server trains.

A run is *mixed* when its clients do not all run one layout (name, width and options: `Architecture.layout`, what
fusion rules that average tensor by tensor need); clients of one layout that start from different checkpoints are
one architecture for them, though each checkpoint is its own seeded init (`Architecture` equality). The
default — neither key set — is one architecture, the top-level `model`, for every client. The forms of
`model.clients` and `model.mix` (a seeded deal, so a sweep over seeds also varies who runs what) and of an entry:
docs/heterogeneous.md."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from flare.registry import MODELS
from flare.rng import derived_seed

MIX_STREAM = 4101  # the seed stream of model.mix's assignment


@dataclass(frozen=True)
class Architecture:
    """One client's network: what `models.create_model` builds, plus the state dict it starts from. Hashable, so
    clients of one architecture and checkpoint share one seeded init. `label` names it in partition.json and
    reports; `key` is the config key that sets it (`model`, `model.clients.1`, `server.model`) and `checkpoint_key`
    the one that sets its checkpoint, so an error about either names what the user wrote."""

    name: str
    width: float
    options_json: str = "{}"
    checkpoint: str | None = None
    label: str = field(default="", compare=False)
    key: str = field(default="model", compare=False)
    checkpoint_key: str = field(default="model.checkpoint", compare=False)

    @property
    def options(self) -> dict:
        return json.loads(self.options_json)

    @property
    def layout(self) -> tuple[str, float, str]:
        """What the network is, without where it starts: clients of one layout have tensors of the same names and
        shapes (`models.layout`), so a rule that averages them tensor by tensor fuses them."""
        return self.name, self.width, self.options_json


def _architecture(model, entry, key: str = "model") -> Architecture:
    """The Architecture of one entry (None: the top-level model), its missing fields filled from `model`; `key`:
    the entry's config key."""
    checkpoint_key = f"{key}.checkpoint" if entry is not None and entry.checkpoint is not None else "model.checkpoint"
    if entry is None or entry.name == model.name and entry.width is None and not entry.options \
            and entry.checkpoint is None:
        key = "model"
        name, width, options, checkpoint = model.name, model.width, model.options, model.checkpoint
    else:
        name, same = entry.name, entry.name == model.name
        width = entry.width if entry.width is not None else model.width
        options = entry.options if entry.options or not same else model.options
        checkpoint = entry.checkpoint if entry.checkpoint is not None else (model.checkpoint if same else None)
    label = name if width == model.width else f"{name}@{width:g}"
    opts = MODELS.options(name, options, "model.options")  # defaults filled: a spelled-out default is the same net
    return Architecture(name, float(width), json.dumps(opts.model_dump(mode="json") if opts is not None else {},
                                                       sort_keys=True), checkpoint, label, key, checkpoint_key)


def client_architectures(cfg) -> list[Architecture]:
    """One Architecture per client (length `num_clients`), from `model.clients` or `model.mix` (neither: `model`)."""
    m, k = cfg.model, cfg.num_clients
    if m.mix:
        names = [name for name, count in m.mix.items() for _ in range(count)]
        order = np.random.default_rng(derived_seed(cfg.seed, MIX_STREAM)).permutation(len(names))
        # a model.mix name is read like a model.clients entry that names only the model
        from_mix = {name: _architecture(m, SimpleNamespace(name=name, width=None, options={}, checkpoint=None))
                    for name in m.mix}
        return [from_mix[names[j]] for j in order]
    if isinstance(m.clients, list):
        return [_architecture(m, e, f"model.clients[{i}]") for i, e in enumerate(m.clients)]
    entries, default = m.clients or {}, _architecture(m, None)  # the clients no entry names run `model`
    return [_architecture(m, entries[i], f"model.clients.{i}") if i in entries else default for i in range(k)]


def server_architecture(cfg) -> Architecture:
    """What a server that trains its own model (FedDF, DENSE, Co-Boosting, the public bank's teacher) builds:
    `server.model`, else the most common client architecture (ties: the one the lowest client index runs)."""
    if cfg.server.model is not None:
        return _architecture(cfg.model, cfg.server.model, "server.model")
    archs = client_architectures(cfg)
    counts = Counter(archs)
    return max(archs, key=lambda a: (counts[a], -archs.index(a)))


def architecture_table(cfg) -> str:
    """"3 × resnet18, 2 × cnn": how many clients run each layout, for messages and summaries (checkpoints aside;
    layouts that differ in their options alone are told apart by them)."""
    archs = client_architectures(cfg)
    counts = Counter(a.layout for a in archs)
    first = {a.layout: a for a in reversed(archs)}
    labels = Counter(first[lay].label for lay in counts)
    shown = {lay: first[lay].label + (f" {first[lay].options_json}" if labels[first[lay].label] > 1 else "")
             for lay in counts}
    return ", ".join(f"{n} × {shown[lay]}" for lay, n in counts.items())
