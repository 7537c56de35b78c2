"""One experiment in one process: rounds × clients, an evaluation checkpoint after every round. A run killed at
any instant loses at most the round in progress: rerunning into the same directory validates what is there and
resumes from the last complete round (rundir.py); a finished run is re-validated, not recomputed.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from flare import cpu
from flare.client.batched import BatchedClients, by_architecture
from flare.client.trainer import Client, TrainContext
from flare.config import Config
from flare.errors import FlareError
from flare.progress import Progress
from flare.report.run_report import write_run_report
from flare.rng import global_rng_state, set_global_rng_state
from flare.rundata import RunData
from flare.rundir import SUMMARY, ResumePoint, RunDir
from flare.server.extras import ClientData, client_extras, client_side, extras_shapes
from flare.loop import Clients, run_rounds
from flare.server.rounds import Evaluation
from flare.setup import RunSetup


class Run:
    def __init__(self, cfg: Config, out_dir: str | Path, quiet: bool = False, label: str | None = None):
        self.cfg, self.dir, self.quiet = cfg, RunDir(out_dir), quiet
        self.label = label or cfg.method  # how progress lines name the run
        self.warnings: list[str] = []
        self.facts: dict = {}  # how this invocation computed (backend.Backend.facts), kept in state.json

    @property
    def out(self) -> Path:
        return self.dir.path

    def execute(self) -> dict:
        fresh = not self.dir.path.exists()
        try:
            with self.dir.lock():
                return self._execute()
        except BaseException:
            if fresh:  # a run that failed before writing anything leaves no empty directory behind
                self.dir.remove_if_empty()
            raise

    def _execute(self) -> dict:
        cfg = self.cfg
        cpu.pin(cfg.cpu_isa)  # before the first tensor operation (reading a checkpoint is one); build() checks it
        rp = self.dir.resume_point(cfg)
        for w in rp.warnings:
            self._warn(w)
        if rp.finished:
            return self._revalidated(rp)
        setup = RunSetup.build(cfg)
        for w in setup.server.backend.warnings:
            self._warn(w)
        self.facts = setup.server.backend.facts(cfg)
        before = (self.dir.read_state().get("backend") or {}) if rp.rounds_done else {}
        for key in ("cpu_kernels", "machine"):  # the digits of the two parts may differ: say so, with both
            if (was := before.get(key)) and was != (now := self.facts[key]):
                self._warn(f"through round {rp.rounds_done} it ran with {key} '{was}', from then on with '{now}'")
        clients = setup.make_clients(self._warn, self._log)
        if cfg.compile and cfg.client_engine != "batched":  # the batched engine compiles its own batched step
            for c in clients:
                c.model.compile()  # in place: state_dict keys (uploads, checkpoints) stay unchanged
        active = [c for c in clients if c.num_samples > 0]
        if not active:
            raise FlareError("no client received any sample.", key="num_clients", fix="use fewer clients or more data.")
        records = self._restore(rp, clients)
        if rp.checkpoint is not None:
            setup.server.load_server_state(rp.checkpoint.get("server"))
        # every check has passed: only now is the directory written
        self.dir.write_config(cfg)
        self.dir.write_partition(setup.partition_report)
        if rp.checkpoint is None:
            self.dir.clear_checkpoints()
        self.dir.write_metrics(records)
        config = cfg.model_dump(mode="json")
        batched = by_architecture(active, setup.ctx, compile=cfg.compile) if cfg.client_engine == "batched" else None
        steps_per_round = sum(c.steps_per_epoch for c in active) * cfg.local_epochs
        tb = self._tensorboard()
        with Progress(total_rounds=cfg.rounds, steps_per_round=steps_per_round, start_round=rp.rounds_done,
                      desc=self.label, disable=self.quiet) as bar:
            run_rounds(setup.server, InProcess(self, setup, clients, active, batched, bar, tb, records, config),
                       self.dir, self._warn, start=rp.rounds_done)
        if tb is not None:
            tb.close()
        self.dir.write_state("finished", cfg.rounds, self.warnings, config, backend=self.facts)
        self.dir.drop_previous_checkpoint()
        return write_run_report(self.out).summary()

    def _merge_warnings(self, rp: ResumePoint) -> None:
        """The warnings state.json recorded, then this invocation's new ones."""
        self.warnings = rp.state_warnings + [w for w in self.warnings if w not in rp.state_warnings]

    def _restore(self, rp: ResumePoint, clients: list[Client]) -> list[dict]:
        """Load the checkpoint (if any) into the clients, each state checked first; returns its rounds' records."""
        if rp.checkpoint is None:
            return []
        saved = rp.checkpoint["clients"]
        self.dir.check_client_states(saved, [c.model for c in clients], "--out", "start a new run with --out NEW_DIR")
        for c, st in zip(clients, saved):
            c.load_state_dict(st)
        set_global_rng_state(rp.checkpoint.get("rng"))
        self._merge_warnings(rp)
        self._log(f"{self.out}: resuming after round {rp.rounds_done}.")
        return list(rp.records)

    def _revalidated(self, rp: ResumePoint) -> dict:
        """A finished run: rewrite what validation found wrong (the log, the report), recompute nothing."""
        self._log(f"{self.out}: finished earlier; nothing to recompute.")
        if rp.warnings:
            self.dir.write_metrics(rp.records)
            self._merge_warnings(rp)
            self.dir.write_state("finished", rp.rounds_done, self.warnings, self.cfg.model_dump(mode="json"),
                                 **{k: v for k, v in self.dir.read_state().items() if k == "backend"})
        if rp.warnings or not self.dir.file(SUMMARY).exists():
            return write_run_report(self.out).summary()
        return RunData.load(self.out).summary()

    def _train_clients(self, active: list[Client], ctx: TrainContext, r: int, bar: Progress,
                       batched: list[BatchedClients] | None = None) -> list[dict]:
        """By `client_engine`: sequentially; in threads, each on its own CUDA stream; or batched, one vmapped program
        per client architecture. Each client draws from its own streams, so on CPU threads give exactly the
        sequential numbers and the batched engine the same up to float rounding (on a GPU: up to reduction order)."""
        if batched is not None:
            bar.client(-1)
            out = [rec for group in batched for rec in group.train_round(r, on_step=bar.step)]
            return sorted(out, key=lambda rec: rec["client"])
        if self.cfg.client_engine == "sequential" or len(active) == 1:
            out = []
            for c in active:
                bar.client(c.cid)
                out.append(c.train_round(ctx, r, on_step=bar.step))
            return out

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

    def _warn(self, msg: str) -> None:
        self.warnings.append(msg)
        warnings.warn(msg, stacklevel=2)

    def _log(self, msg: str) -> None:
        if not self.quiet:
            print(msg, flush=True)

    def _tensorboard(self):
        if not self.cfg.logging.tensorboard:
            return None
        try:  # lazy: tensorboard is an optional extra
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise FlareError("logging.tensorboard=true needs the tensorboard package.", key="logging.tensorboard",
                             fix="pip install tensorboard, or set logging.tensorboard=false.") from None
        return SummaryWriter(str(self.out / "tensorboard"))


