"""The two-stage weight-sharing flow: sandwich-rule step (sub-networks, gradient, one compilation), fitness under the
hard latency constraint, configuration errors, and ``jmsnas evolve`` end to end with resume."""
import json
import shutil
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import procs
import tinyrun
from jmsnas import cli, configs, evolve, pipeline, supernet, tensorboard
from jmsnas.cost.latency import arch_latency, best_chain_assignment
from jmsnas.cost.tables import analytic_table
from jmsnas.evaluate import evaluate_loop
from jmsnas.gates import onehot_gates
from jmsnas.objectives import cross_entropy, l2_norm_sq
from jmsnas.pipeline import ConfigError
from jmsnas.run import evolution as RE, processes, supernet as RS
from jmsnas.space import NUM_OPS, OP_NAMES, build_space, op_index
from jmsnas.strategies.base import sample_valid
from jmsnas.topology import DeviceProfile, chain

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile time dominates: 200 -> 171 s of test time, AVX2 EPYC, 2 cores

LR, L1, R = 1e-2, 1e-3, 2


def small_space():
    """ue -> cloud, one layer each on 6x6 images: L0 keeps 4 channels (13 ops, identity allowed), L1 has stride 2
    (6 ops, no identity or shortcut)."""
    topo = chain("c", [DeviceProfile(n, 10.0, 1e9) for n in ("ue", "cloud")], [10.0], [1, 1])
    return build_space(topo, image_size=6, in_channels=3, num_classes=5, device_channels=[4, 4],
                       device_strides=[1, 2], stem_channels=4, head_channels=8)


DIGITS = types.SimpleNamespace(image_size=8, channels=1, num_classes=10)  # the data's sizes, without loading it


def tiny_space():
    return pipeline.build(configs.tiny(configs.default_config()), DIGITS)


def mesh_space():
    return pipeline.build(configs.tiny(configs.mesh_config()), DIGITS)[0]


# ----------------------------------------------------------------------------------------------- sub-networks

@pytest.mark.parametrize("space", [small_space(), tiny_space()[0], mesh_space()], ids=["small", "chain", "mesh"])
def test_largest_and_smallest_are_the_named_extremes(space):
    largest, smallest = evolve.sandwich_ops(space)
    mask = space.mask()
    for n in range(space.num_layers):
        shortcut_ok = mask[n, op_index("identity")]
        assert OP_NAMES[largest[n]] == ("mbconv_k7_e6_res" if shortcut_ok else "mbconv_k7_e6")
        assert OP_NAMES[smallest[n]] == ("identity" if shortcut_ok else "mbconv_k3_e3")
    assert mask[:, op_index("identity")].any() and not mask[:, op_index("identity")].all()  # both cases occur
    space.validate_arch(largest)
    space.validate_arch(smallest)


@pytest.mark.slow
def test_sandwich_archs_rows():
    space = tiny_space()[0]
    largest, smallest = evolve.sandwich_ops(space)
    mask = space.mask()
    archs = np.asarray(RS.sandwich_archs(jax.random.PRNGKey(3), mask, largest, smallest, 5))
    assert archs.shape == (7, space.num_layers) and archs.dtype == np.int32
    np.testing.assert_array_equal(archs[0], largest)
    np.testing.assert_array_equal(archs[1], smallest)
    assert mask[np.arange(space.num_layers)[None], archs[2:]].all()  # random rows pick valid ops only
    other = np.asarray(RS.sandwich_archs(jax.random.PRNGKey(4), mask, largest, smallest, 5))
    assert not np.array_equal(other[2:], archs[2:]) and np.array_equal(other[:2], archs[:2])
    assert RS.sandwich_archs(jax.random.PRNGKey(3), mask, largest, smallest, 0).shape == (2, space.num_layers)


# ----------------------------------------------------------------------------------------------- the step

@pytest.fixture(scope="module")
def stepped():
    """Three sandwich steps of the small space through one jitted, trace-counted step (the flow's own function)."""
    space = small_space()
    chex.clear_trace_counter()
    step = jax.jit(chex.assert_max_traces(evolve.sandwich_step(space, LR, L1, R, "xla"), n=1))
    st0 = RS.init_sandwich_state(jax.random.PRNGKey(0), lambda k: supernet.init(k, space), LR)
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(4, 6, 6, 3)).astype(np.float32), rng.integers(0, 5, 4).astype(np.int32))
               for _ in range(3)]
    states, metrics, st = [], [], st0
    for x, y in batches:
        st, m = step(st, x, y)
        states.append(st)
        metrics.append(m)
    return space, st0, batches, states, metrics


