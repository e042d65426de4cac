"""jmsnas.hostmem: glibc keeps XLA's per-step blocks instead of faulting them in afresh every call."""
import os
import subprocess
import sys

import pytest

from jmsnas import hostmem

# A jitted step whose temporaries (128 MB: the loop's carried buffers, in XLA's temporary block) are far above
# glibc's largest mmap threshold (32 MB), as the supernet steps' are; prints the median of minor page faults per
# call after warm-up and the pages of x. The body only reverses and scales (no transcendental): the faults come
# from the buffers, not the arithmetic (the same counts as with a sin in the body, 5 probes in 25 s instead of 39 s). Warm-up is 25 calls: with the heap kept, two threads' frees interleave differently from run to run
# and the heap went on growing for up to 16 calls (measured, two probes at once) before no call faulted.
_PROBE = """
import resource, statistics
import jmsnas.hostmem
jmsnas.hostmem.apply()
import jax, jax.numpy as jnp
n = 16 * 1024 * 1024
f = jax.jit(lambda x: jnp.sum(jax.lax.fori_loop(0, 3, lambda i, a: a[::-1] * 1.5, x)))
x = jnp.arange(n, dtype=jnp.float32)
for _ in range(25):
    f(x).block_until_ready()
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(statistics.median(faults), n * 4 // 4096)
"""


def _faults_per_call(setting, call: bool = False) -> tuple:
    """(median faults per call, pages of x) in a fresh process with JMSNAS_KEEP_FREED_MEMORY=setting (None: unset)
    that calls hostmem.apply() before JAX's first array (what the jmsnas command does first), or
    hostmem.keep_freed_memory() instead if ``call``."""
    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    env.pop(hostmem.ENV, None)
    if setting is not None:
        env[hostmem.ENV] = setting
    code = _PROBE.replace("jmsnas.hostmem.apply()\n", "jmsnas.hostmem.keep_freed_memory()\n") if call else _PROBE
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    faults, pages = out.stdout.split()
    return float(faults), int(pages)


@pytest.mark.slow
@pytest.mark.skipif(hostmem._glibc() is None, reason="glibc malloc settings only")
def test_kept_memory_is_not_faulted_in_again():
    # JMSNAS_KEEP_FREED_MEMORY=0 (glibc and JAX's dispatch left alone): every call maps its temporaries afresh,
    # at least one fault per page of x's size
    fresh, pages = _faults_per_call("0")
    assert fresh >= pages, (fresh, pages)
    # the default (steps on the calling thread's untrimmed heap), the full setting at import or by a call before
    # the first array: the blocks come back from the heap, almost no faults
    for setting, call in ((None, False), ("1", False), (None, True)):
        kept, _ = _faults_per_call(setting, call)
        assert kept < pages / 20, (setting, call, kept, pages)
    # JMSNAS_KEEP_FREED_MEMORY=0 rules out the call too
    assert _faults_per_call("0", True)[0] >= pages


# The command's first act (jmsnas.cli.main -> hostmem.apply) sets the dispatch, whatever the sub-command; "latency
# --help" exits inside argparse after it
_COMMAND = """
import jax, jmsnas.cli
try:
    jmsnas.cli.main(["latency", "--help"])
except SystemExit:
    pass
print(jax.config.read("jax_cpu_enable_async_dispatch"), jmsnas.hostmem.keep_step_memory())
"""


def _run(code, env) -> str:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.slow
@pytest.mark.skipif(hostmem._glibc() is None, reason="glibc malloc settings only")
def test_command_default_is_synchronous_dispatch_and_a_kept_heap():
    env = {k: v for k, v in os.environ.items() if k not in (hostmem.ENV, "GLIBC_TUNABLES")}
    assert _run(_COMMAND, env).splitlines()[-1] == "False {'dispatch': True, 'heap': True}"
    assert _run(_COMMAND, dict(env, **{hostmem.ENV: "0"})).splitlines()[-1] == \
        "True {'dispatch': False, 'heap': False}"


# Importing the library (every module of it) sets nothing. The oracle for "no mallopt call": a 64 MiB block (above
# glibc's largest mmap threshold) freed and allocated again is mapped afresh, one fault per page, unless mallopt
# told glibc to keep it (M_MMAP_MAX=0, M_TRIM_THRESHOLD=-1: then ~0 faults) -- checked both ways
_IMPORT = """
import ctypes, importlib, pkgutil, resource, sys
import jax, jmsnas
for m in pkgutil.walk_packages(jmsnas.__path__, "jmsnas."):
    if m.name != "jmsnas.cli" or "--with-cli" in sys.argv:
        importlib.import_module(m.name)
if "--apply" in sys.argv:
    jmsnas.hostmem.apply()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
n = 64 << 20
def touch():
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    libc.free(p)
touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(jax.config.read("jax_cpu_enable_async_dispatch"), faults >= n // 4096, faults)
"""


@pytest.mark.slow
@pytest.mark.skipif(hostmem._glibc() is None, reason="glibc malloc settings only")
def test_import_changes_nothing_global():
    env = {k: v for k, v in os.environ.items() if k not in (hostmem.ENV, "GLIBC_TUNABLES")}
    default = _run("import jax; print(jax.config.read('jax_cpu_enable_async_dispatch'))", env)
    imported = _run(_IMPORT, env).split()
    assert imported[:2] == [default, "True"], imported  # JAX's default dispatch; the block faulted in afresh
    applied = subprocess.run([sys.executable, "-c", _IMPORT, "--with-cli", "--apply"], env=env, capture_output=True,
                             text=True, check=True).stdout.split()
    assert applied[:2] == ["False", "False"], applied  # the command's settings: synchronous, block kept


def test_environment_value_is_checked(monkeypatch):
    monkeypatch.setenv(hostmem.ENV, "yes")
    with pytest.raises(ValueError, match=r"JMSNAS_KEEP_FREED_MEMORY must be 0 .* got 'yes'"):
        hostmem.requested()
    with pytest.raises(ValueError, match="got 'yes'"):
        hostmem.forbidden()
    monkeypatch.setenv(hostmem.ENV, "1")
    assert hostmem.requested() is True and hostmem.forbidden() is False
    monkeypatch.setenv(hostmem.ENV, "0")
    assert hostmem.requested() is False and hostmem.forbidden() is True
    monkeypatch.delenv(hostmem.ENV)
    assert hostmem.requested() is False and hostmem.forbidden() is False  # unset: the default, keep_step_memory


@pytest.mark.slow
@pytest.mark.skipif(hostmem._glibc() is None, reason="glibc malloc settings only")
def test_late_call_warns():
    code = "import jax.numpy as jnp; jnp.ones(2).block_until_ready(); import jmsnas.hostmem; jmsnas.hostmem.apply()"
    env = dict(os.environ, JMSNAS_KEEP_FREED_MEMORY="1", PYTHONWARNINGS="error::RuntimeWarning")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "ran after JAX created its backends" in out.stderr
    env[hostmem.ENV] = "0"
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).returncode == 0
