"""jmsnas.programs: traced programs kept across runs (content hashes, hits without tracing, same numbers, fallbacks)."""
import dataclasses
import json
import os
import subprocess
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas import cache, programs, timing


class State(NamedTuple):
    w: jnp.ndarray
    n: jnp.ndarray


@dataclasses.dataclass(frozen=True)
class Spec:
    width: int
    scale: float
    names: tuple


@pytest.fixture
def program_cache(tmp_path, monkeypatch):
    """Programs and executables under tmp_path for this test; JAX's cache setting restored afterwards."""
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path / "root"))
    monkeypatch.delenv(cache.ENV_SWITCH, raising=False)
    before = jax.config.jax_compilation_cache_dir
    assert cache.enable_compilation_cache(tmp_path / "root" / "xla") is not None
    yield tmp_path / "root" / "programs"
    if before:
        cache.enable_compilation_cache(before)
    else:
        cache.disable_compilation_cache()


def _step_factory(traces: list):
    """A fresh Python function (so no in-memory trace is shared) that counts its traces: (state, x) -> (state, m)."""
    def step(st: State, x):
        traces.append(1)
        w = st.w - 0.1 * x.T @ jnp.tanh(x @ st.w)
        return State(w, st.n + 1), {"loss": jnp.sum(w * w), "mean": jnp.mean(x)}
    return step


def _state():
    return State(jnp.asarray(np.random.default_rng(0).normal(size=(8, 8)), jnp.float32), jnp.zeros((), jnp.int32))


def _x():
    return jnp.asarray(np.random.default_rng(1).normal(size=(4, 8)), jnp.float32)


def _bits(tree):
    return [np.asarray(a).tobytes() for a in jax.tree_util.tree_leaves(tree)]


def test_digest_is_a_content_hash():
    a = Spec(3, 0.5, ("x", "y"))
    assert programs.digest(a) == programs.digest(Spec(3, 0.5, ("x", "y")))
    assert programs.digest(a) != programs.digest(Spec(3, 0.5000001, ("x", "y")))
    assert programs.digest(a) != programs.digest(Spec(3, 0.5, ("x", "z")))
    assert programs.digest((1, 2)) != programs.digest([1, 2]) != programs.digest((1.0, 2))
    arr = np.arange(6, dtype=np.float32)
    assert programs.digest(arr) == programs.digest(jnp.asarray(arr))
    assert programs.digest(arr) != programs.digest(arr.reshape(2, 3))  # same bytes, other shape
    assert programs.digest(arr) != programs.digest(arr.astype(np.int32))
    assert programs.digest({"b": 1, "a": 2}) == programs.digest({"a": 2, "b": 1})
    assert programs.digest(State(1, 2)) != programs.digest((1, 2))
    with pytest.raises(TypeError, match="no content hash for a builtins.function"):
        programs.digest((1, lambda x: x))


def test_a_second_wrapper_loads_the_program_without_tracing_and_gives_the_same_bits(program_cache):
    traces = []
    jitted = jax.jit(_step_factory(traces), donate_argnums=0)
    first = programs.persistent_jit(jitted, name="test.step", identity=Spec(8, 0.1, ()), donate_argnums=0)
    st, m1 = first(_state(), _x())
    st, m2 = first(st, _x())  # the same signature: no new trace
    assert len(traces) == 1
    stored = list(program_cache.glob("test.step-*.jaxprog"))
    assert len(stored) == 1

    plain = jax.jit(_step_factory([]))  # what jax.jit alone computes
    ref_st, ref_m1 = plain(_state(), _x())
    assert _bits((st, m2)) == _bits(plain(ref_st, _x())) and _bits(m1) == _bits(ref_m1)

    # a new wrapper (as in the next run) of a new function object: loads the program, traces nothing
    traces_again = []
    second = programs.persistent_jit(jax.jit(_step_factory(traces_again), donate_argnums=0), name="test.step",
                                     identity=Spec(8, 0.1, ()), donate_argnums=0)
    s0 = _state()
    st2, m = second(s0, _x())
    assert traces_again == []
    assert isinstance(st2, State) and set(m) == {"loss", "mean"}  # the output tree, NamedTuple included
    assert _bits((st2, m)) == _bits((ref_st, ref_m1))
    assert s0.w.is_deleted()  # the state is still donated
    assert list(program_cache.glob("*.jaxprog")) == stored


def test_other_identity_or_shape_is_another_program(program_cache):
    for identity, rows in ((Spec(8, 0.1, ()), 4), (Spec(8, 0.2, ()), 4), (Spec(8, 0.1, ()), 5)):
        traces = []
        f = programs.persistent_jit(jax.jit(_step_factory(traces)), name="test.other", identity=identity)
        f(_state(), jnp.ones((rows, 8), jnp.float32))
        assert traces == [1]
    assert len(list(program_cache.glob("test.other-*.jaxprog"))) == 3
    # one wrapper called with two shapes: one program each, the right one for each call
    traces = []
    f = programs.persistent_jit(jax.jit(_step_factory(traces)), name="test.two", identity=0)
    plain = jax.jit(_step_factory([]))
    for rows in (4, 5, 4, 5):
        x = jnp.ones((rows, 8), jnp.float32)
        assert _bits(f(_state(), x)) == _bits(plain(_state(), x))
    assert len(traces) == 2 and len(list(program_cache.glob("test.two-*.jaxprog"))) == 2


