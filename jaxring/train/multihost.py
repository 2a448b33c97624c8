"""Multi-host start-up that fails with a message instead of hanging, and agreement between processes.

`jax.distributed.initialize` aborts the whole process from C++ (no Python exception, no message naming
anything) when the coordinator is unreachable or a process is missing, and two processes given the same id
abort one and hang the other. So `initialize` first runs a small rendezvous of its own over TCP on the
coordinator's port, in Python, with a deadline:

    process 0:   listen on the coordinator port; collect one hello {"process_id", "num_processes"} from each
                 other process; check the ids are unique and in range and the counts agree; answer every
                 process "ok" (or the error); close the port.
    process k>0: connect (retrying until the deadline); send the hello; wait for the answer.

Any failure (nobody at the coordinator, a process missing, duplicate ids, counts that differ) is a
`MultiHostError` naming the coordinator, this process's id and what is wrong, raised on every process that
took part, before JAX is touched. Only then is `jax.distributed.initialize` called, on the now known-good set
of processes, with the same deadline.

The hello also carries the run's settings (`shared_settings`: the run specification as given, without the
settings that may differ per process: process id, coordinator, output paths, ...) and a hash of them:
processes given different mesh flags (`--sp 8` on one, `--dp 2 --sp 4` on another) would otherwise start
programs that wait for each other for ever; here every process stops with one line naming the setting.

Without --coordinator / --num-processes (nor JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES) inside a SLURM job
or an Open MPI launch of more than one task, `start_processes` lets `jax.distributed.initialize()` find the
coordinator, the process count and this process's id itself (its cluster detection), then compares the
settings' hashes across the processes. --coordinator still overrides.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxring.core.device_setup import check_cpu_devices

if TYPE_CHECKING:
    from jaxring.run.schema import ClusterSettings
    from jaxring.run.spec import RunSpec


class MultiHostError(ValueError):
    """The multi-host set-up is wrong (bad flags, unreachable coordinator, missing or duplicate process)."""


MAX_TIMEOUT_S = 1e6  # --init-timeout's bound (the spec's "seconds" rule): socket timeouts overflow past ~1e9

# settings that may differ between the processes of one run (everything else must be the same everywhere)
PER_PROCESS_SETTINGS = (
    "process_id",
    "coordinator",
    "init_timeout",
    "out_dir",
    "metrics_file",
    "progress",
    "profile",
    "log_every",
    "tensorboard",
    "wandb",
)


def shared_settings(spec: RunSpec) -> dict:
    """The run's settings every process must agree on (as JSON values), by flat name."""
    flat = {k: v for k, v in spec.flat().items() if k not in PER_PROCESS_SETTINGS}
    return json.loads(json.dumps(flat, sort_keys=True, default=str))


def settings_digest(settings: dict | None) -> str | None:
    return None if settings is None else hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _shown(value: object) -> str:
    return "(not given)" if value is None else str(value)


def _first_difference(ours: dict, theirs: dict) -> str:
    """The first setting (by name) whose values differ."""
    for key in sorted(set(ours) | set(theirs)):
        if ours.get(key) != theirs.get(key):
            return key
    return "?"


def env_int(name: str) -> int | None:
    """An integer environment variable, or None when unset; MultiHostError naming it when malformed."""
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise MultiHostError(f"environment variable {name}={value!r} must be an integer") from None


def check_flags(
    coordinator: str | None, num_processes: int | None, process_id: int | None, timeout_s: float
) -> tuple[str, int]:
    """(host, port) of a well-formed multi-host set-up; MultiHostError naming the bad value otherwise."""
    if num_processes is None or process_id is None or not coordinator:
        missing = [
            name
            for name, v in (
                ("--coordinator", coordinator),
                ("--num-processes", num_processes),
                ("--process-id", process_id),
            )
            if v is None or v == ""
        ]
        raise MultiHostError(
            f"a multi-host run needs --coordinator, --num-processes and --process-id (or "
            f"JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); missing "
            f"{', '.join(missing)}"
        )
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise MultiHostError(f"--num-processes {num_processes!r} must be a positive integer")
    if isinstance(process_id, bool) or not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise MultiHostError(f"--process-id {process_id!r} must be in [0, --num-processes = {num_processes})")
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not math.isfinite(timeout_s)
        or not 0 < timeout_s <= MAX_TIMEOUT_S
    ):
        raise MultiHostError(f"--init-timeout {timeout_s!r} must be a finite number of seconds in (0, 1e6]")
    host, sep, port = str(coordinator).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MultiHostError(f"--coordinator {coordinator!r} must be HOST:PORT with a port in [1, 65535]")
    return host.strip("[]"), int(port)


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall((json.dumps(message) + "\n").encode())


