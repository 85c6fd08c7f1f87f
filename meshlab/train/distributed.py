"""Multi-process runs on JAX's multi-controller runtime: start-up, same-run check, watchdog.

One process per host (or per GPU group). `initialize()` joins the run from, in order:
explicit arguments; MESHLAB_COORDINATOR / MESHLAB_NUM_PROCESSES / MESHLAB_PROCESS_ID;
Slurm or Open MPI (JAX's own cluster detection). On CPU it selects gloo collectives, which is
what lets several local processes stand in for several hosts in the tests.

`check_same_run()` compares a hash of the resolved config and of the code across processes
through the coordination service's key-value store, and refuses to start on a mismatch.

`Watchdog` makes a dead or hung process visible: each process publishes its last finished
step; a process whose peer stops publishing (dead) or whose own loop and a peer's step stop
advancing for `timeout` seconds (hung in a collective) prints a message naming the peer and
exits, instead of waiting forever inside a collective.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import jax

_ROOT = Path(__file__).resolve().parents[2]
_CODE_DIRS = ("meshlab", "models", "pallas_kernels", "sharding_rules")


class DistributedError(RuntimeError):
    pass


def _env_int(name: str) -> Optional[int]:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise DistributedError(f"environment variable {name}={v!r} is not an integer") from None


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, heartbeat_timeout: int = 100) -> bool:
    """Join a multi-process run if one is described; returns whether it did. Must run before
    anything touches a JAX backend."""
    coordinator = coordinator or os.environ.get("MESHLAB_COORDINATOR")
    num_processes = num_processes if num_processes is not None else _env_int("MESHLAB_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int("MESHLAB_PROCESS_ID")
    explicit = coordinator is not None or num_processes is not None or process_id is not None
    cluster = (_env_int("SLURM_NTASKS") or 1) > 1 or (_env_int("OMPI_COMM_WORLD_SIZE") or 1) > 1
    if not explicit and not cluster:
        return False
    if explicit and (coordinator is None or num_processes is None or process_id is None):
        raise DistributedError(
            "a multi-process launch needs all three of coordinator address, number of processes and process id "
            f"(got {coordinator!r}, {num_processes!r}, {process_id!r}); set --coordinator/--num-processes/"
            "--process-id or MESHLAB_COORDINATOR/MESHLAB_NUM_PROCESSES/MESHLAB_PROCESS_ID")
    if explicit and not 0 <= process_id < num_processes:
        raise DistributedError(f"process id {process_id} is outside 0..{num_processes - 1}")
    if "cpu" in os.environ.get("JAX_PLATFORMS", "") or os.environ.get("MESHLAB_CPU_COLLECTIVES"):
        # CPU devices of several processes talk through gloo (TCP); without it CPU
        # computations that span processes fail to compile.
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except (AttributeError, KeyError, ValueError):  # a jax where gloo is the default or the flag moved
            pass
    kw = dict(heartbeat_timeout_seconds=heartbeat_timeout)
    if explicit:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, **kw)
    else:
        jax.distributed.initialize(**kw)   # Slurm / Open MPI auto-detection
    return True


def _client():
    from jax._src import distributed as _d
    client = _d.global_state.client
    if client is None:
        raise DistributedError("jax.distributed is not initialised")
    return client


def code_hash() -> str:
    """sha256 over the package sources and rule files (what every process must run alike)."""
    h = hashlib.sha256()
    for d in _CODE_DIRS:
        for p in sorted((_ROOT / d).rglob("*")):
            if p.is_file() and p.suffix in (".py", ".yaml"):
                h.update(str(p.relative_to(_ROOT)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()[:16]


def check_same_run(config_text: str, timeout_s: int = 120) -> None:
    """Refuse to start unless every process has the same config and code hashes."""
    if jax.process_count() == 1:
        return
    client = _client()
    mine = {"config": hashlib.sha256(config_text.encode()).hexdigest()[:16], "code": code_hash(),
            "host": socket.gethostname()}
    client.key_value_set(f"meshlab/hash/{jax.process_index()}", json.dumps(mine), allow_overwrite=True)
    theirs = {}
    for p in range(jax.process_count()):
        try:
            theirs[p] = json.loads(client.blocking_key_value_get(f"meshlab/hash/{p}", timeout_s * 1000))
        except Exception as e:  # noqa: BLE001 - the runtime raises its own status errors
            raise DistributedError(f"process {p} did not report its config/code hash within {timeout_s} s "
                                   f"({type(e).__name__}); is it running the same meshlab?") from None
    ref = theirs[0]
    bad = [(p, k) for p, t in theirs.items() for k in ("config", "code") if t[k] != ref[k]]
    if bad:
        lines = ", ".join(f"process {p} on {theirs[p]['host']} has a different {k} ({theirs[p][k]} vs "
                          f"{ref[k]} on process 0)" for p, k in bad)
        raise DistributedError(f"refusing to start: {lines}. Launch every process with the same config, "
                               "overrides and code checkout")


# What a collective's runtime error says when a peer process died or lost its connection mid-step (gloo on
# CPU hosts, NCCL on GPUs, the coordination service): the watchdog's timeout is longer than the step that fails.
_PEER_LOST = ("Gloo", "NCCL", "Connection reset", "connection closed", "Socket closed", "Broken pipe",
              "UNAVAILABLE", "heartbeat")


def peer_failure(e: BaseException) -> Optional[str]:
    """In a run of several processes: one line saying a peer is gone, when `e` is a collective or
    coordination error that says so; None for anything else (including every error of a 1-process run)."""
    if jax.process_count() < 2 or type(e).__name__ not in ("JaxRuntimeError", "XlaRuntimeError"):
        return None
    text = str(e)
    if not any(s.lower() in text.lower() for s in _PEER_LOST):
        return None
    first = text.strip().splitlines()[0][:200] if text.strip() else type(e).__name__
    return (f"a collective of this {jax.process_count()}-process run failed on process {jax.process_index()} "
            f"({first}): another process stopped or lost its connection. Restart every process with --resume "
            "once all hosts are healthy")


class Watchdog:
    """Background thread: publish this process's progress, and stop when a peer is dead or hung.

    Detection works on local clocks only (a peer's value changing, not its timestamps), so
    host clock skew does not matter. Cost: one small key-value write and one directory read
    per `interval` seconds, nothing on the training path.
    """

    def __init__(self, timeout: float = 300.0, interval: Optional[float] = None, exit_fn=None):
        self.timeout = float(timeout)
        self.interval = interval or max(0.5, min(10.0, self.timeout / 10))
        self.step = 0
        self._exit = exit_fn or (lambda code: os._exit(code))
        self._stop = threading.Event()
        self._seen: dict[int, tuple[str, float]] = {}     # peer -> (last value, local time it changed)
        self._my_progress = None    # set by the first beat: compiling the first step is not a hang
        self.thread = None

    def start(self) -> "Watchdog":
        if jax.process_count() > 1:
            self.thread = threading.Thread(target=self._loop, name="meshlab-watchdog", daemon=True)
            self.thread.start()
        return self

    def beat(self, step: int) -> None:
        """Called by the training loop after each step."""
        self.step = step
        self._my_progress = time.monotonic()

    @contextlib.contextmanager
    def paused(self):
        """A blocking checkpoint write or validation is not a hang (peers' deaths still count)."""
        self._my_progress = None
        try:
            yield
        finally:
            self._my_progress = time.monotonic()

    def _loop(self) -> None:
        client, me, beat = _client(), jax.process_index(), 0
        while not self._stop.wait(self.interval):
            beat += 1
            try:
                client.key_value_set(f"meshlab/hb/{me}", f"{self.step} {beat}", allow_overwrite=True)
                raw = client.key_value_dir_get("meshlab/hb/")
            except Exception as e:  # noqa: BLE001
                return self._fail(f"lost the coordination service (process 0 dead?): {type(e).__name__}: {e}")
            now = time.monotonic()
            peers = {int(k.rsplit("/", 1)[-1]): v for k, v in raw}
            for p in range(jax.process_count()):
                if p == me:
                    continue
                value = peers.get(p)
                if value == "done":       # finished normally; its silence from now on is fine
                    continue
                last = self._seen.get(p)
                if value is not None and (last is None or last[0] != value):
                    self._seen[p] = (value, now)
                    continue
                since = now - (last[1] if last else self._start_time(now))
                if since > self.timeout:
                    self._stop.set()
                    return self._fail(f"process {p} has not reported for {since:.0f} s (dead or stuck outside "
                                      f"the loop); stopping process {me} at step {self.step}")
            self._check_hung(now, peers, me)

    def _start_time(self, now: float) -> float:
        if not hasattr(self, "_t0"):
            self._t0 = now
        return self._t0

    def _check_hung(self, now: float, peers: dict, me: int) -> None:
        """Alive but not advancing: our loop is blocked, and the slowest peer is the suspect."""
        if self._my_progress is None or now - self._my_progress <= self.timeout:
            return
        steps = {p: int(v.split()[0]) for p, v in peers.items() if v != "done"}
        slowest = min(steps, key=lambda p: steps[p]) if steps else None
        self._fail(f"no step finished for {now - self._my_progress:.0f} s; process {slowest} is at step "
                   f"{steps.get(slowest)} (hung?); stopping process {me} at step {self.step}")
        self._stop.set()

    def _fail(self, msg: str) -> None:
        print(f"meshlab watchdog: {msg}. Restart the run with --resume once all hosts are healthy.",
              file=sys.stderr, flush=True)
        self._exit(3)

    def stop(self) -> None:
        self._stop.set()
        if self.thread is not None:
            self.thread.join(timeout=self.interval * 2)
            try:
                _client().key_value_set(f"meshlab/hb/{jax.process_index()}", "done", allow_overwrite=True)
            except Exception:  # noqa: BLE001 - the service may already be gone at exit
                pass
