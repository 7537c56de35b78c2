"""The one-shot protocol, engine-free: what a FLARE client does with a task, and what the server does
with the replies. `client_app.py` and `server_app.py` wrap these in Flower's Message API; tests drive them
directly and through Flower.

Same code paths as `flare run`: the client is `flare.client.trainer.Client` with the run's `TrainContext`
(`runner.make_train_context`), the global init is `runner.init_global_model`, anchors come from
`runner.anchor_seed`, and every evaluation checkpoint is `runner.evaluate_uploads` — so a federation of
the same config and seed computes the same numbers as the in-process runner.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from flare.config import Config, build_config, config_to_yaml, load_config
from flare.errors import FlareError

PROTOCOL_VERSION = 1
MAX_RECORDS_BYTES = 4_000_000  # a client's per-round training logs, as JSON text


# ----------------------------------------------------------------------------------------------
# what the server tells every node


@dataclass
class DataMeta:
    """Dataset facts every party must share (normalisation stats of the training set, shapes, classes).
    The server sends them: a deployed client's local data alone would give other statistics."""

    name: str
    classes: list[str]
    in_channels: int
    image_size: int
    mean: list[float]
    std: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @classmethod
    def from_data(cls, data) -> "DataMeta":
        return cls(data.name, list(map(str, data.classes)), int(data.in_channels), int(data.image_size),
                   [float(v) for v in data.mean], [float(v) for v in data.std])

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> "DataMeta":
        d = json.loads(text)
        return cls(str(d["name"]), [str(c) for c in d["classes"]], int(d["in_channels"]), int(d["image_size"]),
                   [float(v) for v in d["mean"]], [float(v) for v in d["std"]])


@dataclass
class Task:
    """One train instruction: the run's config, the dataset facts, the anchor seed, and which rounds to
    train ([round_start, round_end)). Deployment sends one task for all R rounds; simulation with
    per-round snapshots sends R tasks of one round each."""

    cfg: Config
    meta: DataMeta
    anchor_seed: int
    round_start: int
    round_end: int

    def to_config(self) -> dict:
        return {"protocol": PROTOCOL_VERSION, "config": config_to_yaml(self.cfg), "meta": self.meta.to_json(),
                "anchor-seed": int(self.anchor_seed), "round-start": int(self.round_start),
                "round-end": int(self.round_end)}

    @classmethod
    def from_config(cls, d) -> "Task":
        import yaml

        if int(d.get("protocol", -1)) != PROTOCOL_VERSION:
            raise FlareError(f"the server speaks FLARE federation protocol {d.get('protocol')}, this node "
                             f"speaks {PROTOCOL_VERSION}.", fix="install the same flare-ofl version on every node.")
        cfg = build_config(yaml.safe_load(str(d["config"])))
        t = cls(cfg, DataMeta.from_json(str(d["meta"])), int(d["anchor-seed"]), int(d["round-start"]),
                int(d["round-end"]))
        if not 0 <= t.round_start < t.round_end <= cfg.rounds:
            raise FlareError(f"task rounds [{t.round_start}, {t.round_end}) are outside 0..{cfg.rounds}.")
        return t


# ----------------------------------------------------------------------------------------------
# a node's own data


@dataclass
class LocalData:
    cid: int
    x: Tensor                     # uint8 N×C×H×W, in the client's partition order
    y: Tensor                     # int64 N
    num_classes: int

    @property
    def num_samples(self) -> int:
        return int(self.y.numel())

    def class_histogram(self) -> list[int]:
        return np.bincount(self.y.numpy(), minlength=self.num_classes).astype(np.int64).tolist()

    def normalized_entropy(self) -> float:
        from flare.data.partition import Partition

        part = Partition([np.arange(self.num_samples)], self.num_classes, self.y.numpy())
        return float(part.report()["clients"][0]["normalized_entropy"])


_PARTITION_CACHE: dict[str, tuple] = {}


