"""`jmsnas` commands as groups of processes on 127.0.0.1 (JAX's multi-process runtime), for the tests that kill,
resume and compare them: a free port, a group started together, and a group awaited with every failure's stderr."""
import os
import socket
import subprocess
import sys

from paths import REPO
TIMEOUT = 600  # seconds any one process of a test may take


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(cache_dir, fast_compile: bool = False) -> dict:
    """The processes' environment: this checkout's jmsnas on the CPU, a persistent compile cache in ``cache_dir``
    shared by the test's runs (every compile cached), no inherited XLA flags. ``fast_compile``: XLA's optimisation
    passes off (JAX_DISABLE_MOST_OPTIMIZATIONS) for runs that spend most of their time compiling, compared only
    with runs of the same environment (a tiny SplitNets evolve: 47.6 -> 29.5 s CPU, its steps no slower; the
    chain's evolve on the "xla" depthwise path is not one of them: its steps then take 5.5 times as long)."""
    e = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, XLA_FLAGS="")
    if fast_compile:
        e["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    e["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    e["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return e


def start(environ: dict, cmd: str, config: str, workdir, *extra, n: int = 1) -> list:
    """``jmsnas CMD --config CONFIG --workdir WORKDIR --no-progress EXTRA`` as ``n`` processes of one run (one
    process, without the multi-process flags, when ``n`` is 1)."""
    port = free_port()
    group = []
    for i in range(n):
        flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(i)] \
            if n > 1 else []
        group.append(subprocess.Popen([sys.executable, "-m", "jmsnas.cli", cmd, "--config", str(config),
                                       "--workdir", str(workdir), "--no-progress", *flags, *extra], env=environ,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return group


def finish(group) -> list:
    """Wait for every process of ``group``; assert each exited 0, naming every one that did not with its stderr.
    Returns the (stdout, stderr) of each."""
    outs = [p.communicate(timeout=TIMEOUT) for p in group]
    bad = [f"process {i} exit {p.returncode}: {err[-3000:]}" for i, (p, (out, err)) in enumerate(zip(group, outs))
           if p.returncode != 0]
    assert not bad, "\n".join(bad)
    return outs


def stop(procs) -> None:
    """Kill whatever of ``procs`` still runs (a test's cleanup: no process left behind)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
