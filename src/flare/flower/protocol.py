"""The one-shot protocol on a node, engine-free: what the server sends (`Task`), a node's own data, and what a
FLARE client does with a task. `client_app.py` wraps it in Flower's Message API. The client is `flare run`'s
(`flare.client.trainer.Client` in `flare.setup.client_context`), so a federation computes the same numbers.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from torch import Tensor

from flare.client.trainer import Client
from flare.config import Config, build_config, config_to_yaml
from flare.data.partition import Partition
from flare.errors import FlareError
from flare.models import FlareNet, create_architecture
from flare.server.extras import client_extras, client_side, extras_shapes
from flare.server.rounds import rules_for
from flare.server.strategy import Strategy, make_strategies, sent_init
from flare.backend import backend, settle_speed
from flare.data.prepare import DataMeta, prepare_data, split
from flare.setup import client_context, init_keys, make_augment, normalizer

PROTOCOL_VERSION = 2  # 2: the inits, anchor seed and public bank travel as what `Strategy.initialize` sends


@dataclass
class Task:
    """One train instruction: the run's config, the dataset facts, and which rounds to train
    ([round_start, round_end)): all R (upload=once), or one (per-round)."""

    cfg: Config
    meta: DataMeta
    round_start: int
    round_end: int

    def to_config(self) -> dict:
        return {"protocol": PROTOCOL_VERSION, "config": config_to_yaml(self.cfg), "meta": self.meta.to_json(),
                "round-start": int(self.round_start), "round-end": int(self.round_end)}

    @classmethod
    def from_config(cls, d) -> "Task":
        if int(d.get("protocol", -1)) != PROTOCOL_VERSION:
            raise FlareError(f"the server speaks FLARE federation protocol {d.get('protocol')}, this node "
                             f"speaks {PROTOCOL_VERSION}.", fix="install the same flare-ofl version on every node.")
        cfg = build_config(yaml.safe_load(str(d["config"])))
        t = cls(cfg, DataMeta.from_json(str(d["meta"])), int(d["round-start"]), int(d["round-end"]))
        if not 0 <= t.round_start < t.round_end <= cfg.rounds:
            raise FlareError(f"task rounds [{t.round_start}, {t.round_end}) are outside 0..{cfg.rounds}.")
        return t


def client_model(cfg: Config, meta: DataMeta, cid: int, state: dict[str, Tensor], device) -> FlareNet:
    """Client `cid`'s network holding `state`, on `device`. An id outside the run gets the first client's: the node
    still trains and answers, and the server's gate rejects the reply with the reason."""
    arch = cfg.client_architectures()[cid if 0 <= cid < cfg.num_clients else 0]
    model = create_architecture(arch, meta.in_channels, meta.num_classes, cfg.head, cfg.model.feature_dim,
                                checkpoint=False)  # its checkpoint, if any, is in the init sent already
    model.load_state_dict(state)
    return model.to(device)


# ----------------------------------------------------------------------------------------------
# a node's own data


@dataclass
class LocalData:
    cid: int
    x: Tensor                     # the dataset's samples (uint8 images or float features), partition order
    y: Tensor                     # int64 N
    num_classes: int

    @property
    def num_samples(self) -> int:
        return int(self.y.numel())


_PARTITION_CACHE: dict[str, tuple] = {}


def _run_partition(cfg: Config):
    """(prepared data, partition) of the run — the very split `flare run` makes (same seed, same call)."""
    key = json.dumps([cfg.dataset.model_dump(mode="json"), cfg.partition.model_dump(mode="json"), cfg.seed,
                      cfg.num_clients])
    if key not in _PARTITION_CACHE:
        data, _public = prepare_data(cfg)
        part = split(cfg, data.train_y, data.num_classes)
        _PARTITION_CACHE.clear()  # one run's data per process
        _PARTITION_CACHE[key] = (data, part)
    return _PARTITION_CACHE[key]


