"""The supernet as pure functions: padded candidate stacks, mixed ops g^T v(x), the compact network, mesh
wiring, gradients through two-path gates, and a jitted train step that compiles once (issue 2, item 4).

Both parameter layouts of ``supernet.init`` are covered where the layout matters: ``shared_weights=True`` (one
superkernel per layer, batch norm per candidate) and ``shared_weights=False`` (every candidate its own padded
weights). Wiring and gate tests that do not depend on the layout run on the default (shared) one."""
import functools
import re

import chex
import jax
import jax.monitoring as monitoring
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas import gates as G
from jmsnas import ops as O
from jmsnas import supernet as SN
from jmsnas import train
from jmsnas.objectives import cross_entropy
from jmsnas.space import IDENTITY, NUM_OPS, OPS, build_space, op_params
from jmsnas.topology import DeviceProfile, LinkProfile, chain, make_topology

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile time dominates: 144 -> 92 s with pytest -n 2, AVX2 EPYC, 2 cores

R = NUM_OPS
B = 2
CONV = ("expand", "dw", "project")
BN = ("bn1", "bn2", "bn3")
K7_E6, K3_E3 = 10, 0
KMAX = max(o.kernel for o in OPS)


def _devs(*names):
    return [DeviceProfile(n, 10.0, 1e9) for n in names]


# Every layer reads 4 channels, so the candidates' expand/depthwise shapes repeat across layers and spaces:
# the eager initialisation compiles one sampler per distinct shape.

def chain_space():
    """ue -> edge -> cloud, one layer each on 7x7 images: L0 keeps 4 ch (13 ops), L1 stride 2 on an odd size
    (6 ops), L2 keeps 4 ch at 4x4 (13 ops)."""
    topo = chain("c", _devs("ue", "edge", "cloud"), [10.0, 10.0], [1, 1, 1])
    return build_space(topo, image_size=7, in_channels=3, num_classes=5, device_channels=[4, 4, 4],
                       device_strides=[1, 2, 1], stem_channels=4, head_channels=8)


def mesh_space():
    """ue -> root -> {b1, b2} -> agg, one layer each on 6x6 images: L0, L1 keep 4 ch (13 ops); the branches
    L2, L3 have stride 2 (6 ops); the aggregator L4 widens 4 -> 8 ch (6 ops)."""
    links = [LinkProfile("ue", "root", 10.0), LinkProfile("root", "b1", 10.0), LinkProfile("root", "b2", 10.0),
             LinkProfile("b1", "agg", 10.0), LinkProfile("b2", "agg", 10.0)]
    topo = make_topology("m", _devs("ue", "root", "b1", "b2", "agg"), links, [1] * 5)
    return build_space(topo, image_size=6, in_channels=3, num_classes=5, device_channels=[4, 4, 4, 4, 8],
                       device_strides=[1, 1, 2, 2, 1], stem_channels=4, head_channels=8)


CHAIN, MESH = chain_space(), mesh_space()
SPACES = pytest.mark.parametrize("space", [CHAIN, MESH], ids=["chain", "mesh"])
LAYOUTS = pytest.mark.parametrize("shared", [True, False], ids=["shared", "separate"])


@pytest.fixture(autouse=True)
def full_precision_matmuls():
    """Float32 matmuls everywhere (GPUs default to TF32, which would swamp the 1e-4 comparisons); no-op on CPU."""
    with jax.default_matmul_precision("float32"):
        yield


def to_numpy(tree):
    """Host copies: ``extract`` then slices with NumPy instead of compiling one XLA slice per index pattern."""
    return jax.tree_util.tree_map(np.asarray, tree)


def perturb(seed, params, state):
    """Random values everywhere, padding included: the padded entries must never reach the output.
    (NumPy draws and NumPy leaves: eager jax.random would compile one sampler per leaf shape.)"""
    rng = np.random.default_rng(seed)
    params = jax.tree_util.tree_map(lambda a: np.asarray(a + 0.3 * rng.standard_normal(a.shape), a.dtype), params)

    def stat(path, a):
        if "var" in jax.tree_util.keystr(path):
            return np.asarray(rng.uniform(0.5, 2.0, a.shape), a.dtype)
        return np.asarray(0.3 * rng.standard_normal(a.shape), a.dtype)

    return params, jax.tree_util.tree_map_with_path(stat, state)


@functools.lru_cache(maxsize=None)
def initial(space, shared):
    """``supernet.init`` of ``space`` in one layout (built once per (space, layout))."""
    return SN.init(jax.random.PRNGKey(0), space, shared_weights=shared)


@functools.lru_cache(maxsize=None)
def net(space, shared):
    """Perturbed supernet parameters and state (NumPy leaves) of ``space``, a batch and labels."""
    params, state = perturb(1, *initial(space, shared))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((B, space.image_size, space.image_size,
                                                              space.in_channels)), jnp.float32)
    y = jnp.arange(B) % space.num_classes
    return params, state, x, y


# XLA's depthwise convolution in the jitted supernet and compact network: the layouts and gates under test here do
# not depend on the implementation (tests/native/test_dwconv.py compares them; the mixed-op and hand-wired mesh tests still
# run the default).
DW = "xla"


@functools.partial(jax.jit, static_argnums=0, static_argnames=("train",))
def apply_jit(space, params, state, gates, x, train):
    return SN.apply(space, params, state, gates, x, train=train, dw_impl=DW)


