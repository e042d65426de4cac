"""jmsnas.ahead: steps compiled ahead in threads are what their first call runs (no second trace or compile, the
same bits); failures fall back to the first call; speculation waits only for its own key; the main job's steps
all compile ahead and give the same result as compiling at their first call."""
import threading
import time
from typing import NamedTuple

import jax
import jax.monitoring as monitoring
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas import ahead as A
from jmsnas import cache, configs, pipeline, programs, train
from jmsnas.space import build_space
from jmsnas.topology import presets


class State(NamedTuple):
    w: jnp.ndarray
    n: jnp.ndarray


class Compiles:
    """Backend compilations seen while active: (function name, thread name)."""

    def __init__(self):
        self.seen = []

    def _on(self, event, duration, **kw):
        if event.endswith("backend_compile_duration"):
            self.seen.append((kw.get("fun_name"), threading.current_thread().name))

    def __enter__(self):
        monitoring.register_event_duration_secs_listener(self._on)
        return self

    def __exit__(self, *exc):
        monitoring.unregister_event_duration_listener(self._on)


def _step(traces):
    def step(st, x):
        traces.append(1)
        w = st.w - 0.1 * x.T @ jnp.tanh(x @ st.w)
        return State(w, st.n + 1), jnp.sum(w * w)
    return step


def _args():
    """(state, x) placed as a run places them (committed to the mesh: what the ahead compilation is told)."""
    mesh = train.data_mesh()
    st = State(np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32), np.zeros((), np.int32))
    return (train.replicate(st, mesh),
            train.replicate(np.random.default_rng(1).normal(size=(4, 8)).astype(np.float32), mesh))


def _bits(tree):
    return [np.asarray(a).tobytes() for a in jax.tree_util.tree_leaves(tree)]


def test_a_step_compiled_ahead_runs_without_tracing_or_compiling_again():
    st, x = _args()
    traces = []
    with A.Ahead() as ahead, Compiles() as seen:
        step = ahead.compile(jax.jit(_step(traces), donate_argnums=0), A.abstract(st), A.abstract(x))
        step.wait()
        assert traces == [1] and [t for _, t in seen.seen] and all(t.startswith("jmsnas-ahead") for _, t in seen.seen)
        n = len(seen.seen)
        got = step(*_args())
        assert traces == [1] and len(seen.seen) == n  # the call found the executable
    expected = jax.jit(_step([]))(*_args())
    assert _bits(got) == _bits(expected)


def test_a_persistent_step_compiles_ahead_through_its_stored_program(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path / "root"))
    monkeypatch.delenv(cache.ENV_SWITCH, raising=False)
    before = jax.config.jax_compilation_cache_dir
    assert cache.enable_compilation_cache(tmp_path / "root" / "xla") is not None
    try:
        st, x = _args()
        traces = []
        step = programs.persistent_jit(jax.jit(_step(traces), donate_argnums=0), name="test.ahead", identity=1,
                                       donate_argnums=0)
        with A.Ahead() as ahead:
            waiting = ahead.compile(step, A.abstract(st), A.abstract(x))
        assert traces == [1] and len(list((tmp_path / "root" / "programs").glob("test.ahead-*"))) == 1
        got = waiting(*_args())
        assert traces == [1]
        assert _bits(got) == _bits(jax.jit(_step([]))(*_args()))
    finally:
        if before:
            cache.enable_compilation_cache(before)
        else:
            cache.disable_compilation_cache()


def test_a_failure_ahead_leaves_the_first_call_to_compile_and_raise():
    def bad(x):
        return x @ jnp.ones((3, 3))  # wrong inner dimension for the (2, 2) input

    with A.Ahead() as ahead:
        step = ahead.compile(jax.jit(bad), jax.ShapeDtypeStruct((2, 2), jnp.float32))
        step.wait()
        assert len(ahead.errors) == 1 and "dot_general" in str(ahead.errors[0])
    with pytest.raises(TypeError, match="dot_general"):
        step(jnp.ones((2, 2)))