@pytest.mark.slow
def test_sandwich_step_compiles_once_and_advances(stepped):
    _, st0, _, states, metrics = stepped  # a second trace would have raised inside the fixture
    assert [int(s.step) for s in states] == [1, 2, 3]
    keys = [np.asarray(st0.key)] + [np.asarray(s.key) for s in states]
    assert len({k.tobytes() for k in keys}) == 4  # a fresh key, so fresh random sub-networks, every step
    for m in metrics:
        assert set(m) == {"loss", "acc", "loss_largest", "acc_largest", "loss_smallest", "acc_smallest"}
        assert all(np.isfinite(float(v)) for v in m.values())


@pytest.mark.slow
def test_sandwich_step_is_one_adam_update_of_the_summed_gradients(stepped):
    """Oracle: the sub-networks the step's key picks, run one after the other eagerly (no jit, no scan) through
    supernet.apply with one-hot gates, each starting from the BN state the previous left; gradients summed,
    plus the L2 term once."""
    space, st0, batches, states, metrics = stepped
    x, y = batches[0]
    archs = np.asarray(RS.sandwich_archs(jax.random.split(st0.key)[1], space.mask(),
                                             *evolve.sandwich_ops(space), R))
    with jax.disable_jit():
        bn, total, ces = st0.bn, jax.tree_util.tree_map(jnp.zeros_like, st0.params), []
        for ops in archs:
            def loss(p, bn=bn, ops=ops):
                logits, new = supernet.apply(space, p, bn, onehot_gates(ops, NUM_OPS), x, train=True, dw_impl="xla")
                return cross_entropy(logits, y), new

            (ce, bn), g = jax.value_and_grad(loss, has_aux=True)(st0.params)
            total = jax.tree_util.tree_map(jnp.add, total, g)
            ces.append(float(ce))
        total = jax.tree_util.tree_map(jnp.add, total, jax.grad(lambda p: L1 * l2_norm_sq(p))(st0.params))
    _, want_opt = optax.adam(LR).update(total, st0.opt, st0.params)
    got = states[0]
    # Adam's moments hold the gradient (its first update is ~lr * sign(g), which magnifies rounding of tiny g)
    for got_leaf, want_leaf in zip(jax.tree_util.tree_leaves(got.opt), jax.tree_util.tree_leaves(want_opt)):
        np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-4, atol=1e-8)
    chex.assert_trees_all_close(got.bn, bn, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics[0]["loss"]), np.mean(ces), rtol=1e-5)
    np.testing.assert_allclose([float(metrics[0]["loss_largest"]), float(metrics[0]["loss_smallest"])], ces[:2],
                               rtol=1e-5)


# ----------------------------------------------------------------------------------------------- fitness

@pytest.mark.slow
def test_population_latency_matches_arch_latency():
    space, table = tiny_space()
    ops = np.asarray(sample_valid(jax.random.PRNGKey(1), jnp.asarray(space.mask()), 6))
    fixed = np.asarray(evolve.population_latency(space, table, ops, "fixed"))
    searched = np.asarray(evolve.population_latency(space, table, ops, "searched"))
    for o, f, s in zip(ops, fixed, searched):
        assert f == pytest.approx(float(arch_latency(space, table, o).total), rel=1e-6)
        split = best_chain_assignment(space, table, jax.nn.one_hot(o, NUM_OPS))
        assert s == pytest.approx(float(arch_latency(space, table, o, split).total), rel=1e-6)
        assert s <= f * (1 + 1e-6)  # the best split is never worse than the fixed one


@pytest.mark.slow
def test_initial_population_is_feasible_where_possible():
    space, table = tiny_space()
    key = jax.random.PRNGKey(2)
    pop = RE.feasible_population(key, space.mask(), evolve.within_budget(space, table, 0.85, "fixed"), 8, 64)
    assert pop.shape == (8, space.num_layers)
    assert space.mask()[np.arange(space.num_layers)[None], pop].all()
    assert all(float(arch_latency(space, table, o).total) <= 0.85 for o in pop)
    # below the fastest architecture nothing is feasible: the population is still filled, with valid draws
    low = RE.feasible_population(key, space.mask(), evolve.within_budget(space, table, 0.5, "fixed"), 8, 64)
    np.testing.assert_array_equal(low, np.asarray(sample_valid(key, jnp.asarray(space.mask()), 512))[:8])