def archs_of(space, seed=0, count=3):
    """Identity wherever allowed, every shortcut variant wherever allowed, and random valid architectures."""
    mask = space.mask()
    rng = np.random.default_rng(seed)
    out = [tuple(IDENTITY if mask[n, IDENTITY] else 0 for n in range(space.num_layers)),
           tuple(11 if mask[n, 11] else 4 for n in range(space.num_layers))]  # k7_e6_res / k5_e3
    out += [tuple(int(rng.choice(np.flatnonzero(m))) for m in mask) for _ in range(count)]
    assert OPS[11].residual and not OPS[4].residual
    return out


def conv_window(space, n, i):
    """Boolean masks of the padded expand/dw/project entries candidate i of layer n uses, written from its op
    spec: the centred k x k window of the kmax x kmax kernel and the first in_ch * expand channels."""
    s, kmax = space.layers[n], KMAX
    mid_max = s.in_ch * max(o.expand for o in OPS)
    win = {"expand": np.zeros((s.in_ch, mid_max), bool), "dw": np.zeros((kmax, kmax, mid_max), bool),
           "project": np.zeros((mid_max, s.out_ch), bool)}
    op = OPS[i]
    if not op.is_identity:
        mid, lo = s.in_ch * op.expand, (kmax - op.kernel) // 2
        win["expand"][:, :mid] = True
        win["dw"][lo:lo + op.kernel, lo:lo + op.kernel, :mid] = True
        win["project"][:mid] = True
    return win


def bn_width(space, n, i):
    """Channels of candidate i's bn1, bn2, bn3."""
    s = space.layers[n]
    mid = s.in_ch * OPS[i].expand
    return {"bn1": mid, "bn2": mid, "bn3": s.out_ch}


def assert_trees_close(a, b, rtol=1e-4, atol=1e-4):
    chex.assert_trees_all_equal_structs(a, b)
    jax.tree_util.tree_map(lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol,
                                                                   atol=atol), a, b)


# ------------------------------------------------------------------------------------------------ layout

@SPACES
@LAYOUTS
def test_init_layout_and_extract_has_op_params(space, shared):
    params, state = to_numpy(initial(space, shared))
    mask = space.mask()
    for n, s in enumerate(space.layers):
        v, p = int(mask[n].sum()), params["layers"][n]
        assert SN.is_shared(p) == shared
        assert {p[name].shape[0] for name in CONV} == {1 if shared else v}
        assert {a.shape[0] for name in BN for a in jax.tree_util.tree_leaves(p[name])} == {v}
        assert {a.shape[0] for a in jax.tree_util.tree_leaves(state["layers"][n])} == {v}
        for i in np.flatnonzero(mask[n]):  # initial values: BN scale 1 on the candidate's channels, else 0
            pos = int(SN.layout(space, n).position[i])
            for name, ch in bn_width(space, n, i).items():
                want = np.zeros(p[name]["scale"].shape[1], np.float32)
                want[:ch if not OPS[i].is_identity else 0] = 1.0
                np.testing.assert_array_equal(p[name]["scale"][pos], want)
                np.testing.assert_array_equal(p[name]["bias"][pos], 0.0)
            if not shared:  # own weights inside the candidate's window, zero padding outside
                for name, win in conv_window(space, n, i).items():
                    assert np.all(p[name][pos][~win] == 0) and np.all(p[name][pos][win] != 0), (n, i, name)
        if shared:  # one He-initialised superkernel, no padding
            assert all(np.all(p[name][0] != 0) for name in CONV)
    for ops in archs_of(space):
        cp, cs = SN.extract(space, params, state, ops)
        for n, (s, i) in enumerate(zip(space.layers, ops)):
            assert SN.count_params(cp["layers"][n]) == op_params(OPS[i], s)
            if OPS[i].is_identity:
                assert cp["layers"][n] == {} and cs["layers"][n] == {}
            else:
                mid = s.in_ch * OPS[i].expand
                assert cp["layers"][n]["expand"].shape == (s.in_ch, mid)
                assert cp["layers"][n]["dw"].shape == (OPS[i].kernel, OPS[i].kernel, mid)
                assert cp["layers"][n]["project"].shape == (mid, s.out_ch)
        total = SN.count_params(cp)
        fixed = SN.count_params(params["stem"]) + SN.count_params(params["head"])
        assert total == fixed + sum(op_params(OPS[i], s) for s, i in zip(space.layers, ops))


def test_extract_rejects_bad_arch():
    params, state, _, _ = net(CHAIN, True)
    with pytest.raises(ValueError, match=rf"layer 1: op index {IDENTITY} is not a valid candidate"):
        SN.extract(CHAIN, params, state, [0, IDENTITY, 0])
    with pytest.raises(ValueError, match=re.escape("architecture has shape (2,), expected (3,)")):
        SN.extract(CHAIN, params, state, [0, 0])


def test_device_parts_follow_the_topology():
    params, state, _, _ = net(MESH, True)
    ops = archs_of(MESH)[2]
    cp, _ = SN.extract(MESH, params, state, ops)
    parts = SN.device_parts(MESH, cp, ops)
    assert list(parts) == ["ue", "root", "b1", "b2", "agg"]
    assert [parts[d]["layers"] for d in parts] == [[0], [1], [2], [3], [4]]
    assert [parts[d]["ops"] for d in parts] == [[OPS[i].name] for i in ops]
    assert "stem" in parts["ue"]["params"] and "head" in parts["agg"]["params"]
    assert sum("stem" in p["params"] or "head" in p["params"] for p in parts.values()) == 2


