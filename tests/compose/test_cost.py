"""The composed cost model (jmsnas.compose.cost): E[T], E[memory] and E[energy] with modules and bit widths equal
the enumeration of every (ops x weight bits x modules x transmitted bits) configuration of a tiny chain and a tiny
mesh, fixed or searched split; their gradients match finite differences; all off is today's cost model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas.compose import anysplit as A
from jmsnas.compose import choices as C
from jmsnas.compose import cost as K
from jmsnas.compose import terms as TT
from jmsnas.cost import energy as CE
from jmsnas.cost import latency as CL
from jmsnas.cost import memory as CM
from jmsnas.cost.memory import op_stored_params
from jmsnas.cost.tables import roofline_ms
from jmsnas.space import OPS, build_space, op_flops, op_memory_bytes, op_params
from jmsnas.topology import DeviceProfile, LinkProfile, make_topology
from spaces import chain_space, configs, mesh_ends_space, mesh_space, reference, setup

pytestmark = pytest.mark.usefixtures("fast_compiles")  # tiny programs: compile time dominates

_lat = jax.jit(K.latency, static_argnums=0)
_mem = jax.jit(K.memory, static_argnums=0)
_en = jax.jit(K.energy, static_argnums=0)
_best = jax.jit(K.best_assignment, static_argnums=0)


def _logits(space, ch, seed, support=None):
    """Random logits; ``support`` (int per layer) keeps that many random valid ops per layer, the rest at -1e9."""
    rng = np.random.default_rng(seed)
    shapes = C.logits_shapes(space, ch)
    lg = [rng.normal(size=s).astype(np.float32) for s in shapes]
    if support:
        mask = space.mask()
        for n in range(space.num_layers):
            keep = rng.choice(np.flatnonzero(mask[n]), support, replace=False)
            lg[0][n, np.setdiff1d(np.arange(mask.shape[1]), keep)] = -1e9
    return C.ChoiceProbs(*(jnp.asarray(x) for x in lg))


def _enumerate(space, probs):
    """Every configuration with a non-zero probability: (ops, wb, mod, ab) index arrays and their probabilities."""
    p = [np.asarray(x, np.float64) for x in probs]
    n, links = space.num_layers, len(space.topology.links)
    sup = [list(np.flatnonzero(p[0][i] > 0)) for i in range(n)] + [list(range(p[1].shape[1]))] * n \
        + [list(range(p[2].shape[1]))] * links + [list(range(p[3].shape[1]))] * links
    cfg = configs(sup)
    ops, wb, mod, ab = np.split(cfg, np.cumsum([n, n, links]), axis=1)
    w = np.ones(len(cfg))
    for g, idx in zip(p, (ops, wb, mod, ab)):
        w *= np.prod(g[np.arange(idx.shape[1]), idx], axis=1)
    return (ops, wb, mod, ab), w


def test_terms_hand_count():
    space = chain_space()
    table, ch, terms, _ = setup(space, modules=(2,), weight_bits=(4, 32), act_bits=(8, 32))
    ue = space.topology.devices[0]
    # boundary 2 = layer 1's output on the UE: 8x8x8; a reduction 2 sends 4 channels, at 8 bits with its range
    assert float(terms.wire_bytes[2, 0, 1]) == 8 * 8 * 8 * 4 and float(terms.wire_bytes[2, 1, 0]) == 8 * 8 * 4 + 8
    np.testing.assert_allclose(float(terms.send_ms[0, 2, 1]), roofline_ms(2 * 64 * 8 * 4, 4 * (64 * 12 + 32), ue),
                               rtol=1e-6)
    assert float(terms.send_weight[2, 1]) == 4 * 8 * 4 and float(terms.send_act[2, 1]) == 4 * 64 * 12
    assert float(terms.send_ms[0, 2, 0]) == 0 and float(terms.wire_bytes[0, 0, 1]) == 8 * 8 * 8 * 4  # the stem's
    o, s = OPS[0], space.layers[0]
    fp = op_memory_bytes(o, s)
    np.testing.assert_allclose(float(terms.layer_ms[0, 0, 0, 0]),
                               roofline_ms(op_flops(o, s), fp - 4 * op_params(o, s) + op_params(o, s) / 2, ue), rtol=1e-6)
    assert float(terms.layer_ms[0, 0, 0, 1]) == float(table.compute_ms[0, 0, 0])  # float weights: the table's
    assert float(terms.layer_ms[0, 0, 0, 0]) < float(table.compute_ms[0, 0, 0])  # the UE is memory bound here
    assert float(terms.weight_bytes[0, 0, 0, 0]) == -(-op_stored_params(o, s) * 4 // 8)
    assert float(terms.weight_bytes[1, 0, 0, 0]) == 4 * op_stored_params(o, s)  # the cloud does not quantize
    assert float(terms.layer_ms[1, 0, 0, 0]) == float(table.compute_ms[1, 0, 0])


@pytest.mark.parametrize("deployed", [False, True], ids=["paper_terms", "deployed_terms"])
@pytest.mark.parametrize("make", [chain_space, mesh_space])
def test_all_off_is_todays_cost_model(make, deployed):
    space = make()
    table, ch, terms, mem = setup(space, modules=(), weight_bits=(), act_bits=(), deployed=deployed)
    assert ch.off
    probs = C.probs_from_logits(space, ch, _logits(space, ch, 0))
    today = jax.jit(lambda space, p, a: (CL.latency(space, table, p, a), CM.device_memory(space, mem, table, p, a),
                                         CE.energy(space, table, p, a)), static_argnums=0)
    split = CL.best_assignment(space, table, probs.ops)
    np.testing.assert_array_equal(_best(space, table, terms, probs), split)
    for a in (None, split):
        for got, want in zip((_lat(space, table, terms, probs, a), _mem(space, mem, table, terms, probs, a),
                              _en(space, table, terms, probs, a)), today(space, probs.ops, a)):
            for x, y in zip(got, want):
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)


def _check_against(space, table, ch, terms, mem, probs, a):
    """Closed form == enumeration (exact parts) under assignment ``a``; returns the enumerated reference and weights."""
    (ops, wb, mod, ab), w = _enumerate(space, probs)
    ref = reference(space, table, terms, mem, ops, wb, mod, ab, a)
    lat, m, e = _lat(space, table, terms, probs, a), _mem(space, mem, table, terms, probs, a), \
        _en(space, table, terms, probs, a)
    np.testing.assert_allclose(np.asarray(lat.per_device), w @ ref["per_device"], rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lat.per_link), w @ ref["per_link"], rtol=2e-5)
    np.testing.assert_allclose(np.asarray(m.total), w @ ref["memory"], rtol=2e-5)
    np.testing.assert_allclose(np.asarray(e.per_device), w @ ref["energy"], rtol=2e-5)
    for i in np.random.default_rng(1).choice(len(w), 5, replace=False):  # one configuration: its exact cost
        one = C.onehot(space, ch, C.Config(ops[i], wb[i], mod[i], ab[i]))
        np.testing.assert_allclose(float(_lat(space, table, terms, one, a).total), ref["T"][i], rtol=1e-6)
        np.testing.assert_allclose(np.asarray(_mem(space, mem, table, terms, one, a).total), ref["memory"][i], rtol=1e-6)
        np.testing.assert_allclose(np.asarray(_en(space, table, terms, one, a).per_device), ref["energy"][i], rtol=1e-6)
    return ref, w, lat


@pytest.mark.parametrize("deployed", [False, True], ids=["paper_terms", "deployed_terms"])
def test_chain_expectations_equal_enumeration_fixed_and_searched_split(deployed):
    """With a deployed table (a part's call cost, a link's hand-off a + b * bytes) the same closed form holds: the
    hand-off is a function of the bytes each module and bit width puts on the wire, enumerated in the reference."""
    space = chain_space((2, 1))
    table, ch, terms, mem = setup(space, deployed=deployed)
    probs = C.probs_from_logits(space, ch, _logits(space, ch, 3))
    expected = {}
    for a in ([0, 0, 1], [0, 1, 1], [1, 1, 1], [0, 0, 0]):  # every split of 3 layers over the 2 devices
        ref, w, lat = _check_against(space, table, ch, terms, mem, probs, np.asarray(a, np.int32))
        np.testing.assert_allclose(float(lat.total), w @ ref["T"], rtol=2e-5)  # eq. (1): a sum, exact
        expected[tuple(a)] = w @ ref["T"]
    best = tuple(np.asarray(_best(space, table, terms, probs)).tolist())
    assert expected[best] <= min(expected.values()) * (1 + 1e-6), (best, expected)
    assert len({round(v, 6) for v in expected.values()}) > 1  # the split matters here


def test_mesh_expectations_equal_enumeration():
    space = mesh_space()
    table, ch, terms, mem = setup(space)
    probs = C.probs_from_logits(space, ch, _logits(space, ch, 5, support=2))
    ref, w, lat = _check_against(space, table, ch, terms, mem, probs, space.layer_devices())
    # eq. (2) takes the max over branches of expected branch terms (each branch term's expectation exact)
    topo, d, l = space.topology, w @ ref["per_device"], w @ ref["per_link"]
    agg = topo.post[0]
    branch = [d[topo.root] + l[topo.link_index(topo.root, b)] + d[b] + l[topo.link_index(b, agg)]
              for b in topo.branches]
    np.testing.assert_allclose(float(lat.total), d[agg] + max(branch), rtol=2e-5)
    assert float(lat.total) <= w @ ref["T"] * (1 + 1e-6)  # Jensen: a lower bound of E[max]
    np.testing.assert_array_equal(_best(space, table, terms, probs), space.layer_devices())  # nothing to split


def test_mesh_expectations_equal_enumeration_under_every_split():
    """A mesh whose chains before the fork and after the merge re-split (the root or the aggregator may hold no
    layer and relay): under each of its splits E[T] (eq. (2)), E[memory] and E[energy] with modules and bits
    equal the enumeration, and the DP's split is the least E[T] of them."""
    space = mesh_ends_space()
    table, ch, terms, mem = setup(space, modules=(2,), weight_bits=(), act_bits=(4, 32))
    probs = C.probs_from_logits(space, ch, _logits(space, ch, 6, support=2))
    all_splits = list(A.splits(space))
    assert len(all_splits) == 9  # 2 layers over (p0, root) and 2 over (agg, q0), each contiguous: 3 x 3
    topo, agg, all_t = space.topology, space.topology.post[0], {}
    for a in all_splits:
        ref, w, lat = _check_against(space, table, ch, terms, mem, probs, a)
        d, l = w @ ref["per_device"], w @ ref["per_link"]
        branch = [d[topo.root] + l[topo.link_index(topo.root, b)] + d[b] + l[topo.link_index(b, agg)]
                  for b in topo.branches]
        chains = sum(d[m] for m in list(topo.pre) + list(topo.post)) + l[topo.link_index(topo.pre[0], topo.root)] \
            + l[topo.link_index(agg, topo.post[1])]
        np.testing.assert_allclose(float(lat.total), chains + max(branch), rtol=2e-5)
        all_t[tuple(a.tolist())] = float(lat.total)
    best = tuple(np.asarray(_best(space, table, terms, probs)).tolist())
    assert best in all_t and all_t[best] <= min(all_t.values()) * (1 + 1e-6)
    assert len({round(v, 5) for v in all_t.values()}) > 1


