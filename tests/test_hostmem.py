"""jmsnas.hostmem: glibc keeps XLA's per-step blocks instead of faulting them in afresh every call."""
import os
import subprocess
import sys

import pytest

from jmsnas import hostmem

# A jitted step whose temporaries (128 MB: the loop's carried buffers, in XLA's temporary block) are far above
# glibc's largest mmap threshold (32 MB), as the supernet steps' are; prints the median of minor page faults per
# call after warm-up and the pages of x. Warm-up is 25 calls: with the heap kept, two threads' frees interleave differently from run to run
# and the heap went on growing for up to 16 calls (measured, two probes at once) before no call faulted.
_PROBE = """
import resource, statistics
import jmsnas
import jax, jax.numpy as jnp
n = 16 * 1024 * 1024
f = jax.jit(lambda x: jnp.sum(jax.lax.fori_loop(0, 3, lambda i, a: jnp.sin(a)[::-1] * 1.5, x)))
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
    """(median faults per call, pages of x) in a fresh process with JMSNAS_KEEP_FREED_MEMORY=setting (None: unset),
    calling hostmem.keep_freed_memory() before JAX's first array if ``call``."""
    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    env.pop(hostmem.ENV, None)
    if setting is not None:
        env[hostmem.ENV] = setting
    code = _PROBE.replace("import jmsnas\n", "import jmsnas\njmsnas.hostmem.keep_freed_memory()\n") if call else _PROBE
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    faults, pages = out.stdout.split()
    return float(faults), int(pages)


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


_DEFAULT = """
import jax, jmsnas
print(jax.config.read("jax_cpu_enable_async_dispatch"), jmsnas.hostmem.keep_step_memory())
"""


@pytest.mark.skipif(hostmem._glibc() is None, reason="glibc malloc settings only")
def test_default_is_synchronous_dispatch_and_a_kept_heap():
    env = {k: v for k, v in os.environ.items() if k not in (hostmem.ENV, "GLIBC_TUNABLES")}
    run = lambda e: subprocess.run([sys.executable, "-c", _DEFAULT], env=e, capture_output=True, text=True,
                                   check=True).stdout.strip()
    assert run(env) == "False {'dispatch': True, 'heap': True}"
    assert run(dict(env, **{hostmem.ENV: "0"})) == "True {'dispatch': False, 'heap': False}"


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


@pytest.mark.skipif(hostmem._glibc() is None, reason="glibc malloc settings only")
def test_late_import_warns():
    code = "import jax.numpy as jnp; jnp.ones(2).block_until_ready(); import jmsnas"
    env = dict(os.environ, JMSNAS_KEEP_FREED_MEMORY="1", PYTHONWARNINGS="error::RuntimeWarning")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "ran after JAX created its backends" in out.stderr
    env[hostmem.ENV] = "0"
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).returncode == 0
