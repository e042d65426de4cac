"""Running one job as several processes: ``--coordinator HOST:PORT --num-processes N --process-id I``.

Every command that trains (search, retrain, evolve) accepts the three flags; the processes run the same program,
``jax.distributed.initialize`` joins them (CPU collectives through gloo, so it works on CPU-only hosts and on one
machine), the steps run under one mesh over all processes' devices, and each process places its slice of every
global batch (``train.shard_batch``). Process 0 writes the outputs (result.json, plots, parts, config.json);
checkpoints are saved by all processes together through orbax, which commits them once. Where a cluster's
environment already describes the job (SLURM, Cloud TPU, ...), ``--num-processes`` alone (or nothing, with
``JMSNAS_DISTRIBUTED=1``) lets JAX detect the rest.

A process that stops makes the others stop too: JAX's coordination service notices the missing heartbeat within
``heartbeat_timeout_s`` and ends the job, and a collective that loses its peer fails; either way the survivors
exit with one line instead of waiting forever.
"""
from __future__ import annotations

import contextlib
import json
import os
import time

HEARTBEAT_TIMEOUT_S = 20  # how long the coordination service waits for a silent process before ending the job
INIT_TIMEOUT_S = 120  # how long the processes wait for each other at start
_ACTIVE = False  # set once this process has joined a multi-process run


class DistributedError(ValueError):
    """Bad multi-process flags, or a run whose processes could not join or lost one of them."""


def _count(low, high):
    from jmsnas.runcheck import number_flag
    return number_flag(int, low, high)


def add_flags(parser) -> None:
    """The multi-process flags of every command that trains."""
    g = parser.add_argument_group("multi-process (see jmsnas/distributed.py)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="address of process 0's coordination service (every process gives the same)")
    g.add_argument("--num-processes", type=_count(1, 4096), default=None, metavar="N", help="number of processes of the run")
    g.add_argument("--process-id", type=_count(0, 4095), default=None, metavar="I", help="this process, 0 .. N-1")


def check_flags(coordinator, num_processes, process_id) -> bool:
    """Validates the flags (DistributedError naming the bad one); True when a multi-process run is asked for."""
    given = [v is not None for v in (coordinator, num_processes, process_id)]
    if not any(given):
        return os.environ.get("JMSNAS_DISTRIBUTED") == "1"
    if num_processes is None or num_processes < 1:
        raise DistributedError(f"--num-processes must be a positive integer, got {num_processes!r}")
    if coordinator is not None:
        host, sep, port = str(coordinator).rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise DistributedError(f"--coordinator must be HOST:PORT with a port in 1..65535, got {coordinator!r}")
        if process_id is None:
            raise DistributedError("--coordinator needs --process-id (0 .. N-1) on every process")
    if process_id is not None and not 0 <= process_id < num_processes:
        raise DistributedError(f"--process-id must be in 0..{num_processes - 1} (--num-processes {num_processes}), "
                               f"got {process_id}")
    return True


def join_timeout_s() -> float:
    """Seconds the processes wait for each other at start (``JMSNAS_JOIN_TIMEOUT_S``, default INIT_TIMEOUT_S)."""
    raw = os.environ.get("JMSNAS_JOIN_TIMEOUT_S", "")
    try:
        v = float(raw) if raw else float(INIT_TIMEOUT_S)
    except ValueError:
        v = -1.0
    if not 0 < v <= 86400:
        raise DistributedError(f"JMSNAS_JOIN_TIMEOUT_S must be a number of seconds in (0, 86400], got {raw!r}")
    return v


def _send(sock, obj) -> None:
    sock.sendall((json.dumps(obj) + "\n").encode())


def _recv(sock, deadline: float):
    """One JSON line from ``sock`` before ``deadline`` (time.monotonic), or None."""
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        sock.settimeout(left)
        try:
            chunk = sock.recv(4096)
        except OSError:
            return None
        if not chunk or len(buf) > 65536:
            return None
        buf += chunk
    try:
        return json.loads(buf.split(b"\n", 1)[0])
    except ValueError:
        return None


def rendezvous(coordinator: str, num_processes: int, process_id: int, fingerprint: str, timeout_s: float) -> None:
    """Every process meets process 0 at ``coordinator`` over plain TCP before JAX's runtime is started, because
    JAX's client aborts the interpreter (a C++ fatal error) when its peers do not come. Process 0 binds the port
    (a busy port is refused at once), waits up to ``timeout_s`` for the N-1 others, compares their configuration
    ``fingerprint`` with its own and answers each "go" or the reason to stop; every process raises
    DistributedError (one line) when the run cannot start: a peer that never joins, no process 0, a busy port,
    a process id given twice, or processes given different configurations."""
    import socket
    host, _, port = coordinator.rpartition(":")
    host, port = host.strip("[]"), int(port)
    deadline = time.monotonic() + timeout_s
    me = {"id": process_id, "fingerprint": fingerprint}
    if process_id == 0:
        srv = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            srv.bind((host, port))
            srv.listen(num_processes)
        except OSError as e:
            srv.close()
            raise DistributedError(f"process 0 cannot listen on --coordinator {coordinator}: "
                                   f"{e.strerror or e} (is another run using that port? choose another)") from None
        peers, problem = {}, None
        try:
            while len(peers) < num_processes - 1 and problem is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, num_processes)) - set(peers))
                    problem = (f"process(es) {missing} did not join within {timeout_s:g} s "
                               f"(start every process with the same --coordinator {coordinator})")
                    break
                srv.settimeout(left)
                try:
                    conn, _ = srv.accept()
                except socket.timeout:
                    continue
                hello = _recv(conn, deadline)
                if not isinstance(hello, dict) or not isinstance(hello.get("id"), int):
                    conn.close()  # not one of ours (a port scanner, a stale client): ignore it
                    continue
                if hello["id"] in peers or not 0 < hello["id"] < num_processes:
                    problem = f"process id {hello['id']} was given to two processes (or is out of range)"
                elif hello.get("fingerprint") != fingerprint:
                    problem = (f"process {hello['id']} was started with another configuration than process 0 "
                               f"(fingerprint {str(hello.get('fingerprint'))[:12]} vs {fingerprint[:12]}): give every "
                               "process the same command, config file and overrides")
                peers[hello["id"]] = conn
            for conn in peers.values():
                with contextlib.suppress(OSError):
                    _send(conn, {"go": problem is None, "problem": problem})
            for conn in peers.values():  # the peer closes first, so the port is free again for JAX at once
                _recv(conn, time.monotonic() + 5)
                conn.close()
        finally:
            srv.close()
        if problem:
            raise DistributedError(f"process 0: the run cannot start: {problem}")
        return
    answer = None
    while answer is None:
        try:
            conn = socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic())))
        except OSError:
            if time.monotonic() >= deadline:
                raise DistributedError(f"process {process_id}: nobody answered at --coordinator {coordinator} "
                                       f"within {timeout_s:g} s (is process 0 running, with the same "
                                       "--coordinator?)") from None
            time.sleep(0.2)
            continue
        with conn:
            _send(conn, me)
            answer = _recv(conn, deadline + 5)
        if answer is None:
            raise DistributedError(f"process {process_id}: process 0 at {coordinator} did not answer within "
                                   f"{timeout_s:g} s")
    if not answer.get("go"):
        raise DistributedError(f"process {process_id}: the run cannot start: {answer.get('problem')}")


