"""The run directory's one owner: every file of a run is written and read here (the files: docs/getting-started.md).

Writers take the lock first; the OS releases it when the process ends, however it ends, so a killed run never
blocks its own resume. Everything is written atomically except metrics.jsonl, which is appended one round at a time
with a single write. The checkpoint is the source of truth: it carries the records of every round it covers, so
`resume_point` can rebuild what a torn or truncated log lost.

A run directory never disagrees with itself: state.json and the checkpoint record the config they were computed
with, state.json the fingerprint of every other record a later command trusts (`RECORDS`), and every command that
reads a run checks config.yaml and those files against that record first (`RunDir.check_consistent`), instead of
reporting numbers of one experiment under the description of another. A directory whose run never completed a
round holds no result: any config may start afresh in it (`RunDir.holds_rounds`).
"""
from __future__ import annotations

import errno
import itertools
import json
import os
import socket
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import yaml

from flare.config import Config, config_to_yaml, experiment_differences, migrate
from flare.durable import (atomic_torch_save, atomic_write_text, encode_record, parse_jsonl,  # noqa: F401
                           read_jsonl)
from flare.errors import FlareError
from flare.models import check_state_fits
from flare.records import config_fingerprint, file_fingerprint, flatten, shown

try:  # POSIX advisory locks; without fcntl (Windows) runs are not locked
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

CONFIG, PARTITION, METRICS, STATE = "config.yaml", "partition.json", "metrics.jsonl", "state.json"
CHECKPOINT, PREV_CHECKPOINT, LOCK, SUMMARY = "checkpoint.pt", "checkpoint.prev.pt", ".lock", "summary.md"
FUSE, SCRATCH = "fuse.jsonl", "fuse-scratch"  # the scratch: builds in progress that resume (never a record)
RECORDS = (PARTITION,)  # records besides config.yaml that later commands trust, fingerprinted in state.json
DIAG = ("g_protos_std", "inter_client_proto_std", "model_variance_mean")                   # docs/method.md#metrics


