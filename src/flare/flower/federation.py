"""Start a Flower federation on this machine as real processes, run FLARE's app on it, stop it.

`LocalFederation` starts one SuperLink and K SuperNodes on loopback addresses, each in its own process group, and
stops every process it started (SIGTERM, then SIGKILL) when it is closed. With `simulation=True` the SuperLink runs
Flower's simulation runtime (Ray) instead and no SuperNodes are started. `run()` submits the app with `flwr run`
against a private Flower home (FLWR_HOME) whose config names the connection, and waits for the run to end.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from importlib import resources
from pathlib import Path

from flare.config import load_config
from flare.errors import FlareError
from flare.flower.protocol import export_partitions
from flare.rundata import RunData
from flare.rundir import RunDir
from flare.setup import check_buildable


def app_dir() -> Path:
    """The Flower app directory `flwr run` reads, shipped inside the package (flare/flower/app/)."""
    return Path(str(resources.files("flare") / "flower" / "app"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config_arg(d: dict) -> str:
    """`key=value ...` as `--run-config` / `--node-config` read it, each value a TOML one (a JSON scalar is)."""
    return " ".join(f"{k}={json.dumps(v if isinstance(v, (bool, int, float)) else str(v))}" for k, v in d.items())


def _bin(name: str) -> str:
    cand = Path(sys.executable).parent / name
    return str(cand) if cand.exists() else name


class FederationError(RuntimeError):
    pass


def _proc_table() -> dict[int, tuple[int, int, str, int]]:
    """{pid: (ppid, process group, state, start time)} of every process, from Linux /proc ({} elsewhere)."""
    out = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
            f = stat[stat.rindex(")") + 2:].split()
            out[int(d.name)] = (int(f[1]), int(f[2]), f[0], int(f[19]))
        except (OSError, ValueError, IndexError):
            continue
    return out


class LocalFederation:
    def __init__(self, workdir: str | Path, node_configs: list[dict] | None = None, simulation: bool = False,
                 connection: str = "flare-local", startup_timeout: float = 60.0):
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.node_configs = node_configs or []
        self.simulation, self.connection, self.startup_timeout = simulation, connection, startup_timeout
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.node_procs: list[subprocess.Popen] = []
        self.port: int | None = None
        self.home = self.workdir / "flwr-home"
        self.env = {"RAY_DEDUP_LOGS": "0", **os.environ, "FLWR_HOME": str(self.home), "FLWR_DISABLE_UPDATE_CHECK": "1",
                    "FLWR_TELEMETRY_ENABLED": "0",
                    "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}

    # -- processes ----------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], serve: bool = True) -> subprocess.Popen:
        with open(self.workdir / f"{name}.log", "wb") as log:
            p = subprocess.Popen(argv, cwd=self.workdir, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        if serve:  # a server process, which `stop` ends
            self.procs.append((name, p))
        return p

    def log_text(self, name: str) -> str:
        p = self.workdir / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def start(self) -> "LocalFederation":
        self.port = free_port()
        argv = [_bin("flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(self.port),
                "--disable-runtime-dependency-installation"]
        if self.simulation:
            argv.append("--simulation")
        self._spawn("superlink", argv)
        self._wait_port(self.port, "superlink")
        for i, nc in enumerate(self.node_configs):
            self.node_procs.append(self._spawn(f"supernode-{i}", [
                _bin("flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{self.port}", "--host", "127.0.0.1",
                "--port", str(free_port()), "--node-config", run_config_arg(nc)]))
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{self.connection}"\n\n[superlink.{self.connection}]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n')
        return self

    def _wait_port(self, port: int, name: str) -> None:
        deadline = time.monotonic() + self.startup_timeout
        proc = dict(self.procs)[name]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise FederationError(f"{name} exited with code {proc.returncode}:\n{self.log_text(name)[-3000:]}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return
            except OSError:
                time.sleep(0.3)
        raise FederationError(f"{name} did not open 127.0.0.1:{port} within {self.startup_timeout:g} s")

    @staticmethod
    def _signal(p: subprocess.Popen, sig) -> None:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)  # the process group this object created for it (start_new_session)

    def descendants(self) -> set[tuple[int, int]]:
        """(pid, start time) of every live process descended from the ones this object started. Flower's
        SuperLink starts its SuperExec in a new process group, and the simulation runtime starts a Ray
        cluster below that: killing our process groups alone would leave them."""
        table = _proc_table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, *_rest) in table.items():
            children.setdefault(ppid, []).append(pid)
        out: set[tuple[int, int]] = set()
        todo = [p.pid for _, p in self.procs]
        while todo:
            for c in children.get(todo.pop(), []):
                if (c, table[c][3]) not in out:
                    out.add((c, table[c][3]))
                    todo.append(c)
        return out

    def _alive(self, procs: set[tuple[int, int]]) -> list[int]:
        """Those of `procs` still running (same pid *and* start time, not a zombie)."""
        table = _proc_table()
        return [pid for pid, start in procs if pid in table and table[pid][3] == start and table[pid][2] != "Z"]

    def group_alive(self, p: subprocess.Popen) -> bool:
        """Whether a live (non-zombie) process is left in the process group `p` was started in."""
        table = _proc_table()
        if not table:  # no /proc
            try:
                os.killpg(p.pid, 0)
                return True
            except (ProcessLookupError, PermissionError):
                return False
        return any(pg == p.pid and st != "Z" for _pp, pg, st, _t in table.values())

    def stop(self, grace: float = 10.0) -> None:
        """Stop everything this object started: SIGTERM to each process group (Flower shuts its SuperExec
        and apps down on SIGTERM), then SIGKILL to the groups and to every descendant seen along the way."""
        seen = self.descendants()
        for _, p in reversed(self.procs):
            if p.poll() is None:
                self._signal(p, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for _, p in reversed(self.procs):
            with suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        seen |= self.descendants()
        for _, p in self.procs:  # whatever ignored SIGTERM, and children left in the groups
            self._signal(p, signal.SIGKILL)
            with suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        for pid in self._alive(seen):
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self._seen = seen  # every descendant stop() saw: the tests check that none is left alive
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (any(self.group_alive(p) for _, p in self.procs) or self._alive(seen)):
            time.sleep(0.2)

    def __enter__(self) -> "LocalFederation":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- a run --------------------------------------------------------------------------------------
    def run(self, app: str | Path, run_config: dict, federation_config: dict | None = None,
            timeout: float = 600.0, log_name: str = "flwr-run") -> subprocess.CompletedProcess:
        argv = [_bin("flwr"), "run", str(app), self.connection, "--stream", "--run-config", run_config_arg(run_config)]
        if federation_config:
            argv += ["--federation-config", run_config_arg(federation_config)]
        p = self._spawn(log_name, argv, serve=False)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._signal(p, signal.SIGKILL)
            p.wait()
            raise FederationError(f"flwr run did not finish within {timeout:g} s; logs in {self.workdir}") from None
        return subprocess.CompletedProcess(argv, rc, self.log_text(log_name), "")


# ----------------------------------------------------------------------------------------------
# `flare federate`


def federate(cfg_file: str | None, preset: str | None, overrides: list[str], *, out: str | Path | None = None,
             clients: int | None = None, min_clients: int = 0, timeout: float = 3600.0, upload: str | None = None,
             simulation: bool = False, local_data: bool = False, workdir: str | Path | None = None, log=print) -> dict:
    """Start a loopback federation (a SuperLink and K SuperNodes, or the Ray simulation runtime), run FLARE's
    Flower app on it, stop every process, and return the run's summary (raises FlareError on a failed run)."""
    if clients is not None:
        overrides = [o for o in overrides if not o.startswith("num_clients=")] + [f"num_clients={clients}"]
    upload = upload or ("per-round" if simulation else "once")
    cfg = load_config(cfg_file, preset, overrides)  # validate before starting anything
    check_buildable(cfg)  # and refuse what `flare run` refuses before writing (data, checkpoints, input sizes)
    K = cfg.num_clients
    out = (Path(out) if out else Path("runs") / f"federate-{cfg.method}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    wd = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="flare-federation-"))
    run_config = {"preset": preset or "", "config-file": str(Path(cfg_file).resolve()) if cfg_file else "",
                  "overrides": shlex.join(overrides), "out-dir": str(out), "upload": upload,
                  "min-clients": int(min_clients), "timeout": float(timeout), "wait-nodes": 120.0}
    files = export_partitions(cfg, wd / "data") if local_data and not simulation else None
    nodes = [] if simulation else [{"partition-id": i, "num-partitions": K} for i in range(K)]
    for node, f in zip(nodes, files or []):
        node["data-path"] = str(f)
    fed = LocalFederation(wd, node_configs=nodes, simulation=simulation)
    log(f"federation: {'Ray simulation' if simulation else f'SuperLink + {K} SuperNodes'} on 127.0.0.1, logs in {wd}")
    try:
        fed.start()
        log(f"federation: SuperLink on 127.0.0.1:{fed.port}; running the app (upload {upload})")
        res = fed.run(app_dir(), run_config,
                      {"num-supernodes": K, "client-resources-num-cpus": 1} if simulation else None,
                      timeout=timeout * (cfg.rounds if upload == "per-round" else 1) + 300)
    finally:
        fed.stop()
    state = RunDir(out).read_state()
    if state.get("status") != "finished":
        err = state.get("error") or f"the run did not finish (flwr run exit code {res.returncode})"
        tail = "\n".join(res.stdout.strip().splitlines()[-15:])
        where = f"federation.json in {out} and " if (out / "federation.json").exists() else ""
        raise FlareError(f"federated run failed: {err}\nlast lines of flwr run:\n{tail}",
                         fix=f"see {where}the process logs in {wd}.")
    return {**RunData.load(out).summary(), "out": str(out), "logs": str(wd)}