# ------------------------------------------------------------------------------------------------ sharing

def extracted_candidates(space, shared):
    """{(layer, op): (conv weights, BN params)} of every valid MBConv candidate, each from ``extract``."""
    params, state, _, _ = net(space, shared)
    mask, out = space.mask(), {}
    for i in range(R):
        if OPS[i].is_identity:
            continue
        ops = [i if mask[n, i] else K7_E6 for n in range(space.num_layers)]
        cp, _ = SN.extract(space, params, state, ops)
        for n in np.flatnonzero(mask[:, i]):
            layer = cp["layers"][n]
            out[int(n), i] = ({k: layer[k] for k in CONV}, {k: layer[k] for k in BN})
    return out


@LAYOUTS
def test_extracted_candidates_are_crops_of_one_superkernel_only_when_shared(shared):
    """Shared: every candidate's extracted weights are the centred k x k window and first in_ch * e channels of the
    k7_e6 candidate's, the k3_e3 one included, and the shortcut variants have the same weights; each candidate
    keeps its own batch norm. Separate: the same crops differ (independent weights)."""
    space = CHAIN
    cands = extracted_candidates(space, shared)
    assert {n for n, _ in cands} == set(range(space.num_layers))
    for (n, i), (conv, bn) in cands.items():
        wide = cands[n, K7_E6][0]
        mid, lo = space.layers[n].in_ch * OPS[i].expand, (KMAX - OPS[i].kernel) // 2
        crop = {"expand": wide["expand"][:, :mid], "dw": wide["dw"][lo:lo + OPS[i].kernel, lo:lo + OPS[i].kernel, :mid],
                "project": wide["project"][:mid]}
        for name in CONV:
            assert np.array_equal(conv[name], crop[name]) == (shared or i == K7_E6), (n, OPS[i].name, name)
        if OPS[i].residual:
            plain_conv, plain_bn = cands[n, i - 1]
            assert not OPS[i - 1].residual and OPS[i - 1].kernel == OPS[i].kernel
            for name in CONV:
                assert np.array_equal(conv[name], plain_conv[name]) == shared, (n, OPS[i].name, name)
            for name in BN:  # batch norm stays per candidate in both layouts
                assert not np.array_equal(bn[name]["scale"], plain_bn[name]["scale"])
    k3, k7 = cands[0, K3_E3][0], cands[0, K7_E6][0]
    assert k3["dw"].shape == (3, 3, 12) and k7["dw"].shape == (7, 7, 24)
    assert np.array_equal(k3["dw"], k7["dw"][2:5, 2:5, :12]) == shared


@SPACES
def test_shared_init_has_far_fewer_parameters(space):
    """Per layer: shared = the widest candidate's conv weights once + every candidate's BN padded to the widest;
    separate = that padded candidate once per valid candidate. Shared is also less than half the sum of all
    candidates' own (unpadded) parameters, and under a quarter of the separate supernet."""
    shared, separate = initial(space, True)[0], initial(space, False)[0]
    mask = space.mask()
    for n, s in enumerate(space.layers):
        v, wide = int(mask[n].sum()), OPS[K7_E6]
        bn = 2 * sum(bn_width(space, n, K7_E6).values())
        conv = op_params(wide, s) - bn
        assert SN.count_params(shared["layers"][n]) == conv + v * bn
        assert SN.count_params(separate["layers"][n]) == v * (conv + bn)
        own = sum(op_params(OPS[i], s) for i in np.flatnonzero(mask[n]))
        assert SN.count_params(shared["layers"][n]) < own / 2
    for part in ("stem", "head"):
        assert SN.count_params(shared[part]) == SN.count_params(separate[part])
    assert SN.count_params(shared) < 0.25 * SN.count_params(separate)


# ------------------------------------------------------------------------------------------------ mixed op

IMPLS = pytest.mark.parametrize("impl", ["own", "padded"])


@IMPLS
@LAYOUTS
def test_mixed_op_is_weighted_sum_of_candidates(shared, impl):
    """g^T v(x) against each candidate computed on its own (compact) parameters, with candidates computed at
    their own size (lax.switch over classes) and padded to the widest."""
    space, n = CHAIN, 0
    params, state, _, _ = net(space, shared)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((B, 7, 7, 4)), jnp.float32)
    assert space.layers[n].keeps_shape
    valid = np.flatnonzero(space.mask()[n])
    w = np.zeros(R, np.float32)
    w[valid] = np.random.default_rng(0).uniform(0.1, 1.0, len(valid))
    s = space.layers[n]

    def own(i):
        cp, cs = SN.extract(space, params, state, [i, 0, 0])
        return O.op_apply(cp["layers"][0], cs["layers"][0], x, OPS[i], s.stride, False)[0]

    outs = {int(i): np.asarray(own(int(i))) for i in valid}
    mixed = jax.jit(functools.partial(SN.mixed_op, impl=impl), static_argnums=(0, 1, 7))
    full, _ = mixed(space, n, params["layers"][n], state["layers"][n], jnp.asarray(w), None, x, False)
    np.testing.assert_allclose(np.asarray(full), sum(w[i] * outs[i] for i in valid), rtol=1e-4, atol=1e-4)
    pair = jnp.array([IDENTITY, 9], jnp.int32)
    two, _ = mixed(space, n, params["layers"][n], state["layers"][n], jnp.asarray(w), pair, x, False)
    np.testing.assert_allclose(np.asarray(two), w[IDENTITY] * outs[IDENTITY] + w[9] * outs[9], rtol=1e-4,
                               atol=1e-4)
    np.testing.assert_array_equal(outs[IDENTITY], np.asarray(x))


