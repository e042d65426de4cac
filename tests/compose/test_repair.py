"""The composed repair (jmsnas.compose.repair): the most probable configuration within T_const and every device's
memory and energy limit equals the enumeration of every configuration (hypothesis over random small spaces)."""
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from jmsnas.compose import anysplit as A
from jmsnas.compose import choices as C
from jmsnas.compose.frontier import cheapest, slack
from jmsnas.compose import repair as R
from jmsnas.limits import DeviceLimits, LimitsError
from jmsnas.space import build_space
from jmsnas.topology import DeviceProfile, LinkProfile, make_topology
from spaces import configs, reference, setup

pytestmark = pytest.mark.usefixtures("fast_compiles")  # tiny programs: compile time dominates

MECHANISMS = [dict(modules=(2,), weight_bits=(), act_bits=()), dict(modules=(), weight_bits=(4, 32), act_bits=()),
              dict(modules=(), weight_bits=(), act_bits=(8, 32)), dict(modules=(2, 4), weight_bits=(4, 8),
                                                                     act_bits=(4, 32))]
REQUIRED = dict(modules=(2, 4), weight_bits=(4, 32), act_bits=(), module_optional=False)  # no "none" at any cut


def _chain(n_dev, bws, mem_bws, lpd=None):
    names = [f"d{i}" for i in range(n_dev)]
    devs = [DeviceProfile(n, 1.0 + 10 * i, 1e9, mem_bandwidth_gbs=mb, active_power_w=1.0 + i)
            for i, (n, mb) in enumerate(zip(names, mem_bws))]
    links = [LinkProfile(a, b, bw, 0.1, False, 2.0, 0.5) for a, b, bw in zip(names, names[1:], bws)]
    topo = make_topology("c", devs, links, lpd or (1,) * n_dev)
    return build_space(topo, image_size=8, in_channels=1, num_classes=10, device_channels=(12, 16, 20)[:n_dev],
                       device_strides=(1,) * n_dev, stem_channels=8, head_channels=8)


def _mesh(bws, end=None):
    """root -> b0, b1 -> agg, every device and link drawing power; ``end="pre"``: a device p0 before the root,
    ``"post"``: a device q0 after the aggregator (one layer each, the enumeration's size)."""
    names = ["p0"] * (end == "pre") + ["root", "b0", "b1", "agg"] + ["q0"] * (end == "post")
    speed = dict(p0=1.5, root=1.0, b0=3.0, b1=2.0, agg=30.0, q0=5.0)
    devs = [DeviceProfile(n, speed[n], 1e9, mem_bandwidth_gbs=0.2, active_power_w=1.0 + i)
            for i, n in enumerate(names)]
    pairs = [("p0", "root")] * (end == "pre") + [("root", "b0"), ("root", "b1"), ("b0", "agg"), ("b1", "agg")] \
        + [("agg", "q0")] * (end == "post")
    links = [LinkProfile(a, b, bw, 0.1, False, 2.0, 0.5) for (a, b), bw in zip(pairs, bws)]
    chans = dict(p0=8, root=12, b0=16, b1=16, agg=20, q0=20)
    topo = make_topology("m", devs, links, (1,) * len(names))
    return build_space(topo, image_size=8, in_channels=1, num_classes=10, device_channels=[chans[n] for n in names],
                       device_strides=(1,) * len(names), stem_channels=8, head_channels=8)


def _enumerate(space, ch, probs):
    n, links = space.num_layers, len(space.topology.links)
    mask = space.mask()
    sup = [list(np.flatnonzero(mask[i])) for i in range(n)] + [list(range(len(ch.weight_bits)))] * n \
        + [list(np.flatnonzero(ch.group_masks()[1]))] * links + [list(range(len(ch.act_bits)))] * links
    ops, wb, mod, ab = np.split(configs(sup), np.cumsum([n, n, links]), axis=1)
    logp = lambda p, idx: np.log(np.maximum(np.asarray(p, np.float64), 1e-30))[np.arange(idx.shape[1]), idx].sum(1)
    cost = -(logp(probs.ops, ops) + logp(probs.weight_bits, wb) + logp(probs.module, mod) + logp(probs.act_bits, ab))
    return (ops, wb, mod, ab), cost


def _logits(space, ch, seed):
    rng = np.random.default_rng(seed)
    return C.ChoiceProbs(*(rng.normal(scale=2.0, size=s).astype(np.float32) for s in C.logits_shapes(space, ch)))