@pytest.mark.parametrize("make", [chain_space, mesh_space])
def test_gradients_match_finite_differences(make):
    space = make()
    table, ch, terms, mem = setup(space)
    logits = _logits(space, ch, 7)
    a = _best(space, table, terms, C.probs_from_logits(space, ch, logits))

    def f(lg):
        probs = C.probs_from_logits(space, ch, lg)
        return (K.latency(space, table, terms, probs, a).total
                + jnp.sum(K.memory(space, mem, table, terms, probs, a).total) / 1e4
                + K.energy(space, table, terms, probs, a).total)

    f = jax.jit(f)
    grad = jax.grad(f)(logits)
    rng = np.random.default_rng(0)
    direction = C.ChoiceProbs(*(jnp.asarray(rng.normal(size=x.shape), jnp.float32) for x in logits))
    eps = 1e-2
    step = lambda s: C.ChoiceProbs(*(x + s * v for x, v in zip(logits, direction)))
    fd = (float(f(step(eps))) - float(f(step(-eps)))) / (2 * eps)
    an = sum(float(jnp.sum(jnp.where(jnp.isfinite(g), g * v, 0.0))) for g, v in zip(grad, direction))
    assert abs(an) > 1e-3
    np.testing.assert_allclose(an, fd, rtol=2e-2)
    for g in grad:  # every group of choices moves the cost
        assert float(jnp.max(jnp.abs(g))) > 0