@pytest.mark.slow
@LAYOUTS
def test_own_size_and_padded_candidates_agree_in_train_mode(shared):
    """Training mode, layer 1 of the chain (stride 2, 6 MBConv classes) and layer 0 (13 candidates with identity
    and shortcuts): the two implementations give the same output, BN state and gradients with respect to the
    parameters, the gate weights and the input, for two sampled paths and for the full mixture."""
    space = CHAIN
    params, state, _, _ = net(space, shared)
    rng = np.random.default_rng(5)
    for n, size, pair in ((0, 7, [IDENTITY, 11]), (1, 7, [1, 10])):
        x = jnp.asarray(rng.standard_normal((B, size, size, 4)), jnp.float32)
        w = jnp.asarray(rng.uniform(0.1, 1.0, R), jnp.float32)
        for paths in (jnp.asarray(pair, jnp.int32), None):
            def f(p, w, x, impl):
                y, st = SN.mixed_op(space, n, p, state["layers"][n], w, paths, x, True, DW, impl)
                return jnp.sum(jnp.sin(y)), st

            got = {impl: jax.jit(jax.value_and_grad(functools.partial(f, impl=impl), argnums=(0, 1, 2),
                                                    has_aux=True))(params["layers"][n], w, x)
                   for impl in ("own", "padded")}
            (v_own, st_own), g_own = got["own"]
            (v_pad, st_pad), g_pad = got["padded"]
            np.testing.assert_allclose(float(v_own), float(v_pad), rtol=1e-5)
            lay = SN.layout(space, n)
            # BN entries a candidate uses: its own channels (padding is never read), none for the identity
            used = lambda a: np.asarray(a) * (lay.cmask if a.shape[1] == lay.mid_max else lay.mbconv[:, None])
            assert_trees_close(jax.tree_util.tree_map(used, st_own), jax.tree_util.tree_map(used, st_pad))
            assert_trees_close(g_own, g_pad)
            assert float(jnp.abs(g_own[0]["dw"]).sum()) > 0


def test_candidate_impl_rule_and_bad_value():
    assert SN.candidate_impl("auto", (2, 16, 16, 16)) == "own"
    assert SN.candidate_impl("auto", (2, 8, 8, 64)) == "own"
    assert SN.candidate_impl("auto", (512, 8, 8, 63)) == "padded"  # per image: the batch does not count
    assert SN.candidate_impl("auto", (2, 16, 16, 4)) == "padded"
    assert SN.candidate_impl("padded", (2, 64, 64, 4)) == "padded"
    assert SN.candidate_impl("auto", (2, 8, 8, 4), all_paths=True) == "own"
    assert SN.candidate_impl("padded", (2, 8, 8, 4), all_paths=True) == "padded"
    with pytest.raises(ValueError, match="'fast'"):
        SN.candidate_impl("fast", (2, 8, 8, 4))


@pytest.mark.slow
def test_auto_computes_all_paths_at_own_size_and_small_sampled_paths_padded():
    """mixed_op's "auto" traces the same program as "own" for the full mixture and as "padded" for sampled paths
    on the chain's 7 x 7 x 4 layer (below OWN_SIZE_MIN_ELEMENTS)."""
    space, n = CHAIN, 0
    params, state, _, _ = net(space, True)
    x = jnp.zeros((B, 7, 7, 4), jnp.float32)
    w = jnp.full((R,), 1.0 / R, jnp.float32)
    pair = jnp.array([IDENTITY, 9], jnp.int32)

    def program(impl, paths):
        f = lambda p, w, x: SN.mixed_op(space, n, p, state["layers"][n], w, paths, x, True, impl=impl)
        return str(jax.make_jaxpr(f)(params["layers"][n], w, x))

    assert program("auto", None) == program("own", None) != program("padded", None)
    assert program("auto", pair) == program("padded", pair) != program("own", pair)


@pytest.mark.slow
def test_mixed_op_train_accepts_numpy_leaves():
    """Eager, training mode, two computed paths, with NumPy state leaves (what a restored checkpoint or a host copy
    gives): the same output and BN state update as with jax arrays."""
    space, n = CHAIN, 0
    params, state, _, _ = net(space, True)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((B, 7, 7, 4)), jnp.float32)
    w = np.zeros(R, np.float32)
    w[[0, IDENTITY]] = 0.3, 0.7
    pair = np.array([0, IDENTITY], np.int32)
    st_np = state["layers"][n]
    st_jax = jax.tree_util.tree_map(jnp.asarray, st_np)
    y_jax, new_jax = SN.mixed_op(space, n, params["layers"][n], st_jax, w, pair, x, True, DW)
    y_np, new_np = SN.mixed_op(space, n, params["layers"][n], st_np, w, pair, x, True, DW)
    np.testing.assert_array_equal(np.asarray(y_np), np.asarray(y_jax))
    assert_trees_close(new_np, new_jax, rtol=0, atol=0)
    v = int(SN.layout(space, n).position[0])
    assert not np.array_equal(np.asarray(new_np["bn1"]["mean"][v]), st_np["bn1"]["mean"][v])