def test_a_damaged_entry_is_replaced(program_cache):
    f = programs.persistent_jit(jax.jit(_step_factory([])), name="test.damaged", identity=1)
    expected = _bits(f(_state(), _x()))
    (path,) = program_cache.glob("test.damaged-*.jaxprog")
    path.write_bytes(b"not a program")
    traces = []
    g = programs.persistent_jit(jax.jit(_step_factory(traces)), name="test.damaged", identity=1)
    assert _bits(g(_state(), _x())) == expected and traces == [1]
    assert path.read_bytes() != b"not a program"
    traces = []
    h = programs.persistent_jit(jax.jit(_step_factory(traces)), name="test.damaged", identity=1)
    assert _bits(h(_state(), _x())) == expected and traces == []  # the replacement loads


def test_plain_jit_where_no_program_can_be_kept(program_cache, monkeypatch):
    # an identity without a content hash
    f = programs.persistent_jit(jax.jit(_step_factory([])), name="test.closure", identity=lambda: 0)
    f(_state(), _x())
    # a host callback, which jax.export refuses
    def with_callback(x):
        return jax.pure_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    g = programs.persistent_jit(jax.jit(with_callback), name="test.callback", identity=0)
    np.testing.assert_array_equal(g(jnp.arange(3.0)), [0.0, 2.0, 4.0])
    assert not list(program_cache.glob("*.jaxprog"))
    # the compilation cache switched off
    monkeypatch.setenv(cache.ENV_SWITCH, "0")
    traces = []
    h = programs.persistent_jit(jax.jit(_step_factory(traces)), name="test.off", identity=0)
    h(_state(), _x())
    assert traces == [1] and not list(program_cache.glob("*.jaxprog")) and not programs.enabled()


def test_loading_counts_as_compiling(program_cache):
    programs.persistent_jit(jax.jit(_step_factory([])), name="test.timed", identity=0)(_state(), _x())
    f = programs.persistent_jit(jax.jit(_step_factory([])), name="test.timed", identity=0)
    with timing.measure() as t:
        f(_state(), _x())
        s = t.summary()
    assert s["compile"]["wall_s"] > 0 and s["cache_hits"] >= 1 and s["cache_misses"] == 0


def test_the_folder_is_bounded_least_recently_used_first(tmp_path):
    for i, name in enumerate(("old", "mid", "new")):
        p = tmp_path / f"{name}{programs.SUFFIX}"
        p.write_bytes(b"x" * 100)
        os.utime(p, (1000 + i, 1000 + i))
    programs._bound(tmp_path, keep=tmp_path / f"new{programs.SUFFIX}", limit=250)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"mid{programs.SUFFIX}", f"new{programs.SUFFIX}"]
    programs._bound(tmp_path, keep=tmp_path / f"mid{programs.SUFFIX}", limit=50)  # the one just written stays
    assert [p.name for p in tmp_path.iterdir()] == [f"mid{programs.SUFFIX}"]


def test_bad_name_is_refused():
    with pytest.raises(ValueError, match=r"name must be a non-empty file-name-safe string, got '../x'"):
        programs.persistent_jit(jax.jit(lambda x: x), name="../x", identity=0)


# One process: a step whose program depends on argv[1]; prints how often it was traced, a result and the timer.
_PROBE = """
import json, sys
from jmsnas import cache, programs, timing
cache.enable_compilation_cache()
import jax, jax.numpy as jnp
traces = []
def step(x):
    traces.append(1)
    return jnp.sum(jnp.tanh(x @ x.T) * float(sys.argv[1]))
f = programs.persistent_jit(jax.jit(step), name="probe.step", identity=sys.argv[1])
with timing.measure() as t:
    y = float(f(jnp.arange(64.0).reshape(8, 8) / 64))
print(json.dumps({"y": y, "traces": len(traces), "time": t.summary()}))
"""


def _run_probe(tmp_path, arg):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(JMSNAS_CACHE_DIR=str(tmp_path / "root"), JAX_PLATFORMS="cpu")
    env.pop(cache.ENV_SWITCH, None)
    out = subprocess.run([sys.executable, "-c", _PROBE, arg], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_next_process_skips_the_trace(tmp_path):
    first, second = _run_probe(tmp_path, "3"), _run_probe(tmp_path, "3")
    assert first["traces"] == 1 and second["traces"] == 0
    assert second["y"] == first["y"]
    assert second["time"]["cache_hits"] >= 1 and second["time"]["cache_misses"] == 0
    other = _run_probe(tmp_path, "4")  # another identity: traced and stored anew
    assert other["traces"] == 1 and other["y"] != first["y"]
    assert len(list((tmp_path / "root" / "programs").glob("probe.step-*.jaxprog"))) == 2


def test_environment_digest_follows_options_and_variables(monkeypatch):
    before = programs.environment_digest()
    assert programs.environment_digest() == before
    monkeypatch.setenv("JMSNAS_SOMETHING_NEW", "1")
    assert programs.environment_digest() != before
    monkeypatch.delenv("JMSNAS_SOMETHING_NEW")
    monkeypatch.setenv(cache.ENV_DIR, "/elsewhere")  # where things are kept does not change a program
    assert programs.environment_digest() == before
    with jax.default_matmul_precision("highest"):
        assert programs.environment_digest() != before