def _run_partition(cfg: Config):
    """(prepared data, partition) of the run — the very split `flare run` makes (same seed, same call)."""
    from flare.data.partition import make_partition
    from flare.runner import prepare_data

    key = json.dumps([cfg.dataset.model_dump(mode="json"), cfg.partition.model_dump(mode="json"), cfg.seed,
                      cfg.num_clients])
    if key not in _PARTITION_CACHE:
        data, _public = prepare_data(cfg)
        part = make_partition(data.train_y.numpy(), cfg.num_clients, cfg.partition.kind, cfg.seed,
                              alpha=cfg.partition.alpha, shards_per_client=cfg.partition.shards_per_client,
                              num_classes=data.num_classes)
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
    """Deployment: a node's own samples in an .npz file with `x` (uint8 N×C×H×W) and `y` (int N),
    read with allow_pickle=False (`flare federate --export-partitions` writes such files)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FlareError(f"data-path '{p}' does not exist on this node.", key="data-path",
                         fix="give the node an .npz file with arrays x (uint8 N×C×H×W) and y (labels).")
    with np.load(p, allow_pickle=False) as z:
        if "x" not in z or "y" not in z:
            raise FlareError(f"'{p}' lacks the arrays x and y.", key="data-path")
        x, y = z["x"], z["y"]
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1] != meta.in_channels or x.shape[2] != meta.image_size:
        raise FlareError(f"'{p}': x has dtype {x.dtype} and shape {list(x.shape)}; the run needs uint8 "
                         f"N×{meta.in_channels}×{meta.image_size}×{meta.image_size}.", key="data-path")
    if y.ndim != 1 or len(y) != len(x) or y.dtype.kind not in "iu" or (len(y) and (y.min() < 0 or
                                                                                  y.max() >= meta.num_classes)):
        raise FlareError(f"'{p}': y must hold {len(x)} integer labels in 0..{meta.num_classes - 1}.",
                         key="data-path")
    return LocalData(cid, torch.from_numpy(np.array(x, copy=True)), torch.from_numpy(y.astype(np.int64)),
                     meta.num_classes)


def export_partitions(cfg: Config, out_dir: str | Path) -> list[Path]:
    """Write every client's part of the run's split as `client-<i>.npz` (x, y) plus `dataset-meta.json`,
    so that nodes of a deployment can be given their own local files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data, _ = _run_partition(cfg)
    paths = []
    for i in range(cfg.num_clients):
        d = partition_data(cfg, i)
        p = out / f"client-{i}.npz"
        np.savez(p, x=d.x.numpy(), y=d.y.numpy())
        paths.append(p)
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