# ------------------------------------------------------------------------------------------------ compact net

@pytest.mark.slow
@SPACES
@LAYOUTS
def test_compact_network_equals_supernet_with_onehot_gates(space, shared):
    params, state, x, _ = net(space, shared)
    for ops in archs_of(space):
        gates = G.onehot_gates(jnp.asarray(ops), R)
        cp, cs = SN.extract(space, params, state, ops)
        # inference
        sup, _ = apply_jit(space, params, state, gates, x, train=False)
        com, _ = SN.compact_apply(space, ops, cp, cs, x, train=False, dw_impl=DW)
        np.testing.assert_allclose(np.asarray(sup), np.asarray(com), rtol=1e-4, atol=1e-4)
        # a training-mode step: batch statistics, and the running statistics it returns
        sup_t, sup_state = apply_jit(space, params, state, gates, x, train=True)
        sup_state = to_numpy(sup_state)
        com_t, com_state = SN.compact_apply(space, ops, cp, cs, x, train=True, dw_impl=DW)
        np.testing.assert_allclose(np.asarray(sup_t), np.asarray(com_t), rtol=1e-4, atol=1e-4)
        _, ext_state = SN.extract(space, params, sup_state, ops)
        assert_trees_close(ext_state, com_state)
        # candidates that did not run keep their statistics
        for n, i in enumerate(ops):
            pos = SN.layout(space, n).position
            others = [int(pos[j]) for j in np.flatnonzero(space.mask()[n]) if j != i]
            for before, after in zip(jax.tree_util.tree_leaves(state["layers"][n]),
                                     jax.tree_util.tree_leaves(sup_state["layers"][n])):
                np.testing.assert_array_equal(before[others], after[others])
        # inference after the step, with the updated statistics
        sup_e, _ = apply_jit(space, params, sup_state, gates, x, train=False)
        com_e, _ = SN.compact_apply(space, ops, cp, com_state, x, train=False, dw_impl=DW)
        np.testing.assert_allclose(np.asarray(sup_e), np.asarray(com_e), rtol=1e-4, atol=1e-4)


def hand_mesh_forward(cp, cs, ops, x):
    """The mesh written out: stem -> ue -> root -> (b1, b2 both on the root's output) -> mean -> agg -> head."""
    sp = MESH
    run = lambda n, h: O.op_apply(cp["layers"][n], cs["layers"][n], h, OPS[ops[n]], sp.layers[n].stride, False)[0]
    h, _ = O.conv_bn_apply(cp["stem"], cs["stem"], x, sp.stem_stride, False)
    root = run(1, run(0, h))
    b1, b2 = run(2, root), run(3, root)
    agg = run(4, (b1 + b2) / 2)
    return O.head_apply(cp["head"], cs["head"], agg, False)[0]


def test_mesh_supernet_matches_hand_wired_network():
    params, state, x, _ = net(MESH, True)
    for ops in archs_of(MESH, seed=1):
        cp, cs = SN.extract(MESH, params, state, ops)
        sup, _ = apply_jit(MESH, params, state, G.onehot_gates(jnp.asarray(ops), R), x, train=False)
        np.testing.assert_allclose(np.asarray(sup), np.asarray(hand_mesh_forward(cp, cs, ops, x)), rtol=1e-4,
                                   atol=1e-4)


def test_mesh_aggregator_averages_branches():
    params, state, x, _ = net(MESH, True)
    ops = (0, 1, 2, 5, 4)
    gates = G.onehot_gates(jnp.asarray(ops), R)
    base, _ = apply_jit(MESH, params, state, gates, x, train=False)
    # swapping the two branches (their ops and parameters) leaves a mean unchanged
    swapped_layers = list(params["layers"])
    swapped_layers[2], swapped_layers[3] = params["layers"][3], params["layers"][2]
    swapped_state = list(state["layers"])
    swapped_state[2], swapped_state[3] = state["layers"][3], state["layers"][2]
    sw_ops = (0, 1, 5, 2, 4)
    out, _ = apply_jit(MESH, {**params, "layers": tuple(swapped_layers)}, {**state, "layers": tuple(swapped_state)},
                       G.onehot_gates(jnp.asarray(sw_ops), R), x, train=False)
    np.testing.assert_allclose(np.asarray(out), np.asarray(base), rtol=1e-5, atol=1e-5)
    # changing one branch's weights changes the output (both branches are used)
    bumped = list(params["layers"])
    bumped[3] = jax.tree_util.tree_map(lambda a: a * 1.5, params["layers"][3])
    out, _ = apply_jit(MESH, {**params, "layers": tuple(bumped)}, state, gates, x, train=False)
    assert np.abs(np.asarray(out) - np.asarray(base)).max() > 1e-3


# ------------------------------------------------------------------------------------------------ gradients

def ce_of(space, params, state, gates, x, y, dw_impl="auto"):
    logits, new_state = SN.apply(space, params, state, gates, x, train=True, dw_impl=dw_impl)
    return cross_entropy(logits, y), new_state