@pytest.mark.slow
def test_fitness_discards_over_budget_and_ranks_by_accuracy(stepped):
    space, _, batches, states, _ = stepped
    table = analytic_table(space)
    largest, smallest = evolve.sandwich_ops(space)
    ops = np.concatenate([[largest, smallest], sample_valid(jax.random.PRNGKey(5), jnp.asarray(space.mask()), 6)])
    lat = np.array([float(arch_latency(space, table, o).total) for o in ops])
    u = np.unique(lat)
    t_const = float(u[len(u) // 2 - 1] + u[len(u) // 2]) / 2  # about half of them over the budget
    (x, y), (xb, _) = batches[0], batches[1]
    fd = RE.FitnessData(x, y, xb[None])
    st = states[-1]
    f = evolve.fitness(space, table, st.params, st.bn, ops, fd, t_const, "fixed", chunk=4)
    ref = evaluate_loop(space, table, st.params, st.bn, ops, x, y, bn_batches=xb[None])
    np.testing.assert_allclose(f["accuracy"], ref["accuracy"], atol=1e-6)
    g = evolve.fitness(space, table, st.params, st.bn, ops, fd, t_const, "fixed", chunk=4, evaluator="loop")
    for key in ("accuracy", "latency_ms", "feasible", "fitness"):  # the loop evaluator: the same fitness
        np.testing.assert_allclose(g[key], f[key], atol=1e-6)
    np.testing.assert_allclose(f["latency_ms"], lat, rtol=1e-6)
    np.testing.assert_array_equal(f["feasible"], lat <= t_const)
    assert np.all(np.isneginf(f["fitness"][lat > t_const]))
    ok = lat <= t_const
    # among feasible candidates the order is accuracy first, then lower latency
    for a in np.flatnonzero(ok):
        for b in np.flatnonzero(ok):
            acc, t = f["accuracy"], f["latency_ms"]
            if acc[a] > acc[b] or (acc[a] == acc[b] and t[a] < t[b]):
                assert f["fitness"][a] > f["fitness"][b]


# ----------------------------------------------------------------------------------------------- configuration

def test_defaults_fill_and_keep_given_values():
    cfg = configs.default_config()
    cfg.evolve = {"population": 64}
    e = evolve.with_defaults(cfg).evolve
    assert e.population == 64 and e.generations == evolve.DEFAULTS["generations"] == 20
    assert evolve.DEFAULTS["population"] == 512
    assert set(e) == set(evolve.DEFAULTS)
    assert evolve.with_defaults(configs.default_config()).evolve.to_dict() == evolve.DEFAULTS


@pytest.mark.parametrize("key, value, needle", [
    ("population", 1, "evolve.population"), ("generations", 0, "evolve.generations"),
    ("epochs", True, "evolve.epochs"), ("num_random", -1, "evolve.num_random"),
    ("fitness_examples", 2.5, "evolve.fitness_examples"), ("chunk", 0, "evolve.chunk"),
    ("parent_ratio", 0.0, "evolve.parent_ratio"), ("mutation_prob", 1.5, "evolve.mutation_prob"),
    ("evaluator", "vmap", "evolve.evaluator"),
    ("bogus", 3, "bogus"),
])
def test_bad_settings_fail_before_anything_is_written(tmp_path, key, value, needle):
    cfg = configs.default_config()
    cfg.evolve = {key: value}
    work = tmp_path / "work"
    with pytest.raises(ConfigError, match=needle):
        evolve.evolve(cfg, str(work))
    assert not work.exists()


def test_cli_reports_bad_overrides_in_one_line(capsys, tmp_path):
    code = cli.main(["evolve", "--workdir", str(tmp_path / "w"), "--config.evolve.generations=0"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "evolve.generations" in err
    code = cli.main(["evolve", "--workdir", str(tmp_path / "w"), "--config.evolve.nope=1"])
    assert code == 2 and "evolve.nope" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_too_few_training_examples_for_recalibration(tmp_path):
    cfg = configs.tiny(configs.default_config())  # 256 training examples
    cfg.evolve = {"bn_batches": 5, "bn_batch_size": 64}
    with pytest.raises(ConfigError, match="evolve.bn_batches=5"):
        evolve.evolve(cfg, str(tmp_path / "w"), progress=False)
    assert not (tmp_path / "w" / "checkpoints").exists()


# ----------------------------------------------------------------------------------------------- end to end

SEARCH_KEYS = {"topology", "space", "t_const_ms", "architecture", "split", "latency_ms", "accuracy", "params", "budget",
               "dataset", "seed", "memory", "energy"}


@pytest.mark.slow
def test_evolve_end_to_end_meets_the_budget_and_resumes(evolved_run, evolve_config_file, tiny_env):
    """conftest's evolved_run (``jmsnas evolve`` of the tiny config under a 0.85 ms budget, in its own process),
    checked, then cut back and resumed by another process."""
    run = evolved_run
    for name in ("result.json", "history.json", "evolution.json", "summary.txt", "history.png",
                 "latency_breakdown.png", "architecture.png", "parts/manifest.json"):
        assert (run / name).exists(), name
    result = json.loads((run / "result.json").read_text())
    assert set(result) == SEARCH_KEYS | {"flow", "evolution", "time"}
    tinyrun.assert_common_top_level(result, "evolve")
    ops = [op_index(a["op"]) for a in result["architecture"]]
    space, table = tiny_space()
    t = float(arch_latency(space, table, np.asarray(ops)).total)
    assert t <= 0.85 and result["latency_ms"]["total"] == pytest.approx(t)
    assert result["budget"]["met"] and not result["budget"]["repaired"]

    ev = json.loads((run / "evolution.json").read_text())
    assert len(ev["generations"]) == 2 and ev["winner"] == ops == ev["best"]["ops"]
    assert ev["best"]["latency_ms"] <= 0.85
    # soft ranking by accuracy: the winner is the most accurate feasible candidate ever evaluated
    assert ev["best"]["accuracy"] == max(g["best_accuracy"] for g in ev["generations"] if g["best_accuracy"] is not None)
    assert ev["most_accurate"]["accuracy"] >= ev["best"]["accuracy"]
    assert ev["generations"][0]["feasible_fraction"] == 1.0  # the initial population starts inside the budget
    history = json.loads((run / "history.json").read_text())
    assert [h["stage"] for h in history] == ["search", "retrain"]
    largest, smallest = evolve.sandwich_ops(space)
    assert history[0]["derived_latency_ms"] == pytest.approx(float(arch_latency(space, table, largest).total))
    assert history[0]["derived_latency_ms_smallest"] == pytest.approx(float(arch_latency(space, table,
                                                                                          smallest).total))
    summary = (run / "summary.txt").read_text()
    assert "within the budget" in summary
    # TensorBoard (jmsnas.tensorboard): the epochs, the fitness of every generation, the result and its figures
    scalars, images = tensorboard.read(str(run))
    names = {"train/loss", "train/accuracy", "val/accuracy", "val/accuracy_smallest", "latency/derived_ms",
             "evolution/fitness_best", "evolution/fitness_mean", "evolution/feasible_fraction",
             "evolution/accuracy_mean", "evolution/latency_max_ms", "result/accuracy/test", "result/latency_ms"}
    names |= {f"result/latency/device/{d}_ms" for d in result["latency_ms"]["per_device"]}
    names |= {f"memory/{d}/weight_bytes" for d in result["latency_ms"]["per_device"]}
    assert names <= set(scalars), sorted(names - set(scalars))
    assert [s for s, _ in scalars["evolution/fitness_best"]] == [0, 1]
    assert scalars["evolution/feasible_fraction"][0][1] == ev["generations"][0]["feasible_fraction"]
    assert images == ["figures/architecture", "figures/history", "figures/latency_breakdown"]

    # resume: drop the last supernet step (mid-epoch checkpoint is left), the last generation and the outputs
    sup = run / "checkpoints" / "supernet"
    steps = sorted(int(p.name) for p in sup.iterdir() if p.name.isdigit())
    shutil.rmtree(sup / str(steps[-1]))
    shutil.rmtree(run / "checkpoints" / "evolution" / "2")
    for name in ("result.json", "evolution.json", "history.json"):
        (run / name).unlink()
    procs.finish(procs.start(tiny_env, "evolve", evolve_config_file, run, "--resume"))
    again = json.loads((run / "result.json").read_text())
    assert again["architecture"] == result["architecture"]
    assert again["accuracy"] == pytest.approx(result["accuracy"])
    assert json.loads((run / "evolution.json").read_text()) == ev


def test_spread_over_processes_gives_each_process_its_rows_and_gathers_them_in_order(monkeypatch):
    """Three simulated processes share 7 rows (3 + 3 + 1, the last row repeated twice to fill 9): each evaluates
    only its rows, and the gathered values are the rows' own, in order."""
    from jax.experimental import multihost_utils
    ops = np.arange(14, dtype=np.int32).reshape(7, 2)
    seen, parts = {}, {}

    def fn(params, bn, rows):
        seen[jax.process_index()] = rows[:, 0].tolist()
        return rows[:, 0] * 10.0 + params + bn

    def gather(part, tiled=False):
        parts[jax.process_index()] = part
        return np.stack([parts.get(i, np.zeros_like(part)) for i in range(jax.process_count())])

    monkeypatch.setattr(jax, "process_count", lambda: 3)
    monkeypatch.setattr(multihost_utils, "process_allgather", gather)
    for pid in range(3):  # the last simulated process gathers every part
        monkeypatch.setattr(jax, "process_index", lambda pid=pid: pid)
        out = processes.spread(fn, np.float32(1.0), np.float32(2.0), ops)
    assert seen == {0: [0, 2, 4], 1: [6, 8, 10], 2: [12, 12, 12]}
    np.testing.assert_array_equal(out, ops[:, 0] * 10.0 + 3.0)