def partition_data(cfg: Config, cid: int) -> LocalData:
    """Simulation (and a loopback federation): load the dataset and keep client `cid`'s part of the split."""
    if not 0 <= cid < cfg.num_clients:
        raise FlareError(f"partition-id {cid} is outside 0..{cfg.num_clients - 1} (num_clients={cfg.num_clients}).",
                         key="partition-id", fix="start the node with a partition-id below num_clients.")
    data, part = _run_partition(cfg)
    ix = torch.as_tensor(part.client_indices[cid], dtype=torch.long)
    return LocalData(cid, data.train_x[ix], data.train_y[ix], data.num_classes)


def file_data(path: str | Path, cid: int, meta: DataMeta) -> LocalData:
    """Deployment: a node's own samples in an .npz file with `x` and `y` (int N), read with allow_pickle=False. `x`
    is what the run's dataset holds: uint8 N×C×H×W images, or a frozen encoder's cached features N×(1+V)×D."""
    p = Path(path).expanduser()
    want = (f"float32 N×(1+V)×{meta.in_channels} features" if meta.kind == "features"
            else f"uint8 N×{meta.in_channels}×{meta.image_size}×{meta.image_size}")
    if not p.is_file():
        raise FlareError(f"data-path '{p}' does not exist on this node.", key="data-path",
                         fix=f"give the node an .npz file with arrays x ({want}) and y (labels).")
    with np.load(p, allow_pickle=False) as z:
        if "x" not in z or "y" not in z:
            raise FlareError(f"'{p}' lacks the arrays x and y.", key="data-path")
        x, y = z["x"], z["y"]
    if meta.kind == "features":
        ok = x.dtype == np.float32 and x.ndim == 3 and x.shape[1] >= 1 and x.shape[2] == meta.in_channels \
            and bool(np.isfinite(x).all())
    else:
        ok = x.dtype == np.uint8 and x.ndim == 4 and x.shape[1] == meta.in_channels and x.shape[2] == meta.image_size
    if not ok:
        raise FlareError(f"'{p}': x has dtype {x.dtype} and shape {list(x.shape)}; the run needs {want}"
                         f"{' (all finite)' if meta.kind == 'features' else ''}.", key="data-path")
    if y.ndim != 1 or len(y) != len(x) or y.dtype.kind not in "iu" or (len(y) and (y.min() < 0 or
                                                                                  y.max() >= meta.num_classes)):
        raise FlareError(f"'{p}': y must hold {len(x)} integer labels in 0..{meta.num_classes - 1}.", key="data-path")
    return LocalData(cid, torch.from_numpy(np.array(x, copy=True)), torch.from_numpy(y.astype(np.int64)),
                     meta.num_classes)