class InProcess(Clients):
    """The loop's transport in one process: the clients train beside the server and upload their live models
    (every one must pass the gate); after every round a checkpoint."""

    def __init__(self, run: Run, setup: RunSetup, clients: list[Client], active: list[Client],
                 batched: list[BatchedClients] | None, bar: Progress, tb, records: list[dict], config: dict):
        self.run, self.setup, self.clients, self.active, self.batched = run, setup, clients, active, batched
        self.bar, self.tb, self.records, self.config = bar, tb, records, config
        self.required, self.without_data = len(clients), {c.cid for c in clients if c.num_samples == 0}

    def blocks(self, start: int) -> list[tuple[int, int]]:
        return [(r, r + 1) for r in range(start, self.setup.server.cfg.rounds)]

    def train(self, first: int, end: int, sent: dict) -> list[dict]:
        self.setup.ctx.received = sent
        return self.run._train_clients(self.active, self.setup.ctx, first, self.bar, self.batched)

    def side(self, cid: int) -> ClientData:
        """A client's side of `Strategy.client_extras`: a copy of its model (a strategy cannot disturb training)."""
        ctx, c = self.setup.ctx, self.clients[cid]
        return client_side(cid, c.model, ctx.train_x[c.indices], ctx.train_y[c.indices], self.setup.server.norm,
                           ctx.augment, self.setup.server.backend.device)

    def uploads(self, r: int, scored) -> list:
        asks = bool(extras_shapes(scored, self.setup.server.template))
        return [c.upload(client_extras(scored, self.side(c.cid)) if asks else None) for c in self.active]

    def stop(self, msg: str, rejected) -> FlareError:
        return FlareError(msg + " Every client of an in-process run must upload: the run stops here.",
                          fix="the warnings name each tensor at fault; rerun once its cause is fixed.")

    def models(self, uploads) -> list:
        return [self.clients[u.client].model for u in uploads]

    def round_done(self, r: int, rec: dict, logs: list[dict], ev: Evaluation | None) -> None:
        self.records += logs + [rec]
        if self.tb is not None:  # the round's numbers, and each client's λ and losses
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "round":
                    self.tb.add_scalar(f"server/{k}", v, r)
            for c in logs:
                for k in ("lambda", "lambda_raw", "lambda_eff", "base_loss", "align_loss"):
                    if k in c:
                        self.tb.add_scalar(f"client{c['client']}/{k}", c[k], r)
        self.run.dir.save_checkpoint({"rounds_done": r + 1, "clients": [c.state_dict() for c in self.clients],
                                      "rng": global_rng_state(), "records": self.records,
                                      "server": self.setup.server.server_state(), "config": self.config})
        self.run.dir.write_state("running", r + 1, self.run.warnings, self.config, backend=self.run.facts)
        self.bar.round_done(rec.get("acc", float("nan")))