def client_train(task: Task, local: LocalData, init_state: dict[str, Tensor], resume: dict | None = None,
                 bank: Tensor | None = None, device: str | None = None) -> ClientResult:
    """Train rounds [task.round_start, task.round_end) of one client exactly as `flare run` does."""
    from flare.client.terms.align import make_anchors
    from flare.client.trainer import Client
    from flare.data.augment import TwoViewAugment, normalize
    from flare.models import create_model
    from flare.runner import amp_dtype_for, make_train_context, resolve_device

    cfg, meta = task.cfg, task.meta
    hist = local.class_histogram()
    if local.num_samples == 0:
        return ClientResult(local.cid, 0, hist, None, [], None)
    dev = resolve_device(device or cfg.device)
    amp_dtype = amp_dtype_for(cfg, dev)
    cl = cfg.channels_last and dev.type == "cuda"
    model = create_model(cfg.model.name, meta.in_channels, meta.num_classes, cfg.model.width, head=cfg.head)
    model.load_state_dict(init_state)
    model = model.to(dev)
    if cl:
        model = model.to(memory_format=torch.channels_last)
    augment = TwoViewAugment(meta.image_size, meta.in_channels, tuple(meta.mean), tuple(meta.std),
                             per_image=cfg.augment.per_image).to(dev)
    anchors = make_anchors(cfg.align.anchors, meta.num_classes, model.feature_dim, task.anchor_seed)
    anchors = anchors.to(dev) if anchors is not None else None
    ext_factory = None
    if cfg.loss.contrast == "memory-bank":
        from flare.client.terms.banks import make_extension_factory

        ext_factory = make_extension_factory(cfg, None, model, augment, lambda x: normalize(x, meta.mean, meta.std),
                                             dev)
    elif cfg.loss.contrast in ("public-bank", "two-stage"):
        from flare.client.terms.banks import PublicBankExtension

        if bank is None:
            raise FlareError(f"loss.contrast={cfg.loss.contrast} needs the server's public bank, which did not "
                             "arrive with the task.")
        stages = cfg.loss.alignment_epochs if cfg.loss.contrast == "two-stage" else None
        b = bank.to(dev)

        def ext_factory(client, ctx):
            return PublicBankExtension(b, cfg.loss.bank_tau, stages)
    ctx = make_train_context(cfg, local.x.to(dev), local.y.to(dev), augment, anchors, dev, amp_dtype, ext_factory)
    client = Client(local.cid, torch.arange(local.num_samples, device=dev), model, ctx, local.normalized_entropy())
    if resume is not None:
        client.load_state_dict(resume)
    if client.epochs_done != task.round_start * cfg.local_epochs:
        raise FlareError(f"client {local.cid} has trained {client.epochs_done} epochs but was asked to start at "
                         f"round {task.round_start}; its state between rounds was lost.")
    records = [client.train_round(ctx, r) for r in range(task.round_start, task.round_end)]
    upload = client.upload()
    state = {k: v.detach().cpu() for k, v in upload.state.items()}
    carry = client.state_dict() if task.round_end < cfg.rounds else None
    return ClientResult(local.cid, local.num_samples, hist, state, records, carry)


# ----------------------------------------------------------------------------------------------
# the server side