def _mesh_with_segments():
    names = ["p0", "root", "b0", "b1", "q0", "q1"]
    devs = [DeviceProfile(n, p, 1e9, mem_bandwidth_gbs=0.3) for n, p in zip(names, (1.0, 2.0, 3.0, 3.0, 8.0, 40.0))]
    pairs = [("p0", "root"), ("root", "b0"), ("root", "b1"), ("b0", "q0"), ("b1", "q0"), ("q0", "q1")]
    links = [LinkProfile(a, b, bw, 0.1, False) for (a, b), bw in zip(pairs, (3.0, 5.0, 4.0, 6.0, 2.0, 9.0))]
    topo = make_topology("m", devs, links, (2, 1, 1, 1, 2, 1))
    return build_space(topo, image_size=8, in_channels=1, num_classes=10, device_channels=(8, 8, 12, 12, 12, 16),
                       device_strides=(1,) * 6, stem_channels=8, head_channels=8)


@pytest.mark.parametrize("make", [lambda: chain_space((2, 2)), _mesh_with_segments])
def test_searched_split_is_the_least_expected_latency_of_every_split(make):
    """The DP's split against every split of the family (each split's E[T] being the enumeration-checked closed
    form above): the least E[T], on a chain and on a mesh with devices before the fork and after the merge."""
    space = make()
    table, ch, terms, mem = setup(space, modules=(2, 4), weight_bits=(4, 8, 32), act_bits=(4, 32))
    for seed in range(3):
        probs = C.probs_from_logits(space, ch, _logits(space, ch, seed))
        all_t = {tuple(a.tolist()): float(_lat(space, table, terms, probs, jnp.asarray(a)).total)
                 for a in A.splits(space)}
        best = _best(space, table, terms, probs)
        assert float(_lat(space, table, terms, probs, best).total) <= min(all_t.values()) * (1 + 1e-6)
        assert tuple(np.asarray(best).tolist()) in all_t
        assert len({round(v, 5) for v in all_t.values()}) > 1