def export_partitions(cfg: Config, out_dir: str | Path) -> list[Path]:
    """Write every client's part of the run's split as `client-<i>.npz` (x, y) plus `dataset-meta.json`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data, _ = _run_partition(cfg)
    paths = [out / f"client-{i}.npz" for i in range(cfg.num_clients)]
    for i, p in enumerate(paths):
        d = partition_data(cfg, i)
        np.savez(p, x=d.x.numpy(), y=d.y.numpy())
    (out / "dataset-meta.json").write_text(DataMeta.from_data(data).to_json())
    return paths


# ----------------------------------------------------------------------------------------------
# the client side


@dataclass
class ClientResult:
    cid: int
    num_samples: int
    class_histogram: list[int]
    state: dict[str, Tensor] | None       # the upload (None for a client without samples)
    records: list[dict]                   # one training-log line per round trained
    carry: dict | None                    # Client.state_dict() to resume from, when rounds remain
    extras: dict[str, Tensor] | None = None  # the statistics the server's strategies asked for (server/extras.py)


def client_train(task: Task, local: LocalData, first: dict[str, Tensor], resume: dict | None = None,
                 device: str | None = None, received: dict[str, Tensor] | None = None) -> ClientResult:
    """Train rounds [task.round_start, task.round_end) of one client exactly as `flare run` does, from what the
    server sent before the first round (`first`) and with the task (`received`)."""
    cfg, meta = task.cfg, task.meta
    # its class histogram and label entropy, as partition.json reports them
    mine = Partition([np.arange(local.num_samples)], local.num_classes, local.y.numpy()).report()["clients"][0]
    hist = mine["class_histogram"]
    if local.num_samples == 0:
        return ClientResult(local.cid, 0, hist, None, [], None)
    be = settle_speed(backend(cfg, device), cfg, (meta.in_channels, meta.image_size, meta.image_size), meta.num_classes)
    key = init_keys(cfg.client_architectures())[local.cid if 0 <= local.cid < cfg.num_clients else 0]
    if not (init_state := sent_init(first, key)):
        raise FlareError(f"the first message carries no init weights '{key}' for client {local.cid}'s architecture.",
                         fix="install the same flare-ofl version on the server and every node.")
    model = client_model(cfg, meta, local.cid, init_state, be.device)
    if be.channels_last:
        model = model.to(memory_format=torch.channels_last)
    ctx = client_context(cfg, meta, be, model.feature_dim, local.x, local.y, first)
    ctx.received = {k: v.to(be.device) for k, v in (received or {}).items()}
    client = Client(local.cid, torch.arange(local.num_samples, device=be.device), model, ctx,
                    mine["normalized_entropy"])
    if resume is not None:
        client.load_state_dict(resume)
    if client.epochs_done != task.round_start * cfg.local_epochs:
        raise FlareError(f"client {local.cid} has trained {client.epochs_done} epochs but was asked to start at "
                         f"round {task.round_start}; its state between rounds was lost.")
    records = [client.train_round(ctx, r) for r in range(task.round_start, task.round_end)]
    state = {k: v.detach().cpu() for k, v in client.upload().state.items()}
    carry = client.state_dict() if task.round_end < cfg.rounds else None
    # what the strategies the server scores after the block ask this client for (none on a round `eval.every`
    # skips): the server's gate expects exactly these (`flare.loop.why_rejected`)
    last = task.round_end - 1
    scored = {n: run_strategies(cfg)[n] for n in rules_for(cfg, last)} if cfg.evaluates(last) else {}
    extras = client_extras(scored, client_side(local.cid, client.model, ctx.train_x, ctx.train_y, ctx.plain,
                                               ctx.augment, ctx.device)) if extras_shapes(scored, client.model) else {}
    return ClientResult(local.cid, local.num_samples, hist, state, records, carry, extras)


_STRATEGIES: dict[str, dict[str, Strategy]] = {}


def run_strategies(cfg: Config) -> dict[str, Strategy]:
    """Every server strategy the run scores, built once per node process and run (a node answers many messages)."""
    key = config_to_yaml(cfg)
    if key not in _STRATEGIES:
        _STRATEGIES.clear()  # one run's strategies per process
        _STRATEGIES[key] = make_strategies(cfg, rules_for(cfg))
    return _STRATEGIES[key]


def client_talk(task: Task, local: LocalData, trained: dict[str, Tensor], name: str, rnd: int,
                message: dict[str, Tensor], memory: dict[str, Tensor], device: str | None = None) -> dict[str, Tensor]:
    """Round `rnd` of the rounds server strategy `name` holds with the clients after their upload, on this node:
    its `client_round` over the client's upload (`trained`) and samples. `memory` is updated in place."""
    cfg, meta = task.cfg, task.meta
    strategies = run_strategies(cfg)
    if name not in strategies:
        raise FlareError(f"the server asked for a round of strategy '{name}', which this run does not score.",
                         key="eval.rules", fix="install the same flare-ofl version on the server and every node.")
    be = backend(cfg, device)
    data = client_side(local.cid, client_model(cfg, meta, local.cid, trained, be.device), local.x, local.y,
                       normalizer(cfg, meta), make_augment(cfg, meta, be.device), be.device)
    received = {k: v.to(be.device) for k, v in message.items()}
    reply = strategies[name].client_round(rnd, received, data, memory)
    return {k: v.detach().cpu() for k, v in reply.items()}