def _receive(conn: socket.socket, deadline: float) -> dict | None:
    """One JSON line from `conn` before `deadline`, or None (closed, timed out or not JSON)."""
    data = b""
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        conn.settimeout(remaining)
        try:
            chunk = conn.recv(4096)
        except (TimeoutError, OSError):
            return None
        if not chunk:
            return None
        data += chunk
    try:
        message = json.loads(data)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


LATE_GRACE_S = 2.0  # after an error, process 0 still answers processes arriving this much later


def _check_hello(hello: dict, address: str, seen: dict, num_processes: int, settings: dict | None = None) -> str | None:
    pid, count = hello.get("process_id"), hello.get("num_processes")
    if count != num_processes:
        return (
            f"process {pid} (on {address}) says --num-processes {count} but process 0 says {num_processes}; "
            f"every process must be given the same count"
        )
    if not isinstance(pid, int) or not 0 <= pid < num_processes:
        return f"a process (on {address}) says --process-id {pid!r}, outside [0, {num_processes})"
    if pid in seen or pid == 0:
        return (
            f"two processes say --process-id {pid} (on {seen.get(pid, 'this process')} and {address}); "
            f"each id must be unique in [0, {num_processes})"
        )
    if settings is not None and hello.get("digest") != settings_digest(settings):
        theirs = hello.get("settings") if isinstance(hello.get("settings"), dict) else {}
        key = _first_difference(settings, theirs)
        flag = "--" + key.replace("_", "-")
        return (
            f"process {pid} (on {address}) was given {flag} {_shown(theirs.get(key))} but process 0 {flag} "
            f"{_shown(settings.get(key))}; every process must be given the same run settings"
        )
    return None


def rendezvous_coordinator(
    port: int, num_processes: int, timeout_s: float, where: str, settings: dict | None = None
) -> None:
    """Process 0: wait for the other processes' hellos, check them, answer each."""
    deadline = time.monotonic() + timeout_s
    try:  # every address, IPv4 and IPv6, as JAX's own service binds [::]:port
        dual = socket.has_dualstack_ipv6()
        server = socket.create_server(
            ("", port),
            family=socket.AF_INET6 if dual else socket.AF_INET,
            dualstack_ipv6=dual,
            reuse_port=False,
            backlog=num_processes,
        )
    except OSError as e:
        raise MultiHostError(
            f"{where}: cannot listen on port {port} ({e.strerror}); is another process already "
            f"running with --process-id 0 (each id must be unique), or is the port taken?"
        ) from None
    conns, seen = [], {}  # every connection to answer; process id -> its address
    error = None
    try:
        while len(conns) < num_processes - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if error is None:
                    missing = sorted(set(range(1, num_processes)) - set(seen))
                    error = (
                        f"timed out after {timeout_s:g} s waiting for process(es) {missing} (started? the "
                        f"same --coordinator? raise --init-timeout if they start late)"
                    )
                break
            server.settimeout(remaining)
            try:
                conn, (address, *_) = server.accept()
            except TimeoutError:
                continue
            address = address.removeprefix("::ffff:")  # IPv4 through the dual-stack socket
            hello = _receive(conn, min(deadline, time.monotonic() + 10))
            if hello is None:  # not one of ours (a port scan, a stray client)
                conn.close()
                continue
            conns.append(conn)
            problem = _check_hello(hello, address, seen, num_processes, settings)
            if problem is None:
                seen[hello["process_id"]] = address
            elif error is None:
                error = problem
                deadline = min(deadline, time.monotonic() + LATE_GRACE_S)  # tell late-comers too
        for conn in conns:
            try:
                _send(conn, {"error": error} if error else {"ok": True})
                _receive(conn, time.monotonic() + 10)  # the peer closes first (no TIME_WAIT here)
            except OSError:
                pass
            conn.close()
    finally:
        server.close()
    if error:
        raise MultiHostError(f"{where}: {error}")