@dataclass
class ResumePoint:
    """Where a run continues: `rounds_done` complete rounds, their records, the checkpoint to load (None for a
    fresh start), and what validation found."""

    rounds_done: int = 0
    records: list[dict] = field(default_factory=list)
    checkpoint: dict | None = None
    finished: bool = False
    warnings: list[str] = field(default_factory=list)
    state_warnings: list[str] = field(default_factory=list)


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock_fd: int | None = None

    def file(self, name: str) -> Path:
        return self.path / name

    # -- creation and the lock ------------------------------------------------------------------
    def create(self, key: str = "--out") -> None:
        """Make the directory, or say in one paragraph why it cannot be made."""
        p = self.path
        if p.exists() and not p.is_dir():
            raise FlareError(f"'{p}' exists and is a file, not a directory.", key=key,
                             fix="choose another output directory (a run writes a directory of files).")
        try:
            p.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            parent = next((q for q in p.parents if q.exists() and not q.is_dir()), None)
            raise FlareError(f"cannot create '{p}': '{parent or p}' is a file.", key=key,
                             fix="choose an output directory whose parents are folders.") from None
        except OSError as e:  # permission denied, read-only file system, ...
            raise FlareError(f"cannot create '{p}': {e.strerror}.", key=key,
                             fix="choose an output directory you can write to.") from None
        if not os.access(p, os.W_OK | os.X_OK):
            raise FlareError(f"'{p}' is not writable.", key=key, fix="choose an output directory you can write to.")

    def lock(self, key: str = "--out") -> "RunDir":
        """Take the directory's exclusive lock for this process (non-blocking): a second writer gets a FlareError
        naming the process that holds it. Released by `unlock`, or by the OS when the process dies."""
        if fcntl is None or self._lock_fd is not None:
            return self
        self.create(key)
        fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise FlareError(f"run directory '{self.path}' is in use by {holder}.", key=key,
                                 fix="wait for that run to finish or stop it (a stopped or killed run releases the "
                                     "directory by itself), or choose another output directory.") from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()} (since {time.strftime('%Y-%m-%d %H:%M:%S')})"
                      .encode(), 0)
        self._lock_fd = fd
        return self

    def remove_if_empty(self) -> None:
        """Remove the directory if it holds nothing but its lock file (a run that failed before it began)."""
        with suppress(OSError):
            if {p.name for p in self.path.iterdir()} <= {LOCK}:
                (self.path / LOCK).unlink(missing_ok=True)
                self.path.rmdir()

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def __enter__(self) -> "RunDir":
        return self.lock()

    def __exit__(self, *exc) -> None:
        self.unlock()

    # -- writes ---------------------------------------------------------------------------------
    def write_text(self, name: str, text: str) -> None:
        atomic_write_text(self.path / name, text)

    def save_torch(self, name: str, obj) -> None:
        atomic_torch_save(obj, self.path / name)

    def write_config(self, cfg: Config) -> None:
        self.write_text(CONFIG, config_to_yaml(cfg))

    def write_partition(self, report: dict) -> None:
        self.write_text(PARTITION, json.dumps(report, indent=1))

    def append(self, records: list[dict], name: str = METRICS) -> None:
        """Append one round's records (to metrics.jsonl, or `name`) with a single write(2) on an O_APPEND
        descriptor: a kill leaves either none or all of them."""
        data = "".join(encode_record(r) + "\n" for r in records).encode()
        fd = os.open(self.path / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:  # a regular file takes it in one call; loop only for the pathological short write
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_metrics(self, records: list[dict]) -> None:
        self.write_text(METRICS, "".join(encode_record(r) + "\n" for r in records))

    def save_checkpoint(self, obj: dict) -> None:
        """Keep the previous checkpoint as checkpoint.prev.pt (a rename: atomic), then write the new one."""
        cur = self.path / CHECKPOINT
        if cur.exists():
            os.replace(cur, self.path / PREV_CHECKPOINT)
        atomic_torch_save(obj, cur)

    def clear_checkpoints(self) -> None:
        for name in (CHECKPOINT, PREV_CHECKPOINT):
            (self.path / name).unlink(missing_ok=True)

    def drop_previous_checkpoint(self) -> None:
        (self.path / PREV_CHECKPOINT).unlink(missing_ok=True)

    def write_state(self, status: str, rounds_done: int, warnings: list[str], config: dict | None = None,
                    **extra) -> None:
        """state.json, with the fingerprints of `config` (the resolved config) and of the `RECORDS`."""
        recorded = {"config_fingerprint": config_fingerprint(config), "config": config} if config is not None else {}
        if files := {name: fp for name in RECORDS if (fp := file_fingerprint(self.path / name)) is not None}:
            recorded["files"] = files
        self.write_text(STATE, json.dumps({"status": status, "rounds_done": rounds_done, "warnings": warnings,
                                           **extra, **recorded}, indent=1))

    # -- reads ----------------------------------------------------------------------------------
    def read_config(self) -> dict | None:
        p = self.path / CONFIG
        if not p.is_file():
            return None
        try:
            m = yaml.safe_load(p.read_text())
        except (yaml.YAMLError, UnicodeDecodeError):
            m = None
        if not isinstance(m, dict):
            raise FlareError(f"'{p}' is not a readable config (damaged?).", key="--out",
                             fix="restore it, or delete the run directory and rerun.")
        return migrate(m)  # written before a key was renamed: read with its new name

    def read_json(self, name: str) -> dict:
        """A JSON object file of the directory ({} if it is missing, damaged or not an object)."""
        p = self.path / name
        try:
            d = json.loads(p.read_text()) if p.is_file() else {}
        except (json.JSONDecodeError, UnicodeDecodeError):
            return {}
        return d if isinstance(d, dict) else {}

    def read_state(self) -> dict:
        return self.read_json(STATE)

    def read_metrics(self) -> tuple[list[dict], list[int]]:
        p = self.path / METRICS
        return parse_jsonl(p.read_text(errors="replace")) if p.exists() else ([], [])

    def load_checkpoint(self, device, warn: Callable[[str], None]) -> dict | None:
        """The newest readable checkpoint (checkpoint.pt, else checkpoint.prev.pt with a warning), or None."""
        problems = []
        for name in (CHECKPOINT, PREV_CHECKPOINT):
            p = self.path / name
            if not p.exists():
                continue
            try:
                ck = torch.load(p, map_location=device, weights_only=True)
                if not isinstance(ck, dict) or "rounds_done" not in ck:
                    raise ValueError("not a FLARE checkpoint")
            except Exception as e:  # noqa: BLE001 — a truncated/empty/foreign file raises many kinds of error
                why = (str(e).splitlines() or ["empty or truncated"])[0][:120]
                problems.append(f"{name} is unreadable ({type(e).__name__}: {why})")
                continue
            if problems:
                warn(f"{self.path}: {problems[0]}; resuming from {name} (after round {int(ck['rounds_done'])}).")
            return ck
        if problems:
            warn(f"{self.path}: " + "; ".join(problems) + ", and no older checkpoint is readable.")
        return None

    def check_client_states(self, saved: list, models: list, key: str, rerun: str) -> None:
        """Refuse a checkpoint whose client states do not fit the run's client `models` (one per client, in order),
        before anything loads them; `rerun`: the fix's alternative to restoring config.yaml."""
        fix = f"the checkpoint was made by another experiment: restore {self.path / CONFIG}, or {rerun}."
        where = self.path / CHECKPOINT
        if len(saved) != len(models):
            raise FlareError(f"{where} holds {len(saved)} clients, the run has {len(models)}.", key=key, fix=fix)
        for i, (m, st) in enumerate(zip(models, saved)):
            check_state_fits(m, st.get("model") if isinstance(st, dict) else st, f"{where} (client {i})", key=key,
                             fix=fix)

    # -- consistency ----------------------------------------------------------------------------
    def check_consistent(self, key: str = "--out", checkpoint: dict | None = None,
                         resuming: Config | None = None) -> None:
        """Refuse a directory whose config.yaml is not the config its files were computed with (as state.json and
        `checkpoint` record it; a run from before they did is taken as it is). `resuming`: the config a resume
        continues with, for which a difference in `rounds` alone may be a legitimate extension caught between
        writing config.yaml and state.json."""
        current = self.read_config()
        if current is None:
            return
        sources = [(STATE, self.read_state().get("config"))]
        if checkpoint is not None:
            sources.append((CHECKPOINT, checkpoint.get("config")))
        for name, recorded in sources:
            if not isinstance(recorded, dict) or config_fingerprint(recorded) == config_fingerprint(current):
                continue
            diff = experiment_differences(recorded, current)
            if not diff or (diff == ["rounds"] and resuming is not None
                            and extension_problem(recorded, resuming) is None):
                continue
            a, b = flatten(recorded), flatten(current)
            listed = ", ".join(f"{k} ({shown(a.get(k))} → {shown(b.get(k))})" for k in diff[:8])
            more = f" and {len(diff) - 8} more" if len(diff) > 8 else ""
            raise FlareError(
                f"run directory '{self.path}' disagrees with itself: its {CONFIG} is not the config its results "
                f"were computed with (recorded in {name}); keys that differ: {listed}{more}. Nothing was changed.",
                key=key, fix=f"restore {CONFIG} to the recorded values, or run the edited experiment as a new run: "
                             f"`flare run --config {self.path / CONFIG} --out NEW_DIR`.")
        files = self.read_state().get("files")
        for name in RECORDS:
            recorded = files.get(name) if isinstance(files, dict) else None
            if recorded is not None and file_fingerprint(self.path / name) != recorded:
                raise FlareError(
                    f"run directory '{self.path}' disagrees with itself: its {name} is not the one its run wrote "
                    f"(its fingerprint is recorded in {STATE}); it was edited, replaced or removed. Nothing was "
                    "changed.", key=key,
                    fix=f"restore {name}, or rerun the experiment into a new directory (runs are deterministic: "
                        f"`flare run --config {self.path / CONFIG} --out NEW_DIR` writes it again).")

    def holds_rounds(self) -> bool:
        """Whether the directory holds the result of a round: a checkpoint, a round recorded in state.json or in
        metrics.jsonl."""
        if any((self.path / name).exists() for name in (CHECKPOINT, PREV_CHECKPOINT)):
            return True
        done = self.read_state().get("rounds_done")
        return isinstance(done, int) and done > 0 or any(r.get("kind") == "round" for r in self.read_metrics()[0])

    # -- resuming -------------------------------------------------------------------------------
    def check_continues(self, cfg: Config, key: str = "--out") -> list[str]:
        """Refuse a directory `cfg` cannot continue (another experiment; the same one with more rounds is fine where
        nothing depends on R); returns the keys that differ ([] or ["rounds"]). Reads no checkpoint: cheap."""
        old = self.read_config()
        if old is None or not self.holds_rounds():
            return []
        self.check_consistent(key, resuming=cfg)
        diff = experiment_differences(old, cfg)
        why = extension_problem(old, cfg) if diff == ["rounds"] else None
        if diff and (diff != ["rounds"] or why):
            raise FlareError(f"run directory '{self.path}' holds a different experiment (keys differ: "
                             f"{', '.join(diff)})" + (f"; {why}" if why else "") + ".", key=key,
                             fix="choose another output directory, or delete the old one.")
        return diff

    def resume_point(self, cfg: Config, key: str = "--out") -> ResumePoint:
        """Validate the directory against `cfg` (`check_continues`) and its checkpoint before trusting it: the
        checkpoint says how far the run got, and metrics.jsonl is checked against the records it carries (torn,
        extra, missing or altered records are reported and the log rebuilt from it)."""
        rp = ResumePoint()
        old = self.read_config()
        if old is None or not self.holds_rounds():
            return rp
        diff = self.check_continues(cfg, key)
        state = self.read_state()
        warn = rp.warnings.append
        ck = self.load_checkpoint("cpu", warn)
        self.check_consistent(key, ck, resuming=cfg)
        records, torn = self.read_metrics()
        log = self.path / METRICS
        for line in torn:
            warn(f"{log}: line {line} is torn or unreadable (cut mid-line?); dropped.")
        if ck is None:
            R = int(old.get("rounds", 0))
            if state.get("status") == "finished" and not diff and not torn and _complete(records, R):
                warn(f"{self.path}: the finished run's log is complete (rounds 1–{R}), so it is kept; without a "
                     "checkpoint the run cannot be extended.")
                rp.rounds_done, rp.records, rp.finished = R, records, True
                rp.state_warnings = list(state.get("warnings", []))
            elif records or state.get("rounds_done"):
                warn(f"{self.path}: no readable checkpoint to resume from; the run starts again from round 1 (runs "
                     "are deterministic: it recomputes the same numbers).")
            return rp
        n = int(ck["rounds_done"])
        saved = ck.get("records")
        kept = [r for r in records if isinstance(r.get("round"), int) and r["round"] < n]
        if len(kept) < len(records):
            warn(f"{log}: {len(records) - len(kept)} record(s) written after the checkpoint (after "
                 f"round {n}) dropped; round {n + 1} is recomputed.")
        have = {r["round"] for r in kept if r.get("kind") == "round"}
        missing = [m + 1 for m in range(n) if m not in have]
        if saved is not None:
            if [encode_record(r) for r in kept] != [encode_record(r) for r in saved]:
                what = f"round(s) {_ranges(missing)} missing" if missing else "records that differ"
                warn(f"{log} disagrees with {CHECKPOINT} ({what}); rebuilt from the checkpoint, "
                     "which records every round it covers.")
            kept = list(saved)
        elif missing:  # a checkpoint from before records were kept in it: the log must be complete on its own
            raise FlareError(f"run directory '{self.path}': metrics.jsonl lacks round(s) {_ranges(missing)}, and "
                             "this (older) checkpoint cannot restore them.", key="--out",
                             fix="delete the run directory (or its checkpoint*.pt, metrics.jsonl and state.json) "
                                 "and rerun: runs are deterministic, so it recomputes the same numbers.")
        rp.rounds_done, rp.records, rp.checkpoint = n, kept, ck
        rp.finished = n >= cfg.rounds and state.get("status") == "finished" and not diff
        rp.state_warnings = list(state.get("warnings", []))
        if state.get("status") == "finished" and n < int(old.get("rounds", n)):
            warn(f"{self.path}: state.json says finished, but the newest readable checkpoint covers {n} of "
                 f"{old.get('rounds')} rounds; the run continues from there.")
        return rp


def extension_problem(old: dict, cfg: Config) -> str | None:
    """Why `cfg` (the same experiment with another `rounds`) cannot continue a run made for `old["rounds"]`, or
    None when it can: fewer rounds, or anything that depends on the progress p = e/(R·E)."""
    if cfg.rounds < int(old.get("rounds", 0)):
        return f"rounds={cfg.rounds} is fewer than the {old.get('rounds')} rounds the run was made for"
    if deps := cfg.schedule_dependencies():
        return (f"more rounds would change the progress p = e/(R·E) that {', '.join(deps)} follow, so the rounds "
                "already trained would not be those of the longer run")
    return None


def _complete(records: list[dict], rounds: int) -> bool:
    """Whether a log holds exactly one round record for each of `rounds` rounds, each after its clients' records."""
    idx = [r.get("round") for r in records if r.get("kind") == "round"]
    return idx == list(range(rounds)) and all(r.get("round", -1) < rounds for r in records)


def _ranges(xs: list[int]) -> str:
    """Sorted ints as runs: [1, 2, 3, 5] → "1–3, 5"."""
    runs = [[x for _, x in g] for _, g in itertools.groupby(enumerate(xs), lambda ix: ix[1] - ix[0])]
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}–{r[-1]}" for r in runs)
