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

import os

HEARTBEAT_TIMEOUT_S = 20  # how long the coordination service waits for a silent process before ending the job
INIT_TIMEOUT_S = 120  # how long the processes wait for each other at start
_ACTIVE = False  # set once this process has joined a multi-process run


class DistributedError(ValueError):
    """Bad multi-process flags, or a run whose processes could not join or lost one of them."""


def add_flags(parser) -> None:
    """The multi-process flags of every command that trains."""
    g = parser.add_argument_group("multi-process (see jmsnas/distributed.py)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="address of process 0's coordination service (every process gives the same)")
    g.add_argument("--num-processes", type=int, default=None, metavar="N", help="number of processes of the run")
    g.add_argument("--process-id", type=int, default=None, metavar="I", help="this process, 0 .. N-1")


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


def initialize(coordinator=None, num_processes=None, process_id=None) -> bool:
    """Joins the processes (before any other JAX call); returns True for a multi-process run."""
    if not check_flags(coordinator, num_processes, process_id):
        return False
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=INIT_TIMEOUT_S,
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