def rendezvous_peer(
    host: str,
    port: int,
    process_id: int,
    num_processes: int,
    timeout_s: float,
    where: str,
    settings: dict | None = None,
) -> None:
    """Process k > 0: reach process 0, say who this is, wait for its verdict."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise MultiHostError(
                f"{where}: could not reach the coordinator within {timeout_s:g} s ({last}); is "
                f"process 0 running and the address reachable? (raise --init-timeout if it "
                f"starts late)"
            )
        try:
            conn = socket.create_connection((host, port), timeout=min(remaining, 5))
        except OSError as e:
            last = e.strerror or str(e)
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))
            continue
        with conn:
            hello = {"process_id": process_id, "num_processes": num_processes}
            if settings is not None:
                hello.update(settings=settings, digest=settings_digest(settings))
            _send(conn, hello)
            answer = _receive(conn, deadline)
        if answer is None:
            raise MultiHostError(
                f"{where}: the coordinator did not confirm within {timeout_s:g} s (other processes "
                f"missing? process 0's message says which)"
            )
        if answer.get("error"):
            raise MultiHostError(f"{where}: {answer['error']}")
        return


def initialize(
    coordinator: str | None,
    num_processes: int | None,
    process_id: int | None,
    *,
    timeout_s: float = 300,
    cpu_devices: int | None = None,
    settings: dict | None = None,
) -> None:
    """Checks the set-up (see the module docstring), then `jax.distributed.initialize`.

    coordinator: "host:port" of process 0; num_processes: how many processes; process_id: this one's, in
    [0, num_processes). cpu_devices: local CPU devices per process (CPU-only runs; collectives over gloo).
    settings: the run's `shared_settings`, compared across the processes (None: not compared).
    Raises MultiHostError (a ValueError) with one line naming the coordinator and this process's id.
    """
    host, port = check_flags(coordinator, num_processes, process_id, timeout_s)
    if cpu_devices is not None:
        _check_cpu_devices(cpu_devices)
    where = f"coordinator {coordinator}, process {process_id} of {num_processes}"
    if num_processes > 1:
        if process_id == 0:
            rendezvous_coordinator(port, num_processes, timeout_s, where, settings)
        else:
            rendezvous_peer(host, port, process_id, num_processes, timeout_s, where, settings)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices across processes
    if cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=int(max(timeout_s, 1)))


def _check_cpu_devices(count: int | None) -> None:
    try:
        check_cpu_devices(count)
    except ValueError as e:
        raise MultiHostError(str(e)) from None


def detected_cluster(environ: Mapping[str, str] | None = None) -> str | None:
    """ "SLURM" or "Open MPI" when this process is one of several tasks launched by it (what
    `jax.distributed.initialize()` detects by itself), else None."""
    env = os.environ if environ is None else environ

    def count(name: str) -> int:
        try:
            return int(env.get(name, ""))
        except ValueError:
            return 0

    if env.get("SLURM_JOB_ID") and count("SLURM_NTASKS") > 1 and env.get("SLURM_PROCID") is not None:
        return "SLURM"
    if count("OMPI_COMM_WORLD_SIZE") > 1 and env.get("OMPI_COMM_WORLD_RANK") is not None:
        return "Open MPI"
    return None


def start_processes(
    cluster: ClusterSettings, settings: dict | None = None, *, log: Callable[[str], None] = print
) -> str | None:
    """Starts the run's processes from its cluster settings (`jaxring.run.schema.ClusterSettings`): with
    --coordinator / --num-processes / --process-id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
    JAX_PROCESS_ID) through `initialize`; else, inside a SLURM job or an Open MPI launch of several tasks,
    through `jax.distributed.initialize()`'s own cluster detection (then the settings' hashes are compared
    across processes). Returns how it started ("flags", "SLURM", "Open MPI") or None (one process)."""
    coordinator = cluster.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = cluster.num_processes if cluster.num_processes is not None else env_int("JAX_NUM_PROCESSES")
    process_id = cluster.process_id if cluster.process_id is not None else env_int("JAX_PROCESS_ID")
    if coordinator or num_processes is not None:
        initialize(
            coordinator,
            num_processes,
            process_id,
            timeout_s=cluster.init_timeout,
            cpu_devices=cluster.cpu_devices,
            settings=settings,
        )
        return "flags"
    kind = detected_cluster()
    if kind is None:
        return None
    check_flags("detected:1", 1, 0, cluster.init_timeout)  # the timeout's bound
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(initialization_timeout=int(max(cluster.init_timeout, 1)))
    except (RuntimeError, ValueError) as e:
        raise MultiHostError(f"{kind} start-up: {' '.join(str(e).split())[:300]}") from None
    if settings is not None:
        digest = np.frombuffer(bytes.fromhex(settings_digest(settings))[:8], np.int64)
        every = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1)
        if (every != every[0]).any():
            other = int(np.nonzero(every != every[0])[0][0])
            raise MultiHostError(
                f"{kind} job: process {other} was given other run settings than process 0; every process must "
                f"be given the same run settings"
            )
    log(f"{kind}: process {jax.process_index()} of {jax.process_count()} (found by jax.distributed)")
    return kind


# --------------------------------------------------------------------------------- agreement between processes


def is_primary() -> bool:
    return jax.process_index() == 0


def any_process(flag: bool) -> bool:
    """True when `flag` is set on any process (every process must call this at the same point)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.asarray(multihost_utils.process_allgather(np.int32(bool(flag)))).max())


def all_processes_agree(flag: bool) -> bool:
    """True when `flag` is set on every process (every process must call this at the same point)."""
    return not any_process(not flag)


def sync_processes(name: str) -> None:
    """A barrier across processes (nothing on one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