def _check(space, ch, table, terms, mem, logits, t_const, limits, ref, cost, assignment=None):
    idx = _enumerate.last
    within = np.ones(len(cost), bool)
    if limits is not None:
        within = np.all(ref["memory"] <= slack(limits.memory_bytes), 1) & np.all(ref["energy"] <= slack(limits.energy_mj),
                                                                                1)
        if not within.any():
            with pytest.raises(LimitsError):
                R.repair(space, table, terms, ch, logits, t_const, assignment, limits)
            return "none within the limits"
    fix = R.repair(space, table, terms, ch, logits, t_const, assignment, limits)
    ok = within & (ref["T"] <= slack(t_const))  # float32 rounding, as the repair allows
    row = np.flatnonzero((idx[0] == fix.config.ops).all(1) & (idx[1] == fix.config.weight_bits).all(1)
                         & (idx[2] == fix.config.module).all(1) & (idx[3] == fix.config.act_bits).all(1))
    assert len(row) == 1
    r = row[0]
    assert within[r]  # never over a limit
    np.testing.assert_allclose(fix.min_latency_ms, ref["T"][within].min(), rtol=1e-5)
    if ok.any():
        assert fix.feasible and ref["T"][r] <= slack(t_const)
        np.testing.assert_allclose(cost[r], cost[ok].min(), rtol=1e-9, atol=1e-9)  # the most probable one
        assert fix.repaired == (cost[ok].min() < cost.min() - 1e-9 or not ok[np.argmin(cost)])
    else:
        assert not fix.feasible
        np.testing.assert_allclose(ref["T"][r], ref["T"][within].min(), rtol=1e-5)  # the fastest within them
    return "feasible" if ok.any() else "over T_const"


def _run(space, mech, seed, q_t, limit_kind, q_lim, assignment=None):
    table, ch, terms, mem = setup(space, **mech)
    logits = _logits(space, ch, seed)
    probs = C.probs_from_logits(space, ch, logits)
    idx, cost = _enumerate(space, ch, probs)
    _enumerate.last = idx
    ref = reference(space, table, terms, mem, *idx, space.layer_devices() if assignment is None else assignment)
    t_const = float(np.quantile(ref["T"], q_t)) if q_t >= 0 else float(ref["T"].min()) * (0.9 + q_t)  # < 0: none
    limits = None
    if limit_kind:
        m = space.topology.num_devices - 1 - seed % space.topology.num_devices  # one device, walking through them
        lim_mem, lim_en = np.full(space.topology.num_devices, np.inf), np.full(space.topology.num_devices, np.inf)
        if limit_kind in ("memory", "both"):
            lim_mem[m] = np.quantile(ref["memory"][:, m], q_lim)
        e = m if limit_kind == "both" else (m + 1) % len(lim_en)  # both on one device: maybe none meets them
        if limit_kind in ("energy", "both"):
            lim_en[e] = np.quantile(ref["energy"][:, e], q_lim)
        limits = DeviceLimits(lim_mem, lim_en, mem)
    return _check(space, ch, table, terms, mem, logits, t_const, limits, ref, cost, assignment)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(2, 3), st.lists(st.floats(0.5, 20.0), min_size=2, max_size=2),
       st.lists(st.floats(0.05, 5.0), min_size=3, max_size=3), st.sampled_from(MECHANISMS + [REQUIRED]),
       st.integers(0, 1000), st.floats(-0.1, 1.0), st.sampled_from([None, "memory", "energy", "both"]),
       st.floats(-0.05, 0.6))
def test_chain_repair_equals_enumeration(n_dev, bws, mem_bws, mech, seed, q_t, limit_kind, q_lim):
    _run(_chain(n_dev, bws, mem_bws), mech, seed, q_t, limit_kind, max(q_lim, 0.0))


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.floats(0.5, 20.0), min_size=4, max_size=4), st.sampled_from(MECHANISMS[:3] + [REQUIRED]),
       st.integers(0, 1000),
       st.floats(-0.1, 1.0))