@jax.jit
@chex.assert_max_traces(n=1)
def weight_step(params, state, gates, x, y):
    """One SGD step on the weights with the given (single-path) gates; returns the gradient too. Each layout
    traces it once (different shapes); the tests clear chex's trace counter first. XLA's depthwise convolution,
    as in arch_grad: the masks that keep gradients inside a candidate's window act before the convolution."""
    loss_fn = functools.partial(ce_of, CHAIN, dw_impl=DW)
    (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state, gates, x, y)
    params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    return params, new_state, loss, grads


@jax.jit
@chex.assert_max_traces(n=1)
def arch_grad(alpha, key, params, state, x, y):
    """dCE/dalpha through two-path binary gates sampled inside the step, and dCE/dg of the same backward pass
    (g = binary gates + a zero offset, so the offset's gradient is dL/dg). XLA's depthwise convolution: its
    gradient compiles in less than half the time of the CPU default's custom VJP, which is not under test here."""
    mask = jnp.asarray(CHAIN.mask())

    def loss(a, offset):
        g = G.two_path_gates(key, a, mask)
        return ce_of(CHAIN, params, state, G.Gates(g.weights + offset, g.paths), x, y, DW)[0]

    return jax.grad(loss, argnums=(0, 1))(alpha, jnp.zeros_like(alpha))


def eq5(alpha, paths, dl_dg):
    """Lemma 1 / eq. (5) on each layer's sampled pair with p renormalised over the pair; zero elsewhere."""
    out = np.zeros_like(alpha, dtype=np.float64)
    for n, pair in enumerate(paths):
        p = np.exp(alpha[n, pair] - alpha[n, pair].max())
        p /= p.sum()
        for a, i in enumerate(pair):
            out[n, i] = sum(dl_dg[n, j] * p[b] * ((a == b) - p[a]) for b, j in enumerate(pair))
    return out


def assert_grads_reach_only(space, n, i, g, shared):
    """Layer n's gradient when candidate i ran: BN rows of other candidates and BN channels beyond i's width are
    zero; conv weights (the shared set, or i's own row) are zero outside i's window, nonzero inside; other
    candidates' own conv rows are zero."""
    v = int(SN.layout(space, n).position[i])
    for name in BN:
        for key, leaf in g[name].items():
            assert np.all(np.delete(leaf, v, axis=0) == 0), (n, name, key)
            assert np.all(leaf[v, (bn_width(space, n, i)[name] if not OPS[i].is_identity else 0):] == 0)
    for name, win in conv_window(space, n, i).items():
        row = 0 if shared else v
        assert np.all(g[name][row][~win] == 0), (n, OPS[i].name, name)
        assert OPS[i].is_identity or np.abs(g[name][row][win]).max() > 0, (n, OPS[i].name, name)
        assert np.all(np.delete(g[name], row, axis=0) == 0), (n, name)


@pytest.mark.slow
@LAYOUTS
def test_weight_step_compiles_once_and_trains_only_the_sampled_candidates(shared):
    """Four single-path steps with changing gates, one trace. Each step's gradient reaches only the sampled
    candidate (assert_grads_reach_only); over all steps the conv weights move only inside the union of the sampled
    windows: in the shared layout, superkernel entries outside the widest sampled window stay untouched."""
    chex.clear_trace_counter()
    params, state, x, y = net(CHAIN, shared)
    start = params
    alpha, mask = jnp.zeros((CHAIN.num_layers, R)), jnp.asarray(CHAIN.mask())
    used = [{name: np.zeros(params["layers"][n][name].shape, bool) for name in CONV}
            for n in range(CHAIN.num_layers)]
    seen = set()
    for step in range(4):
        gates = G.single_path_gates(jax.random.PRNGKey(10 + step), alpha, mask)
        sampled = np.asarray(gates.paths)[:, 0]
        seen.add(tuple(sampled.tolist()))
        params, state, loss, grads = weight_step(params, state, gates, x, y)
        assert np.isfinite(float(loss))
        chex.assert_tree_all_finite(grads)
        grads = to_numpy(grads)
        for n, i in enumerate(sampled):
            assert_grads_reach_only(CHAIN, n, int(i), grads["layers"][n], shared)
            row = 0 if shared else int(SN.layout(CHAIN, n).position[i])
            for name, win in conv_window(CHAIN, n, int(i)).items():
                used[n][name][row] |= win
    assert len(seen) > 1, "the gates should have changed between steps"
    params = to_numpy(params)
    for n in range(CHAIN.num_layers):
        for name in CONV:
            moved = params["layers"][n][name] != start["layers"][n][name]
            assert np.all(~moved[~used[n][name]]), (n, name)
    if shared:  # not vacuous: some layer's sampled windows leave part of the superkernel out
        assert any((~used[n]["dw"][0]).any() and used[n]["dw"][0].any() for n in range(CHAIN.num_layers))