@dataclass
class FederationSettings:
    """The `[tool.flwr.app.config]` keys of the Flower app (overridable with `flwr run --run-config`)."""

    preset: str = ""
    config_file: str = ""
    overrides: str = ""
    out_dir: str = ""
    upload: str = "per-round"      # "per-round": R messages, one snapshot per round; "once": one message
    min_clients: int = 0           # 0: every client must answer
    timeout: float = 3600.0        # seconds to wait for the replies to one message
    wait_nodes: float = 60.0       # seconds to wait for num_clients nodes to connect
    dataset_meta: str = ""         # JSON of DataMeta, for a server without the dataset (no test set)
    save_predictor: bool = True

    KEYS = {"preset": "preset", "config-file": "config_file", "overrides": "overrides", "out-dir": "out_dir",
            "upload": "upload", "min-clients": "min_clients", "timeout": "timeout", "wait-nodes": "wait_nodes",
            "dataset-meta": "dataset_meta", "save-predictor": "save_predictor"}

    @classmethod
    def from_run_config(cls, rc) -> "FederationSettings":
        s = cls()
        for key, attr in cls.KEYS.items():
            if key in rc:
                cur = getattr(s, attr)
                v = rc[key]
                setattr(s, attr, type(cur)(v) if not isinstance(cur, bool) else (
                    v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")))
        if s.upload not in ("per-round", "once"):
            raise FlareError(f"upload='{s.upload}' is neither 'per-round' nor 'once'.", key="upload",
                             fix="set upload=\"per-round\" (simulation, curve over rounds) or \"once\" (deployment).")
        if s.min_clients < 0:
            raise FlareError("min-clients must be >= 0 (0: every client).", key="min-clients")
        return s

    def load_config(self) -> Config:
        import shlex

        return load_config(self.config_file or None, self.preset or None, shlex.split(self.overrides))


@dataclass
class Reply:
    """What the engine hands back for one node: an error string, or the decoded reply fields (any of
    which may be malformed; `accept` checks them)."""

    node: int
    error: str | None = None
    meta: dict = field(default_factory=dict)
    state: dict | None = None
    decode_error: str | None = None


def _sanitize_records(text, cid: int, rounds: range) -> tuple[list[dict], str | None]:
    if not isinstance(text, str):
        return [], "training logs are not text"
    if len(text) > MAX_RECORDS_BYTES:
        return [], f"training logs are {len(text)} bytes, more than {MAX_RECORDS_BYTES}"
    try:
        recs = json.loads(text)
    except json.JSONDecodeError as e:
        return [], f"training logs are not JSON ({e.msg})"
    if not isinstance(recs, list) or len(recs) != len(rounds):
        return [], f"expected {len(rounds)} training-log records"
    out = []
    for rec, r in zip(recs, rounds):
        if not isinstance(rec, dict) or rec.get("client") != cid or rec.get("round") != r:
            return [], f"training-log record for round {r} is malformed or names another client/round"
        clean = {}
        for k, v in rec.items():
            if isinstance(k, str) and (v is None or isinstance(v, (bool, int, float, str))):
                clean[k] = v
            elif isinstance(k, str) and isinstance(v, list) and all(isinstance(x, (int, float)) for x in v):
                clean[k] = v
        clean["kind"] = "client"
        out.append(clean)
    return out, None


class ServerSession:
    """The server of one federated run: it owns the run directory (the same files as `flare run`, minus
    the client checkpoint), the test set (when it has one), the global init, the anchors, the upload gate,
    and every evaluation checkpoint."""

    def __init__(self, cfg: Config, fed: FederationSettings, log=print, quiet: bool = True):
        from flare.client.terms.align import make_anchors
        from flare.data.augment import TwoViewAugment, normalize
        from flare.runner import (Run, amp_dtype_for, anchor_seed, init_global_model, prepare_data,
                                  resolve_device)
        from flare.server.fusion import RULES_LINEAR, RULES_PROTOTYPE
        from flare.server.upload import UploadSpec

        self.cfg, self.fed, self.log = cfg, fed, log
        out = Path(fed.out_dir or f"runs/flower-{cfg.method}-{time.strftime('%Y%m%d-%H%M%S')}")
        self.run = Run(cfg, out, quiet=quiet)
        self.out = out
        self.finished_already = self.run._check_existing() == cfg.rounds and \
            self.run._state().get("status") == "finished"
        if self.finished_already:
            return
        self.device = resolve_device(cfg.device)
        self.amp_dtype = amp_dtype_for(cfg, self.device)
        self.test_x = self.test_y = None
        public = None
        try:
            data, public = prepare_data(cfg)
            self.meta = DataMeta.from_data(data)
            self.test_x, self.test_y = data.test_x.to(self.device), data.test_y.to(self.device)
        except FlareError as e:
            if not fed.dataset_meta:
                raise
            self.meta = DataMeta.from_json(Path(fed.dataset_meta).read_text())
            self._warn(f"the server has no dataset ({e.message}); it evaluates nothing and uses the dataset "
                       f"facts in {fed.dataset_meta}.")
        meta = self.meta
        self.norm = lambda x: normalize(x, meta.mean, meta.std)
        self.template = init_global_model(cfg, meta.in_channels, meta.num_classes, self.device)
        self.init_state = {k: v.detach().cpu().clone() for k, v in self.template.state_dict().items()}
        self.anchor_seed = anchor_seed(cfg)
        anchors = make_anchors(cfg.align.anchors, meta.num_classes, self.template.feature_dim, self.anchor_seed)
        self.anchors = anchors.to(self.device) if anchors is not None else None
        self.bank = None
        if cfg.loss.contrast in ("public-bank", "two-stage"):
            from flare.client.terms.banks import make_extension_factory

            augment = TwoViewAugment(meta.image_size, meta.in_channels, tuple(meta.mean), tuple(meta.std),
                                     per_image=cfg.augment.per_image).to(self.device)
            self.bank = make_extension_factory(cfg, public, self.template, augment, self.norm, self.device).bank.cpu()
        self.spec = UploadSpec.from_model(self.template, meta.num_classes)
        protos = getattr(self.template, "prototypes", None)
        self.proto_key = next((k for k, p in self.template.named_parameters() if p is protos), None)
        self.rules = RULES_PROTOTYPE if cfg.head == "prototype" else RULES_LINEAR
        self.node_client: dict[int, int] = {}   # node id -> client id (fixed by its first reply)
        self.histograms: dict[int, list[int]] = {}
        self.empty: set[int] = set()
        self.events: list[dict] = []            # who was missing or rejected, and why
        self.last_uploads: list = []
        self.last_record: dict | None = None
        out.mkdir(parents=True, exist_ok=True)
        from flare.runner import atomic_write_text

        atomic_write_text(out / "config.yaml", config_to_yaml(cfg))
        atomic_write_text(self.run.metrics_path, "")
        self.run._write_state("running", 0)

    # -- messages ---------------------------------------------------------------------------------
    @property
    def required(self) -> int:
        return self.fed.min_clients or self.cfg.num_clients

    def task(self, round_start: int, round_end: int) -> Task:
        return Task(self.cfg, self.meta, self.anchor_seed, round_start, round_end)

    def blocks(self) -> list[tuple[int, int]]:
        R = self.cfg.rounds
        return [(r, r + 1) for r in range(R)] if self.fed.upload == "per-round" else [(0, R)]

    # -- the gate ---------------------------------------------------------------------------------
    def accept(self, round_start: int, round_end: int, nodes: list[int], replies: list[Reply]):
        """Check every reply of one block; returns (uploads sorted by client id, their training logs, the
        nodes to keep for the next block). Missing and rejected clients are logged and recorded."""
        from flare.server.upload import Upload, validate_upload

        rounds = range(round_start, round_end)
        by_node: dict[int, Reply] = {}
        for rep in replies:
            if rep.node in nodes and rep.node not in by_node:
                by_node[rep.node] = rep
        uploads: dict[int, Upload] = {}
        logs: dict[int, list[dict]] = {}
        keep: list[int] = []
        for node in nodes:
            rep = by_node.get(node)
            known = self.node_client.get(node)
            if rep is None:
                self._event("missing", round_end - 1, node, known,
                            [f"no reply within {self.fed.timeout:g} s (crashed, disconnected or too slow)"])
                continue
            if rep.error is not None:
                self._event("missing", round_end - 1, node, known, [f"the node reported an error: {rep.error}"])
                continue
            reasons: list[str] = []
            m = rep.meta
            cid, n, hist = m.get("client"), m.get("num-samples"), m.get("class-histogram")
            if not isinstance(cid, int) or isinstance(cid, bool) or not 0 <= cid < self.cfg.num_clients:
                reasons.append(f"client id {cid!r} is not in 0..{self.cfg.num_clients - 1}")
            elif known is not None and known != cid:
                reasons.append(f"the node answered as client {known} before and as client {cid} now")
            elif known is None and cid in self.node_client.values():
                reasons.append(f"client {cid} already answered from another node")
            elif cid in uploads:
                reasons.append(f"client {cid} answered twice")
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                reasons.append(f"sample count {n!r} is not a non-negative integer")
            if (not isinstance(hist, list) or len(hist) != self.meta.num_classes
                    or not all(isinstance(h, int) and h >= 0 for h in hist)):
                reasons.append(f"class histogram is not {self.meta.num_classes} non-negative counts "
                               "(a class count that does not match the run?)")
            elif isinstance(n, int) and sum(hist) != n:
                reasons.append(f"class histogram sums to {sum(hist)}, not to the sample count {n}")
            if reasons:
                self._event("rejected", round_end - 1, node, known, reasons)
                continue
            if n == 0:
                if cid not in self.empty:
                    self._warn(f"client {cid} received no samples under this partition; it is skipped (weight 0).")
                self.node_client[node], self.histograms[cid] = cid, hist
                self.empty.add(cid)
                continue
            if rep.decode_error is not None or rep.state is None:
                self._event("rejected", round_end - 1, node, cid,
                            [f"upload could not be decoded: {rep.decode_error or 'no weights'}"])
                continue
            up = Upload(client=cid, state=rep.state, num_samples=n,
                        prototypes=rep.state.get(self.proto_key) if self.proto_key else None)
            reasons = validate_upload(up, self.spec)
            recs, why = _sanitize_records(m.get("records"), cid, rounds)
            if why:
                reasons.append(why)
            if reasons:
                self._event("rejected", round_end - 1, node, cid, reasons)
                continue
            self.node_client[node], self.histograms[cid] = cid, hist
            uploads[cid], logs[cid] = up, recs
            keep.append(node)
        order = sorted(uploads)  # the in-process runner's order: fusion sums in client order
        recs = sorted((rec for c in order for rec in logs[c]), key=lambda rec: (rec["round"], rec["client"]))
        return [uploads[c] for c in order], recs, keep

    def heard_from(self, uploads) -> int:
        return len(uploads) + len(self.empty)

    def check_quorum(self, uploads, round_idx: int) -> None:
        got = self.heard_from(uploads)
        if not uploads or got < self.required:
            missing = sorted(set(range(self.cfg.num_clients)) - {u.client for u in uploads} - self.empty)
            msg = (f"round {round_idx}: {len(uploads)} valid upload(s) (+{len(self.empty)} client(s) without data) "
                   f"from {self.cfg.num_clients} clients, fewer than min_clients={self.required}; missing or "
                   f"rejected: {missing}. The federation stops here; the run directory keeps the earlier rounds "
                   "and federation.json says who failed and why.")
            self._fail(msg)
            raise FlareError(msg, key="min-clients",
                             fix="bring the missing nodes up (see federation.json for the reasons), or lower "
                                 "min-clients if the run may proceed without them.")

    # -- evaluation and files -----------------------------------------------------------------------
    def evaluate(self, round_idx: int, uploads, client_logs: list[dict]) -> dict:
        import copy

        from flare.runner import evaluate_uploads

        t0 = time.perf_counter()
        models = []
        for u in uploads:
            m = copy.deepcopy(self.template)
            m.load_state_dict(u.state)
            models.append(m.to(self.device))
        rec = evaluate_uploads(self.cfg, round_idx, uploads, models, self.anchors, self.test_x, self.test_y,
                               self.norm, rules=self.rules, amp_dtype=self.amp_dtype)
        rec["clients"] = [u.client for u in uploads]
        missing = sorted(set(range(self.cfg.num_clients)) - set(rec["clients"]) - self.empty)
        rec["missing_clients"] = missing
        rec["seconds"] = time.perf_counter() - t0
        self.run._watch(client_logs)
        self.run._append(client_logs + [rec])
        self.run._write_state("running", round_idx + 1)
        self.last_uploads, self.last_record, self.last_models = uploads, rec, models
        acc = rec.get("acc")
        self.log(f"round {round_idx}: {len(uploads)} upload(s)"
                 + (f", acc ({rec['primary']}) {100 * acc:.2f}%" if acc is not None else "")
                 + (f", missing {missing}" if missing else ""))
        return rec

    def write_partition(self) -> None:
        from flare.data.partition import Partition
        from flare.runner import atomic_write_text

        C, K = self.meta.num_classes, self.cfg.num_clients
        labels, indices, start = [], [], 0
        for i in range(K):
            h = self.histograms.get(i, [0] * C)
            lab = np.repeat(np.arange(C), h)
            labels.append(lab)
            indices.append(np.arange(start, start + len(lab)))
            start += len(lab)
        report = Partition(indices, C, np.concatenate(labels) if labels else np.zeros(0, np.int64)).report()
        for c in report["clients"]:
            if c["client"] not in self.histograms:
                c["missing"] = True
        report.update({"dataset": self.cfg.dataset.name, "kind": self.cfg.partition.kind,
                       "alpha": self.cfg.partition.alpha, "seed": self.cfg.seed, "classes": self.meta.classes,
                       "source": "class histograms reported by the clients"})
        atomic_write_text(self.out / "partition.json", json.dumps(report, indent=1))

    def finish(self) -> dict:
        from flare.report.run_report import write_run_report

        self.write_partition()
        self._write_federation("finished")
        if self.fed.save_predictor and self.last_uploads:
            from flare.flower.predictor import save_predictor

            save_predictor(self.out, self.cfg, self.meta, self.last_uploads, self.last_models, self.last_record,
                           self.anchors, self.template)
        self.run._write_state("finished", self.cfg.rounds)
        write_run_report(self.out)
        if self.test_x is None:  # nothing was scored
            return {"method": self.cfg.method, "primary": self.last_record["primary"], "acc": None,
                    "rounds": len(self.blocks())}
        return self.run.summary()

    def _write_federation(self, status: str, error: str | None = None) -> None:
        from flare.runner import atomic_write_text

        d = {"status": status, "upload": self.fed.upload, "num_clients": self.cfg.num_clients,
             "min_clients": self.required, "timeout_s": self.fed.timeout,
             "nodes": {str(n): c for n, c in sorted(self.node_client.items())},
             "clients_without_data": sorted(self.empty), "events": self.events}
        if error:
            d["error"] = error
        atomic_write_text(self.out / "federation.json", json.dumps(d, indent=1))

    def _fail(self, msg: str) -> None:
        self.run.warnings.append(msg)
        if self.histograms:
            self.write_partition()
        self._write_federation("failed", msg)
        from flare.runner import atomic_write_text

        st = self.run._state()
        atomic_write_text(self.out / "state.json", json.dumps({"status": "failed", "rounds_done":
                                                               st.get("rounds_done", 0), "error": msg,
                                                               "warnings": self.run.warnings}, indent=1))

    def _event(self, kind: str, round_idx: int, node: int, cid, reasons: list[str]) -> None:
        who = f"client {cid}" if cid is not None else f"node {node}"
        msg = f"round {round_idx}: {who} {'is missing' if kind == 'missing' else 'upload rejected'}: " + \
              "; ".join(reasons)
        self.events.append({"kind": kind, "round": round_idx, "node": node, "client": cid, "reasons": reasons})
        self._warn(msg)

    def _warn(self, msg: str) -> None:
        self.run.warnings.append(msg)
        self.log("WARNING: " + msg)


def run_federation(cfg: Config, fed: FederationSettings, exchange, node_ids: list[int], log=print) -> dict:
    """The server's whole protocol over an engine: `exchange(task, include_init, nodes) -> list[Reply]`
    sends one task to `nodes` and returns their replies within the timeout (Flower's grid in
    `server_app.py`; a direct call in tests)."""
    if fed.min_clients > cfg.num_clients:
        raise FlareError(f"min-clients={fed.min_clients} exceeds num_clients={cfg.num_clients}.", key="min-clients",
                         fix="set min-clients at most num_clients (0: every client).")
    s = ServerSession(cfg, fed, log=log)
    if s.finished_already:
        log(f"{s.out}: finished earlier; nothing to recompute.")
        return s.run.summary()
    if len(node_ids) < s.required:
        msg = (f"only {len(node_ids)} node(s) connected, fewer than min_clients={s.required} "
               f"(num_clients={cfg.num_clients}).")
        s._fail(msg)
        raise FlareError(msg, key="min-clients", fix="start more SuperNodes or lower min-clients.")
    if len(node_ids) < cfg.num_clients:
        s._warn(f"{len(node_ids)} node(s) connected for {cfg.num_clients} clients; proceeding with min_clients="
                f"{s.required}.")
    nodes = list(node_ids)
    for start, end in s.blocks():
        if not nodes:
            uploads = []
        else:
            replies = exchange(s.task(start, end), start == 0, nodes, s)
            uploads, logs, nodes = s.accept(start, end, nodes, replies)
        s.check_quorum(uploads, end - 1)
        s.evaluate(end - 1, uploads, logs)
    summary = s.finish()
    summary["out"] = str(s.out)
    return summary


__all__ = ["DataMeta", "Task", "LocalData", "ClientResult", "FederationSettings", "Reply", "ServerSession",
           "client_train", "partition_data", "file_data", "export_partitions", "run_federation"]