def test_no_workers_compiles_nothing_ahead():
    ahead = A.Ahead(workers=0)
    traces = []
    step = ahead.compile(jax.jit(_step(traces)), *map(A.abstract, _args()))
    assert traces == [] and ahead.submit(lambda: 1) is None
    step(*_args())
    assert traces == [1]
    with pytest.raises(ValueError, match="workers must be >= 0, got -1"):
        A.Ahead(workers=-1)


def test_speculation_is_waited_for_only_under_its_own_key():
    built = threading.Event()
    with A.Ahead() as ahead:
        ahead.speculate(lambda: ("retrain", (1, 2)), lambda key: (time.sleep(0.3), built.set(), key[1])[2])
        assert ahead.wait_for(("retrain", (2, 1))) is False  # another architecture: nothing to wait for
        assert ahead.built(("retrain", (2, 1))) is None
        assert ahead.wait_for(("retrain", (1, 2))) is True and built.is_set()
        assert ahead.built(("retrain", (1, 2))) == (1, 2)  # what build returned


def test_abstract_keeps_shape_dtype_weak_type_and_sharding():
    mesh = train.data_mesh()
    tree = {"a": train.replicate(np.zeros((2, 3), np.float32), mesh), "b": jnp.asarray(1.0)}
    got = A.abstract(tree)
    assert got["a"].shape == (2, 3) and got["a"].dtype == jnp.float32 and got["a"].sharding == tree["a"].sharding
    assert got["b"].weak_type and got["b"].shape == ()
    assert A.abstract(tree, train.replicated(mesh))["b"].sharding == train.replicated(mesh)


@pytest.mark.slow
@pytest.mark.parametrize("shared", [True, False])
def test_the_search_state_has_the_shapes_of_its_initialisation_without_running_it(shared):
    space = build_space(presets.chain_preset((1, 1, 1, 1)), image_size=8, in_channels=1, num_classes=10,
                        device_channels=(8, 8, 8, 8), device_strides=(1, 2, 1, 2))
    hp = train.SearchHParams()
    init = lambda: train.init_search_state(jax.random.PRNGKey(0), space, hp, shared)
    shapes, real = jax.eval_shape(init), init()
    assert jax.tree_util.tree_structure(shapes) == jax.tree_util.tree_structure(real)
    for s, r in zip(jax.tree_util.tree_leaves(shapes), jax.tree_util.tree_leaves(real)):
        assert (s.shape, s.dtype, s.weak_type) == (r.shape, r.dtype, r.weak_type)


@pytest.mark.slow
def test_the_main_job_compiles_every_step_ahead_with_the_same_result(tmp_path, monkeypatch, fast_compiles):
    """Both runs compile with XLA's optimisation passes off (``fast_compiles``; this module's last test): what is
    checked is where and how often the steps compile and that both runs agree, not the optimised code."""
    cfg = configs.tiny(configs.default_config())
    cfg.dw_impl = "xla"
    cfg.retrain.epochs = 2
    cfg.retrain.lr = 1.75e-3  # retraining steps no other test made (they are cached per process)
    steps = ("jit(weight_step)", "jit(arch_step)", "jit(eval_step)", "jit(train_step)")
    decided, decide = [], pipeline.decide
    monkeypatch.setattr(pipeline, "decide", lambda *a: (decided.append(threading.current_thread().name), decide(*a))[1])
    with Compiles() as seen:
        ahead = pipeline.search(cfg, str(tmp_path / "ahead"), progress=False)
    assert len(decided) == 1 and decided[0] != "MainThread", decided  # the repair once, beside the last epoch
    names = [n for n, _ in seen.seen]
    for name in steps:  # the search's and the retraining's eval_step: two programs, each compiled once, ahead
        assert names.count(name) == (2 if name == "jit(eval_step)" else 1), (name, seen.seen)
    assert not [s for s in seen.seen if s[0] in steps and s[1] == "MainThread"], seen.seen
    monkeypatch.setattr(pipeline, "start_ahead", lambda: A.Ahead(workers=0))
    plain = pipeline.search(cfg, str(tmp_path / "plain"), progress=False)
    ahead.pop("time"), plain.pop("time")
    assert ahead == plain