@pytest.mark.slow
def test_arch_gradient_through_two_path_gates_is_eq5_and_compiles_once():
    chex.clear_trace_counter()
    params, state, x, y = net(CHAIN, True)
    mask = CHAIN.mask()
    alpha = jnp.asarray(np.where(mask, np.random.default_rng(0).normal(0, 1, mask.shape), 0.0), jnp.float32)
    for step in range(3):
        key = jax.random.PRNGKey(20 + step)
        grad, dl_dg = (np.asarray(a) for a in arch_grad(alpha, key, params, state, x, y))
        gates = G.two_path_gates(key, alpha, jnp.asarray(mask))
        paths = np.asarray(gates.paths)
        assert np.isfinite(grad).all()
        sampled = np.zeros(mask.shape, bool)
        sampled[np.arange(CHAIN.num_layers)[:, None], paths] = True
        assert np.all(grad[~sampled] == 0) and np.abs(grad[sampled]).max() > 0
        np.testing.assert_allclose(grad, eq5(np.asarray(alpha), paths, dl_dg), rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------------ ops

@pytest.mark.slow
def test_train_batch_norm_vjp_equals_autodiff_of_the_formula():
    """The custom VJP of training-mode batch norm against autodiff of the textbook formula, with cotangents on
    all three outputs (normalised x, batch mean, batch variance), and against central differences."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((3, 4, 5, 6)) * 2 + 1, jnp.float32)
    scale, bias = (jnp.asarray(rng.standard_normal(6), jnp.float32) for _ in range(2))
    cy, cm, cv = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((3, 4, 5, 6), 6, 6))

    def reference(x, scale, bias):
        mean = jnp.mean(x, (0, 1, 2))
        var = jnp.mean(jnp.square(x - mean), (0, 1, 2))
        return (x - mean) / jnp.sqrt(var + O.BN_EPS) * scale + bias, mean, var

    def project(f):
        return lambda *a: (lambda y, m, v: jnp.sum(y * cy) + jnp.sum(m * cm) + jnp.sum(v * cv))(*f(*a))

    got = jax.grad(project(O._train_norm), argnums=(0, 1, 2))(x, scale, bias)
    want = jax.grad(project(reference), argnums=(0, 1, 2))(x, scale, bias)
    assert_trees_close(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(O._train_norm(x, scale, bias), reference(x, scale, bias)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    f64 = project(lambda *a: reference(*(jnp.asarray(t, jnp.float64) for t in a)))
    with jax.enable_x64(True):
        e = np.zeros(x.shape)
        e[1, 2, 3, 4] = 1e-4
        fd = (f64(np.asarray(x, np.float64) + e, scale, bias) - f64(np.asarray(x, np.float64) - e, scale, bias)) / 2e-4
    np.testing.assert_allclose(float(got[0][1, 2, 3, 4]), float(fd), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("act", [None, "relu6"])
@pytest.mark.parametrize("shape", [(3, 4, 5, 6), (16, 9, 9, 40)])
def test_native_fused_batch_norm_act_equals_the_formula(act, shape):
    """The native fused training batch norm + activation (several row chunks and threads for the larger shape)
    against autodiff of the textbook formula followed by the activation, cotangents on y, mean and variance."""
    rng = np.random.default_rng(len(shape) + shape[-1])
    c = shape[-1]
    x = jnp.asarray(rng.standard_normal(shape) * 2 + 1, jnp.float32)
    scale = jnp.asarray(rng.uniform(0.5, 3.0, c), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(c) * 3, jnp.float32)  # some outputs above 6 and below 0
    cy, cm, cv = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (shape, c, c))
    relu = (lambda y: jnp.clip(y, 0.0, 6.0)) if act else (lambda y: y)

    def reference(x, scale, bias):
        mean = jnp.mean(x, (0, 1, 2))
        var = jnp.mean(jnp.square(x - mean), (0, 1, 2))
        return relu((x - mean) / jnp.sqrt(var + O.BN_EPS) * scale + bias), mean, var

    def native(x, scale, bias):
        y, mean, var = O._native_norm_act(x.reshape(-1, c), scale, bias, O._ACTS[act])
        return y.reshape(shape), mean, var

    def project(f):
        return lambda *a: (lambda y, m, v: jnp.sum(y * cy) + jnp.sum(m * cm) + jnp.sum(v * cv))(*f(*a))

    for a, b in zip(jax.jit(native)(x, scale, bias), reference(x, scale, bias)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-5)
    got = jax.jit(jax.grad(project(native), argnums=(0, 1, 2)))(x, scale, bias)
    want = jax.grad(project(reference), argnums=(0, 1, 2))(x, scale, bias)
    assert_trees_close(got, want, rtol=1e-4, atol=5e-5)
    if act:
        y = np.asarray(native(x, scale, bias)[0])
        assert (y == 0).any() and (y == 6).any() and ((y > 0) & (y < 6)).any()  # all three ReLU6 regions


def test_native_batch_norm_is_bitwise_repeatable():
    """Channel sums in fixed blocks added in order: repeated runs give the same statistics and gradients."""
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.standard_normal((64, 16, 16, 24)) * 2 + 1, jnp.float32)
    scale, bias = jnp.ones(24), jnp.zeros(24)
    run = jax.jit(jax.value_and_grad(lambda x, s, b: jnp.sum(jnp.sin(O._native_norm_act(x, s, b, 1)[0]))
                                     + jnp.sum(O._native_norm_act(x, s, b, 1)[2]), argnums=(0, 1, 2)))
    outs = [jax.tree_util.tree_map(np.asarray, run(x.reshape(-1, 24), scale, bias)) for _ in range(6)]
    for o in outs[1:]:
        jax.tree_util.tree_map(np.testing.assert_array_equal, o, outs[0])


@pytest.mark.slow
def test_batch_norm_act_impls_agree_in_a_training_step_and_reject_bad_names():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((8, 6, 6, 24)), jnp.float32)
    params, state = O.bn_init(24)
    assert O.resolve_norm_impl("auto") == "native"
    loss = lambda impl: lambda x, p: (lambda y, st: jnp.sum(jnp.sin(y)) + jnp.sum(st["var"]))(
        *O.batch_norm_act(p, state, x, True, "relu6", impl))
    assert_trees_close(jax.grad(loss("native"), (0, 1))(x, params), jax.grad(loss("xla"), (0, 1))(x, params))
    ys = [O.batch_norm_act(params, state, x, True, "relu6", impl) for impl in ("native", "xla")]
    assert_trees_close(ys[0], ys[1])
    with pytest.raises(ValueError, match="'fast'"):
        O.batch_norm_act(params, state, x, True, None, "fast")
    with pytest.raises(ValueError, match="'gelu'"):
        O.batch_norm_act(params, state, x, True, "gelu")


@pytest.mark.slow
def test_pointwise_is_the_one_by_one_convolution():
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((2, 3, 5, 4)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 7)), jnp.float32)
    conv = lambda x, w: jax.lax.conv_general_dilated(x, w[None, None], (1, 1), "SAME",
                                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    np.testing.assert_allclose(np.asarray(O.pointwise(x, w)), np.asarray(conv(x, w)), rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
    assert_trees_close(jax.grad(loss(O.pointwise), (0, 1))(x, w), jax.grad(loss(conv), (0, 1))(x, w))


@pytest.mark.slow
def test_initial_weights_are_the_normal_draws_times_the_he_scale_bit_for_bit():
    """The init takes the He-scale product in NumPy (no executable per shape): the same bits as jnp's multiply."""
    key = jax.random.PRNGKey(7)
    for shape, fan_in in (((16, 96), 16), ((7, 7, 96), 49), ((3, 3, 1, 16), 9)):
        want = jax.random.normal(key, shape, jnp.float32) * jnp.sqrt(2.0 / fan_in)
        got = O._he(key, shape, fan_in)
        assert isinstance(got, jax.Array) and got.dtype == jnp.float32
        assert np.array_equal(np.asarray(got), np.asarray(want))
    # traceable as before: under eval_shape and jit the product stays traced
    op = OPS[1]
    shapes = jax.eval_shape(lambda k: O.mbconv_init(k, op, 16, 24), key)
    assert shapes[0]["expand"].shape == (16, 16 * op.expand)
    traced = jax.jit(lambda k: O._he(k, (16, 96), 16))(key)
    assert np.allclose(np.asarray(traced), np.asarray(O._he(key, (16, 96), 16)), rtol=1e-6, atol=1e-7)
    p, s = O.bn_init(5)
    assert [np.asarray(a).tolist() for a in (p["scale"], p["bias"], s["mean"], s["var"])] == \
        [[1.0] * 5, [0.0] * 5, [0.0] * 5, [1.0] * 5]


@pytest.mark.slow
def test_one_draw_takes_every_draw_at_once_with_the_bits_of_each_own_draw():
    """``ops.one_draw``: draws of any size (cut from one batched draw per power-of-two length) equal
    ``jax.random.normal(key, shape)`` bit for bit, scaled as ``_scaled_normal`` scales them; the batched program
    holds one draw per length, not one per shape."""
    shapes = [(1,), (5,), (3, 3, 1, 16), (24, 144), (2, 2, 2, 2, 2)]
    scales = [2.0 / (i + 1) for i in range(len(shapes))]

    def init(key):
        return [O._scaled_normal(k, s, c) for k, s, c in zip(jax.random.split(key, len(shapes)), shapes, scales)]

    key = jax.random.PRNGKey(7)
    batched = jax.jit(O.one_draw(init))(key)
    for k, s, c, got in zip(jax.random.split(key, len(shapes)), shapes, scales, batched):
        want = np.asarray(jax.random.normal(k, s, jnp.float32)) * np.sqrt(np.float32(c))
        assert np.asarray(got).tobytes() == want.tobytes(), s
    hlo = jax.jit(O.one_draw(init)).lower(key).as_text()
    assert hlo.count("erf_inv") == len({O._bucket(int(np.prod(s))) for s in shapes})


@pytest.mark.slow
@pytest.mark.parametrize("space, shared", [(MESH, True), (CHAIN, False)], ids=["mesh-shared", "chain-separate"])
def test_the_search_state_is_one_executable_with_the_bits_of_the_eager_initialisation(space, shared):
    """``train.init_search_state`` (one jitted program, draws batched) equals the same initialisation run eagerly
    op by op (``train._search_state``), every leaf bit for bit, in both layouts."""
    hp = train.SearchHParams(weight_lr=1.25e-3, arch_lr=2.5e-3)  # a program no other test compiled
    eager = train._search_state(jax.random.PRNGKey(5), space, hp, shared)
    compiled = []
    on = lambda event, duration, **kw: compiled.append(kw.get("fun_name")) if event.endswith(
        "backend_compile_duration") else None
    key = jax.random.PRNGKey(5)
    monitoring.register_event_duration_secs_listener(on)
    try:
        state = train.init_search_state(key, space, hp, shared)
    finally:
        monitoring.unregister_event_duration_listener(on)
    assert len(compiled) == 1, compiled
    leaves = lambda t: [np.asarray(jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a)
                        for a in jax.tree_util.tree_leaves(t)]
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(eager)
    for a, b in zip(leaves(state), leaves(eager)):
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes())