# T_const at the least T (and near it), where the mesh's branch time is most of T: the rounding allowance is the
# whole T_const's, not that of what is left after the branches (which missed the fastest configuration)
@example([1.5, 1.0, 1.0, 2.0], MECHANISMS[1], 0, 0.0)
@example([1.5, 1.0, 1.0, 2.0], MECHANISMS[1], 0, 0.03125)
@example([20.0, 1.0, 1.5, 2.0], MECHANISMS[1], 919, 0.0)
def test_mesh_repair_equals_enumeration(bws, mech, seed, q_t):
    _run(_mesh(bws), mech, seed, q_t, None, 0.0)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.floats(0.5, 20.0), min_size=5, max_size=5), st.sampled_from(MECHANISMS[:3] + [REQUIRED]),
       st.integers(0, 1000), st.floats(-0.1, 1.0), st.sampled_from(["memory", "energy", "both"]),
       st.floats(-0.05, 0.6), st.sampled_from([None, "pre", "post"]), st.booleans())
@example([1.0, 2.0, 1.5, 3.0, 0.7], MECHANISMS[0], 4, 0.3, "memory", 0.3, "pre", True)
@example([1.0, 2.0, 1.5, 3.0, 0.7], MECHANISMS[2], 9, 0.2, "energy", 0.4, "post", True)
def test_mesh_repair_with_limits_equals_enumeration(bws, mech, seed, q_t, limit_kind, q_lim, end, relay):
    """Within every device's memory and energy limits on a mesh: the root's and the aggregator's depend on both
    branches' link options together; a device before the root or after the aggregator joins through its link.
    ``relay``: under a split that leaves the root (its layer on p0) or the aggregator (its layer on q0) none."""
    end = None if mech is REQUIRED else end  # with a device more, its enumeration has 8 million configurations
    space = _mesh(bws[:4 + (end is not None)], end)
    a = None
    if relay and end is not None:
        a = np.array(space.layer_devices())
        if end == "pre":
            a[1] = a[0]  # p0 takes the root's layer: the root relays to the branches
        else:
            a[-2] = a[-1]  # q0 takes the aggregator's: it averages the branches and sends the average on
    _run(space, mech, seed, q_t, limit_kind, max(q_lim, 0.0), a)


def test_derived_is_kept_when_it_fits_and_bad_logits_are_refused():
    space = _chain(2, [5.0], [1.0, 1.0])
    table, ch, terms, mem = setup(space, modules=(2,), weight_bits=(4, 32))
    logits = _logits(space, ch, 3)
    fix = R.repair(space, table, terms, ch, logits, 1e9)
    derived = R.derive(space, ch, logits)
    assert not fix.repaired and fix.logprob_loss == 0.0
    assert all(np.array_equal(a, b) for a, b in zip(fix.config, derived))
    bad = logits._replace(module=np.full_like(logits.module, np.nan))
    with pytest.raises(ValueError, match="NaN"):
        R.repair(space, table, terms, ch, bad, 1e9)


def test_the_rounding_allowance_is_the_whole_budget_s():
    """A point whose total (base + its latency) exceeds the budget by less than the budget's float32 allowance is
    within it, however small the part of the budget left after the base (by hand: budget 50, allowance 5e-5)."""
    front = (np.array([[0.5 + 3e-5, 1.0], [0.4, 2.0]]), np.array([[0], [1]]))
    assert cheapest(front, 50.0, 49.5)[0] == 0  # 50.00003 <= 50 + 5e-5
    assert cheapest(front, 50.0, 49.5 + 1e-4)[0] == 1  # 50.00013 is over: the slower, cheaper point is out
    assert cheapest(front, 50.0, 49.7) is None


def test_no_configuration_within_the_limits_or_the_budget():
    space = _chain(2, [5.0], [1.0, 1.0])
    table, ch, terms, mem = setup(space, modules=(2,), weight_bits=(4, 32))
    logits = _logits(space, ch, 4)
    tight = DeviceLimits(np.array([1.0, np.inf]), np.full(2, np.inf), mem)  # 1 byte: nothing fits on d0
    with pytest.raises(LimitsError, match="no configuration") as e:
        R.repair(space, table, terms, ch, logits, 1e9, limits=tight)
    assert "\n" not in str(e.value)
    fix = R.repair(space, table, terms, ch, logits, 1e-3)  # below the fastest configuration
    assert fix.repaired and not fix.feasible and fix.latency_ms == pytest.approx(fix.min_latency_ms, rel=1e-5)


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.floats(0.5, 20.0), min_size=1, max_size=1), st.lists(st.floats(0.05, 5.0), min_size=2, max_size=2),
       st.sampled_from(MECHANISMS), st.integers(0, 1000), st.floats(-0.1, 1.0), st.booleans(), st.floats(0.0, 0.5),
       st.booleans())