def relay_chain():
    """ue -> relay -> cloud, one layer each; the input image (8x8x1) is smaller than any tensor inside."""
    devs = [DeviceProfile("ue", 1.0, 1e9, mem_bandwidth_gbs=0.1, active_power_w=2.0),
            DeviceProfile("relay", 4.0, 1e9, mem_bandwidth_gbs=0.5, active_power_w=3.0),
            DeviceProfile("cloud", 50.0, 1e9, active_power_w=30.0)]
    links = [LinkProfile("ue", "relay", 2.0, 0.2, True, 3.0, 0.5), LinkProfile("relay", "cloud", 5.0, 0.1, True,
                                                                                 2.0, 0.5)]
    topo = make_topology("r", devs, links, (1, 1, 1))
    return build_space(topo, image_size=8, in_channels=1, num_classes=10, device_channels=(8, 12, 12),
                       device_strides=(1, 1, 1), stem_channels=8, head_channels=8)


@pytest.mark.parametrize("deployed", [False, True], ids=["paper_terms", "deployed_terms"])
def test_sending_the_input_equals_enumeration_under_every_split(deployed):
    """``send_input``: the stem is one more item of the split; under every split (the stem on any device, the
    links before it carrying the image with their module and bits) the closed form equals the enumeration, and
    the DP's split is the least E[T] of them all."""
    space = relay_chain()
    table, ch, terms, mem = setup(space, modules=(2,), weight_bits=(4, 32), act_bits=(4, 32), deployed=deployed,
                                  send_input=True)
    assert terms.wire_bytes.shape[0] == space.num_layers + 2
    assert float(terms.wire_bytes[-1, 0, 0]) == 8 * 8 / 2 + 8  # the image at 4 bits, and its range
    all_splits = list(A.splits(space, send_input=True))
    assert len(all_splits) == 15  # the stem and 3 layers contiguous over 3 devices: C(6, 2)
    assert {int(a[-1]) for a in all_splits} == {0, 1, 2}
    probs = C.probs_from_logits(space, ch, _logits(space, ch, 4, support=2))
    all_t = {}
    for a in all_splits:
        ref, w, lat = _check_against(space, table, ch, terms, mem, probs, a)
        np.testing.assert_allclose(float(lat.total), w @ ref["T"], rtol=2e-5)
        all_t[tuple(a.tolist())] = float(_lat(space, table, terms, probs, jnp.asarray(a)).total)
    best = tuple(np.asarray(_best(space, table, terms, probs)).tolist())
    assert best in all_t and all_t[best] <= min(all_t.values()) * (1 + 1e-6)
    first = [t for a, t in all_t.items() if a[-1] == 0]  # the stem on the UE: today's splits
    assert min(all_t.values()) < min(first)  # here sending the 64-byte image is faster than any tensor inside