def initialize(coordinator=None, num_processes=None, process_id=None, fingerprint: str = "") -> bool:
    """Joins the processes (before any other JAX call); returns True for a multi-process run. With a
    ``coordinator``, the processes first meet in :func:`rendezvous` (a peer that never comes, a busy port or
    another configuration ends every process with one line, never an abort)."""
    if not check_flags(coordinator, num_processes, process_id):
        return False
    if coordinator is not None and num_processes > 1:
        rendezvous(coordinator, num_processes, process_id, fingerprint, join_timeout_s())
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=int(max(10, join_timeout_s())),
                                   heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - JAX raises XlaRuntimeError / RuntimeError / ValueError here
        first = " ".join(str(e).split())[:300]
        raise DistributedError(f"process {process_id} could not join the run at {coordinator} "
                               f"({num_processes} processes): {first}") from None
    global _ACTIVE
    _ACTIVE = True
    return True


def leave(code: int) -> int:
    """``code`` for the caller to return, except in a multi-process run that failed: there the process flushes its
    output and exits at once, because JAX's exit handler would wait at the coordination service's shutdown
    barrier for a process that may be gone and then abort the interpreter with a page of C++ log lines."""
    if _ACTIVE and code != 0:
        import sys
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def is_writer() -> bool:
    """Whether this process writes the run's files (process 0; the only process of a single-process run)."""
    import jax
    return jax.process_index() == 0


_COLLECTIVE_FAILURES = ("gloo", "connection reset", "connection refused", "broken pipe", "heartbeat",
                        "coordination service")


def collective_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective or the coordination service failing because a peer went away (it may reach us
    as JAX's runtime error or wrapped in another error type by the code that ran the collective)."""
    import jax
    if jax.process_count() == 1:
        return False
    if type(e).__name__ in ("XlaRuntimeError", "JaxRuntimeError"):
        return True
    text = str(e).lower()
    return any(k in text for k in _COLLECTIVE_FAILURES)


def lost_peer_message(e: BaseException) -> str | None:
    """One line for an error a collective raises when another process of the run stopped, else None."""
    import jax
    if jax.process_count() == 1:
        return None
    text = " ".join(str(e).split())
    return (f"process {jax.process_index()} of {jax.process_count()}: the run lost another process "
            f"({type(e).__name__}: {text[:200]}); the checkpoints are kept: restart every process with --resume")
