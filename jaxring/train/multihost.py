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
"""

from __future__ import annotations

import json
import os
import socket
import time

import numpy as np


class MultiHostError(ValueError):
    """The multi-host set-up is wrong (bad flags, unreachable coordinator, missing or duplicate process)."""


def env_int(name: str):
    """An integer environment variable, or None when unset; MultiHostError naming it when malformed."""
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise MultiHostError(f"environment variable {name}={value!r} must be an integer") from None


def check_flags(coordinator, num_processes, process_id, timeout_s) -> tuple[str, int]:
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
    if not isinstance(timeout_s, (int, float)) or not np.isfinite(timeout_s) or timeout_s <= 0:
        raise MultiHostError(f"--init-timeout {timeout_s!r} must be a positive number of seconds")
    host, sep, port = str(coordinator).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MultiHostError(f"--coordinator {coordinator!r} must be HOST:PORT with a port in [1, 65535]")
    return host.strip("[]"), int(port)


def _send(conn, message: dict) -> None:
    conn.sendall((json.dumps(message) + "\n").encode())


def _receive(conn, deadline: float) -> dict | None:
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


def _check_hello(hello: dict, address: str, seen: dict, num_processes: int) -> str | None:
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
    return None


def _rendezvous_coordinator(port: int, num_processes: int, timeout_s: float, where: str) -> None:
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
            problem = _check_hello(hello, address, seen, num_processes)
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


def _rendezvous_peer(host: str, port: int, process_id: int, num_processes: int, timeout_s: float, where: str) -> None:
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
            _send(conn, {"process_id": process_id, "num_processes": num_processes})
            answer = _receive(conn, deadline)
        if answer is None:
            raise MultiHostError(
                f"{where}: the coordinator did not confirm within {timeout_s:g} s (other processes "
                f"missing? process 0's message says which)"
            )
        if answer.get("error"):
            raise MultiHostError(f"{where}: {answer['error']}")
        return


def initialize(coordinator, num_processes, process_id, *, timeout_s: float = 300, cpu_devices: int | None = None):
    """Checks the set-up (see the module docstring), then `jax.distributed.initialize`.

    coordinator: "host:port" of process 0; num_processes: how many processes; process_id: this one's, in
    [0, num_processes). cpu_devices: local CPU devices per process (CPU-only runs; collectives over gloo).
    Raises MultiHostError (a ValueError) with one line naming the coordinator and this process's id.
    """
    host, port = check_flags(coordinator, num_processes, process_id, timeout_s)
    where = f"coordinator {coordinator}, process {process_id} of {num_processes}"
    if num_processes > 1:
        if process_id == 0:
            _rendezvous_coordinator(port, num_processes, timeout_s, where)
        else:
            _rendezvous_peer(host, port, process_id, num_processes, timeout_s, where)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices across processes
    if cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=int(max(timeout_s, 1)))


# --------------------------------------------------------------------------------- agreement between processes


def is_primary() -> bool:
    import jax

    return jax.process_index() == 0


def any_process(flag: bool) -> bool:
    """True when `flag` is set on any process (every process must call this at the same point)."""
    import jax

    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.int32(bool(flag)))).max())


def all_processes_agree(flag: bool) -> bool:
    """True when `flag` is set on every process (every process must call this at the same point)."""
    return not any_process(not flag)


def sync_processes(name: str) -> None:
    """A barrier across processes (nothing on one process)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