def test_choices_are_validated_in_one_line_naming_the_value():
    topo = chain_space().topology
    for kwargs, bad in ((dict(modules=[1]), "1"), (dict(modules=[2, 2]), "[2, 2]"), (dict(modules=["x"]), "'x'"),
                        (dict(weight_bits=[3, 9]), "9"), (dict(act_bits=[0]), "0"), (dict(act_bits=[True]), "True"),
                        (dict(quantize=[True]), "[True]"), (dict(weight_bits=5), "5")):
        with pytest.raises(ValueError) as e:
            C.make_choices(topo, **kwargs)
        assert bad in str(e.value) and "\n" not in str(e.value), (kwargs, str(e.value))
    ch = C.make_choices(topo, weight_bits=[32], act_bits=[])
    assert ch.off and ch.quantize == (True, False)  # the last device stays float by default


def test_a_measured_device_keeps_its_latency_at_every_bit_width():
    space = chain_space()
    table, ch, _, _ = setup(space, modules=(), weight_bits=(4, 32), act_bits=(), quantize=(True, True))
    lm, ref = np.asarray(TT.build_terms(space, table, ch).layer_ms), np.asarray(table.compute_ms)
    assert np.any(lm[0, ..., 0] < ref[0])  # the memory-bound UE's roofline moves with the weights' bits
    terms = TT.build_terms(space, table, ch, roofline_devices=(1,))  # the UE's row measured: no bit dimension
    lm = np.asarray(terms.layer_ms)
    np.testing.assert_array_equal(lm[0, ..., 0], ref[0])
    np.testing.assert_array_equal(lm[0, ..., 1], ref[0])
    assert np.any(np.asarray(terms.weight_bytes)[0, ..., 0] < np.asarray(terms.weight_bytes)[0, ..., 1])  # stored
