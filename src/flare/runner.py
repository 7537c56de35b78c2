"""One experiment: rounds × clients, an evaluation checkpoint after every round, a durable run dir.

Run directory:
  config.yaml      the fully resolved config
  partition.json   per-client counts, class histograms, label entropies
  metrics.jsonl    one {"kind": "round"} line per round and one {"kind": "client"} line per client per round
  checkpoint.pt    every client's model/optimizer/λ state after the last complete round (atomic)
  state.json       {"status": "running"|"finished", "rounds_done": r}
  summary.md       final and peak accuracies, diagnostics, warnings
  plots/           accuracy against rounds, label distribution, diagnostics, λ curves

A run killed at any instant loses at most the round in progress: rerunning into the same directory
resumes from the last complete round, and a finished run is not recomputed.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import yaml

from flare.client.terms.align import make_anchors
from flare.client.trainer import Client, TrainContext, derived_seed
from flare.config import Config, build_config, config_to_yaml
from flare.data.partition import make_partition
from flare.errors import FlareError
from flare.metrics import g_protos_std, inter_client_proto_std, model_variance_mean
from flare.progress import Progress
from flare.schedules import LRSchedule
from flare.server.fusion import RULES_LINEAR, RULES_PROTOTYPE, aggregation_weights, evaluate
from flare.server.protos import global_prototypes


# ----------------------------------------------------------------------------------------------
# small durable-I/O helpers


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_torch_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict]:
    """Parse metrics.jsonl, ignoring a torn last line (a run killed mid-write)."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def _get_rng_state() -> dict:
    """The global RNG states, as tensors and plain numbers (torch.load(weights_only=True) reads them).
    Every client-round reseeds its own streams (`derived_seed`), so these only matter to code that draws
    from the global generators outside those streams; restoring them keeps such code resumable too."""
    import random

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    py = random.getstate()
    st = {"torch": torch.get_rng_state(),
          "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
          "python": {"version": py[0], "state": list(py[1]), "gauss": py[2]}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict | None) -> None:
    import random

    if not st:
        return
    torch.set_rng_state(st["torch"].cpu())
    n = st["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = st["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in st and torch.cuda.is_available() and len(st["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in st["cuda"]])


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, torch.Tensor):
        return o.tolist()
    raise TypeError(type(o))


def _finite_or_str(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/Inf; keep the line parseable
    return v


# ----------------------------------------------------------------------------------------------
# device and precision


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise FlareError(f"device={name} was asked for, but torch sees no CUDA GPU on this machine.",
                             key="device", fix="use device=auto or device=cpu, or install a CUDA build of torch.")
        return torch.device(name)
    if name == "mps" and not torch.backends.mps.is_available():
        raise FlareError("device=mps was asked for, but MPS is not available.", key="device",
                         fix="use device=auto or device=cpu.")
    return torch.device(name)


def amp_dtype_for(cfg: Config, device: torch.device) -> torch.dtype | None:
    if cfg.amp == "off":
        return None
    if cfg.amp == "bf16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


# ----------------------------------------------------------------------------------------------
# data


def prepare_data(cfg: Config):
    """Load the dataset, apply the seeded subsets, carve out the server's public slice (if any)."""
    from flare.data.datasets import load_dataset, stratified_subset

    d = cfg.dataset
    data = load_dataset(d.name, d.root, format=d.format, download=d.download, cache_dir=d.cache_dir)
    if d.train_subset is not None:
        ix = stratified_subset(data.train_y, d.train_subset, cfg.seed)
        data.train_x, data.train_y = data.train_x[ix], data.train_y[ix]
    if d.test_subset is not None:
        ix = stratified_subset(data.test_y, d.test_subset, cfg.seed + 1)
        data.test_x, data.test_y = data.test_x[ix], data.test_y[ix]
    public = None
    if d.public_size:
        if d.public_size >= len(data.train_y):
            raise FlareError(f"dataset.public_size={d.public_size} is not smaller than the training set "
                             f"({len(data.train_y)} samples).", key="dataset.public_size",
                             fix="hold out fewer samples for the server's public bank.")
        ix = stratified_subset(data.train_y, d.public_size, cfg.seed + 2)
        keep = torch.ones(len(data.train_y), dtype=torch.bool)
        keep[ix] = False
        public = (data.train_x[ix], data.train_y[ix])
        data.train_x, data.train_y = data.train_x[keep], data.train_y[keep]
    return data, public


# ----------------------------------------------------------------------------------------------
# the pieces every engine shares (the in-process Run below and the Flower apps in flare.flower)


def anchor_seed(cfg: Config) -> int:
    """The shared seed the anchors A are drawn from (the server fixes it before training)."""
    return cfg.seed + 7


def init_global_model(cfg: Config, in_channels: int, num_classes: int, device: torch.device,
                      channels_last: bool = False) -> torch.nn.Module:
    """One seeded global init shared by every client (SPEC §1)."""
    from flare.models import create_model

    torch.manual_seed(cfg.seed)
    model = create_model(cfg.model.name, in_channels, num_classes, cfg.model.width, head=cfg.head).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def make_train_context(cfg: Config, train_x, train_y, augment, anchors, device: torch.device, amp_dtype,
                       extension_factory=None) -> TrainContext:
    """What a client's local loop reads: its data on the device, augmentation, anchors, the LR schedule."""
    base_lr = cfg.lr * (cfg.batch_size / 512 if cfg.optim.linear_scaling else 1.0)
    ls = cfg.lr_schedule
    return TrainContext(cfg=cfg, train_x=train_x, train_y=train_y, augment=augment, anchors=anchors,
                        device=device, amp_dtype=amp_dtype,
                        lr_schedule=LRSchedule(ls.kind, base_lr, cfg.total_epochs, decay_per_round=ls.decay_per_round,
                                               min_lr=ls.min_lr, t0=ls.t0, t_mult=ls.t_mult,
                                               cycle_decay=ls.cycle_decay),
                        extension_factory=extension_factory)


def primary_rule(cfg: Config) -> str:
    """The rule whose accuracy is "the" accuracy of a run."""
    p = cfg.server.primary
    if p != "auto":
        return p
    return "feature" if cfg.head == "prototype" else "output"


def evaluate_uploads(cfg: Config, r: int, uploads: list, models: list[torch.nn.Module], anchors, test_x, test_y,
                     norm, *, rules: tuple[str, ...], amp_dtype=None, channels_last: bool = False) -> dict:
    """One evaluation checkpoint (SPEC §4–5) from the uploads alone: global prototypes, every fusion rule
    scored on the test set (skipped when `test_x` is None: a server without a test set), diagnostics.
    `models[i]` holds `uploads[i].state` (the in-process runner passes the live client models)."""
    t0 = time.perf_counter()
    weights = aggregation_weights([u.num_samples for u in uploads], cfg.server.weights)
    protos = [u.prototypes for u in uploads if u.prototypes is not None]
    prim = primary_rule(cfg)
    rec: dict = {"kind": "round", "round": r, "method": cfg.method, "primary": prim}
    G = None
    if protos:
        G, server_logs = global_prototypes(protos, cfg.server, anchors, derived_seed(cfg.seed, r, 99))
        rec.update(server_logs)
    t_agg = time.perf_counter() - t0
    t1 = time.perf_counter()
    if test_x is not None:
        rec.update(evaluate(models, weights, G, test_x, test_y, norm, rules=rules, batch_size=cfg.test_batch_size,
                            noise_seed=cfg.eval.noise_seed, amp_dtype=amp_dtype, channels_last=channels_last))
    rec["seconds_eval"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    rec["model_variance_mean"] = model_variance_mean(models)
    if protos:
        rec["g_protos_std"] = g_protos_std(G)
        rec["inter_client_proto_std"] = inter_client_proto_std(protos)
    rec["seconds_aggregate"] = t_agg + time.perf_counter() - t2
    rec["acc"] = rec.get(f"acc_{prim}")
    return rec


class Run:
    def __init__(self, cfg: Config, out_dir: str | Path, quiet: bool = False):
        self.cfg = cfg
        self.out = Path(out_dir)
        self.quiet = quiet
        self.warnings: list[str] = []

    # -- bookkeeping ---------------------------------------------------------------------------
    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.jsonl"

    def _state(self) -> dict:
        p = self.out / "state.json"
        return json.loads(p.read_text()) if p.exists() else {}

    def _write_state(self, status: str, rounds_done: int) -> None:
        atomic_write_text(self.out / "state.json", json.dumps({"status": status, "rounds_done": rounds_done,
                                                               "warnings": self.warnings}, indent=1))

    def _append(self, records: list[dict]) -> None:
        """Append one round's records with a single write(2) on an O_APPEND descriptor: a kill leaves
        either none or all of them (never a torn line), so metrics.jsonl stays parseable."""
        data = "".join(json.dumps({k: _finite_or_str(v) for k, v in r.items()}, default=_json_default) + "\n"
                       for r in records).encode()
        fd = os.open(self.metrics_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:  # a regular file takes it in one call; loop only for the pathological short write
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def _check_existing(self) -> int | None:
        """Returns the number of complete rounds to resume from, None for a fresh run; raises if the
        directory holds a different experiment."""
        cfg_path = self.out / "config.yaml"
        if not cfg_path.exists():
            return None
        old = yaml.safe_load(cfg_path.read_text())
        new = self.cfg.model_dump(mode="json")
        if old != new:
            diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            raise FlareError(f"run directory '{self.out}' holds a different experiment (keys differ: "
                             f"{', '.join(diff)}).", key="--out",
                             fix="choose another --out directory, or delete the old one.")
        st = self._state()
        if st.get("status") == "finished":
            return self.cfg.rounds
        if not (self.out / "checkpoint.pt").exists():
            return 0
        # The checkpoint, not state.json, says how far the run got: a kill between the two writes leaves
        # state.json one round behind.
        return max(int(st.get("rounds_done", 0)), 1)

    # -- the experiment ------------------------------------------------------------------------
    def execute(self) -> dict:
        cfg = self.cfg
        resume_from = self._check_existing()
        if resume_from == cfg.rounds and self._state().get("status") == "finished":
            self._log(f"{self.out}: finished earlier; nothing to recompute.")
            if not (self.out / "summary.md").exists():  # killed while writing its report
                from flare.report.run_report import write_run_report

                write_run_report(self.out)
            return self.summary()
        device = resolve_device(cfg.device)  # fail on bad input before anything is written
        amp_dtype = amp_dtype_for(cfg, device)
        data, public = prepare_data(cfg)
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.out / "config.yaml", config_to_yaml(cfg))
        labels = data.train_y.numpy()
        part = make_partition(labels, cfg.num_clients, cfg.partition.kind, cfg.seed,
                              alpha=cfg.partition.alpha, shards_per_client=cfg.partition.shards_per_client,
                              num_classes=data.num_classes)
        report = part.report()
        report.update({"dataset": cfg.dataset.name, "kind": cfg.partition.kind, "alpha": cfg.partition.alpha,
                       "seed": cfg.seed, "classes": data.classes})
        atomic_write_text(self.out / "partition.json", json.dumps(report, indent=1))

        from flare.data.augment import TwoViewAugment, normalize

        train_x, train_y = data.train_x.to(device), data.train_y.to(device)
        test_x, test_y = data.test_x.to(device), data.test_y.to(device)
        augment = TwoViewAugment(data.image_size, data.in_channels, data.mean, data.std,
                                 per_image=cfg.augment.per_image).to(device)
        mean, std = data.mean, data.std

        def norm(x):
            return normalize(x, mean, std)

        global_model = init_global_model(cfg, data.in_channels, data.num_classes, device,
                                         channels_last=self.channels_last(device))
        anchors = make_anchors(cfg.align.anchors, data.num_classes, global_model.feature_dim, anchor_seed(cfg))
        anchors = anchors.to(device) if anchors is not None else None
        ext_factory = None
        if cfg.loss.contrast != "none":
            from flare.client.terms.banks import make_extension_factory

            ext_factory = make_extension_factory(cfg, public, global_model, augment, norm, device)
        ctx = make_train_context(cfg, train_x, train_y, augment, anchors, device, amp_dtype, ext_factory)
        clients: list[Client] = []
        ent = [c["normalized_entropy"] for c in report["clients"]]
        for i, ix in enumerate(part.client_indices):
            if len(ix) == 0:
                self._warn(f"client {i} received no samples under this partition; it is skipped (weight 0).")
            elif len(ix) < cfg.batch_size:
                self._log(f"note: client {i} holds {len(ix)} samples, fewer than batch_size={cfg.batch_size}; "
                          "it trains on one smaller batch per epoch.")
            clients.append(Client(i, torch.as_tensor(ix, device=device), copy.deepcopy(global_model), ctx, ent[i]))
        if cfg.compile:
            for c in clients:
                c.model.compile()  # in place: state_dict keys (uploads, checkpoints) stay unchanged
        active = [c for c in clients if c.num_samples > 0]
        if not active:
            raise FlareError("no client received any sample.", key="num_clients",
                             fix="use fewer clients or more data.")

        start = resume_from or 0
        if start > 0:
            ck = torch.load(self.out / "checkpoint.pt", map_location=device, weights_only=True)
            start = int(ck["rounds_done"])
            for c, st in zip(clients, ck["clients"]):
                c.load_state_dict(st)
            _set_rng_state(ck.get("rng"))
            self.warnings = list(self._state().get("warnings", []))
            kept = [r for r in read_jsonl(self.metrics_path) if r.get("round", -1) < start]
            atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
            self._log(f"{self.out}: resuming after round {start - 1}.")
        else:
            atomic_write_text(self.metrics_path, "")

        rules = RULES_PROTOTYPE if cfg.head == "prototype" else RULES_LINEAR
        steps_per_round = sum(math.ceil(c.num_samples / cfg.batch_size) for c in active) * cfg.local_epochs
        tb = self._tensorboard()
        with Progress(total_rounds=cfg.rounds, steps_per_round=steps_per_round, start_round=start,
                      desc=cfg.method, disable=self.quiet) as bar:
            for r in range(start, cfg.rounds):
                t0 = time.perf_counter()
                client_records = self._train_clients(active, ctx, r, bar)
                t_train = time.perf_counter() - t0
                rec = self._server_round(r, active, anchors, test_x, test_y, norm, rules, amp_dtype)
                rec["seconds_train"] = t_train
                rec["seconds"] = time.perf_counter() - t0
                self._watch(client_records)
                self._append(client_records + [rec])
                if tb is not None:
                    self._tb_log(tb, r, rec, client_records)
                atomic_torch_save({"rounds_done": r + 1, "clients": [c.state_dict() for c in clients],
                                   "rng": _get_rng_state()}, self.out / "checkpoint.pt")
                self._write_state("running", r + 1)
                bar.round_done(rec.get(f"acc_{self.primary_rule}", float("nan")))
        if tb is not None:
            tb.close()
        self._write_state("finished", cfg.rounds)
        summary = self.summary()
        from flare.report.run_report import write_run_report

        write_run_report(self.out)
        return summary

    def _train_clients(self, active: list[Client], ctx: TrainContext, r: int, bar: Progress) -> list[dict]:
        """Sequentially, or (concurrent_clients=true) one thread per client, each on its own CUDA stream
        so that the GPU overlaps the clients' kernels. Each client draws its augmentation from its own streams
        (`RngStreams`: the CPU generator and, on a GPU, the GPU's), so on CPU the two modes give the same
        numbers (tested); on a GPU they agree up to the order in which nondeterministic kernels reduce."""
        if not self.cfg.concurrent_clients or len(active) == 1:
            out = []
            for c in active:
                bar.client(c.cid)
                out.append(c.train_round(ctx, r, on_step=bar.step))
            return out
        from concurrent.futures import ThreadPoolExecutor

        def work(c: Client) -> dict:
            # kornia modules keep the drawn parameters on the module between drawing and applying them:
            # each thread gets its own augmentation module so clients never apply each other's draws.
            own = dataclasses.replace(ctx, augment=copy.deepcopy(ctx.augment))
            if ctx.device.type == "cuda":
                stream = torch.cuda.Stream(device=ctx.device)
                stream.wait_stream(torch.cuda.current_stream(ctx.device))
                with torch.cuda.stream(stream):
                    rec = c.train_round(own, r, on_step=bar.step)
                stream.synchronize()
                return rec
            return c.train_round(own, r, on_step=bar.step)

        bar.client(-1)
        with ThreadPoolExecutor(max_workers=len(active)) as ex:
            return list(ex.map(work, active))

    def channels_last(self, device: torch.device) -> bool:
        """NHWC pays off on GPUs (tensor cores); on CPU it only adds layout conversions."""
        return self.cfg.channels_last and device.type == "cuda"

    @property
    def primary_rule(self) -> str:
        return primary_rule(self.cfg)

    def _server_round(self, r, active, anchors, test_x, test_y, norm, rules, amp_dtype) -> dict:
        return evaluate_uploads(self.cfg, r, [c.upload() for c in active], [c.model for c in active], anchors,
                                test_x, test_y, norm, rules=rules, amp_dtype=amp_dtype,
                                channels_last=self.channels_last(test_x.device))

    def _watch(self, client_records: list[dict]) -> None:
        """Make the notes' failure mode visible: λ_raw running past 100 × lambda_max or non-finite."""
        limit = 100 * self.cfg.lam.lambda_max
        for rec in client_records:
            v = rec.get("lambda_raw")
            if v is None:
                continue
            if not math.isfinite(v) or v > limit:
                self._warn(f"client {rec['client']}, round {rec['round']}: lambda_raw = {v:.4g} exceeds "
                           f"100 x lambda_max ({limit:g}) — the learned alignment strength is running away.")

    def _warn(self, msg: str) -> None:
        self.warnings.append(msg)
        warnings.warn(msg, stacklevel=2)

    def _log(self, msg: str) -> None:
        if not self.quiet:
            print(msg, flush=True)

    def _tensorboard(self):
        if not self.cfg.logging.tensorboard:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise FlareError("logging.tensorboard=true needs the tensorboard package.", key="logging.tensorboard",
                             fix="pip install tensorboard, or set logging.tensorboard=false.") from None
        return SummaryWriter(str(self.out / "tensorboard"))

    @staticmethod
    def _tb_log(tb, r, rec, client_records) -> None:
        for k, v in rec.items():
            if isinstance(v, (int, float)) and k not in ("round",):
                tb.add_scalar(f"server/{k}", v, r)
        for c in client_records:
            for k in ("lambda", "lambda_raw", "lambda_eff", "base_loss", "align_loss"):
                if k in c:
                    tb.add_scalar(f"client{c['client']}/{k}", c[k], r)

    def summary(self) -> dict:
        rounds = [r for r in read_jsonl(self.metrics_path) if r.get("kind") == "round"]
        if not rounds:
            return {}
        last = rounds[-1]
        out = {"method": self.cfg.method, "primary": self.primary_rule, "rounds": len(rounds)}
        for k, v in last.items():
            if k.startswith("acc_") or k in ("g_protos_std", "inter_client_proto_std", "model_variance_mean"):
                out[k] = v
        accs = [r.get(f"acc_{self.primary_rule}") for r in rounds]
        out["acc"] = accs[-1]
        best = int(np.nanargmax(np.array(accs, dtype=float)))
        out["peak_acc"], out["peak_round"] = accs[best], rounds[best]["round"]
        return out


def run_experiment(cfg: Config, out_dir: str | Path, quiet: bool = False) -> dict:
    return Run(cfg, out_dir, quiet=quiet).execute()


def config_for_preset(base: dict, preset: str) -> Config:
    """The base mapping (user file + overrides) applied over a preset — `flare compare` builds each
    method's config this way, so every method shares the partition, seed and data."""
    from flare.config import deep_merge, preset_mapping

    m = deep_merge(preset_mapping(preset), {k: v for k, v in base.items() if k != "preset"})
    m["preset"] = preset
    return build_config(m)