@example([0.6], [0.3, 2.0], MECHANISMS[3], 5, 0.02, True, 0.3, True)  # the image sent, the UE's memory binding
def test_repair_over_every_split_equals_enumeration(bws, mem_bws, mech, seed, q_t, limited, q_lim, send_input):
    """Configuration and split together: enumeration of every (split x ops x bits x modules) configuration; with
    ``send_input`` the splits also move the stem (the link before it carrying the image)."""
    space = _chain(2, bws, mem_bws, (2, 1))
    table, ch, terms, mem = setup(space, **mech, send_input=send_input)
    logits = _logits(space, ch, seed)
    idx, cost = _enumerate(space, ch, C.probs_from_logits(space, ch, logits))
    all_splits = list(A.splits(space, send_input))
    assert len(all_splits) == 4 + send_input  # 3 layers (and the stem) over 2 devices, contiguous
    refs = [reference(space, table, terms, mem, *idx, a) for a in all_splits]
    t = np.stack([r["T"] for r in refs])  # [S, C]
    t_const = float(np.quantile(t, q_t)) if q_t >= 0 else float(t.min()) * (0.9 + q_t)
    within = np.ones(t.shape, bool)
    limits = None
    if limited:
        lim = np.array([np.quantile(np.concatenate([r["memory"][:, 0] for r in refs]), q_lim), np.inf])
        limits = DeviceLimits(lim, np.full(2, np.inf), mem)
        within = np.stack([r["memory"][:, 0] <= slack(lim[0]) for r in refs])
    ok = within & (t <= slack(t_const))
    fix, a = A.repair_any_split(space, table, terms, ch, logits, t_const, limits)
    s = [i for i, b in enumerate(all_splits) if np.array_equal(a, b)][0]
    r = np.flatnonzero((idx[0] == fix.config.ops).all(1) & (idx[1] == fix.config.weight_bits).all(1)
                       & (idx[2] == fix.config.module).all(1) & (idx[3] == fix.config.act_bits).all(1))[0]
    assert within[s, r]
    np.testing.assert_allclose(fix.min_latency_ms, t[within].min(), rtol=1e-5)
    if ok.any():
        assert fix.feasible and ok[s, r]
        np.testing.assert_allclose(cost[r], np.broadcast_to(cost, t.shape)[ok].min(), rtol=1e-9, atol=1e-9)
    else:
        assert not fix.feasible
        np.testing.assert_allclose(t[s, r], t[within].min(), rtol=1e-5)


@pytest.mark.parametrize("limit_kind", [None, "memory"])
def test_a_required_module_is_repaired_exactly_on_a_chain_and_a_mesh(limit_kind):
    """``module_optional=False``: every cut carries a module; the repair equals the enumeration of the
    configurations that have one (the module "none" is outside the support)."""
    for seed in (3, 11):
        _run(_chain(3, [2.0, 0.7], [0.3, 1.0, 4.0]), REQUIRED, seed, 0.3, limit_kind, 0.4)
        if limit_kind is None:
            _run(_mesh([1.0, 3.0, 0.8, 2.0]), REQUIRED, seed, 0.3, None, 0.0)


def test_a_required_module_is_never_sampled_or_derived_as_none():
    from jmsnas.compose import net as N, steps as S
    space = _chain(2, [1.0], [0.5, 2.0])
    ch = C.make_choices(space.topology, modules=(4,), module_optional=False)
    lg = _logits(space, ch, 0)
    lg = lg._replace(module=np.array([[9.0, -9.0]], np.float32))  # the logits favour "none"
    assert float(C.probs_from_logits(space, ch, lg).module[0, 0]) == 0.0
    assert int(S.derive_config(space, ch, lg).module[0]) == 1 and int(R.derive(space, ch, lg).module[0]) == 1
    key = jax.random.PRNGKey(0)
    for k in jax.random.split(key, 5):
        assert int(N.weight_gates(k, lg[1:], ch).module.paths[0, 0]) == 1
        for mode in ("two_path", "gumbel_soft", "gumbel_hard", "softmax"):
            g = N.arch_gates(mode, k, lg[1:], ch, 1.0).module
            np.testing.assert_array_equal(np.asarray(g.weights), [[0.0, 1.0]])
    with pytest.raises(ValueError, match="module_optional: false needs at least one reduction"):
        C.make_choices(space.topology, modules=(), module_optional=False)
    with pytest.raises(ValueError, match="module_optional must be true or false, got 'no'"):
        C.make_choices(space.topology, modules=(4,), module_optional="no")
