"""The derived composed network (jmsnas.compose.network) and its deployed parts (jmsnas.deploy.composed).

Tiny spaces (8x8 images, 8-12 channels) with random weights and non-trivial batch-norm statistics: all off is the
compact network bit for bit; weights on a device that does not quantize are untouched; the exported parts (packed
kernels, split modules, packed transmitted tensors) compute composed_apply within 1e-5, in one process (chain with
a relay device, mesh) and through ``jmsnas pipeline --check`` (real processes and sockets, chain and mesh); every
link carries exactly the bytes compose.terms predicts; broken run directories and part files end with one line."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas import cli, supernet
from jmsnas import space as S
from jmsnas.compose import choices as C
from jmsnas.compose import network as N
from jmsnas.compose import terms as TT
from jmsnas.cost.tables import analytic_table
from jmsnas.deploy import composed as D
from jmsnas.deploy.runtime import DeployError, load_part
from jmsnas.quant.packing import frame_bytes, packed_bytes
from jmsnas.quant.quantizers import fake_quant_weight
from jmsnas.space import OP_NAMES, build_space
from jmsnas.topology import DeviceProfile, LinkProfile, make_topology

from spaces import chain_space, mesh_ends_space, mesh_space

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile time dominates: 139 -> 114 s of test time, AVX2 EPYC, 2 cores


def chain3():
    devs = [DeviceProfile(n, p, 1e9) for n, p in (("ue", 2.0), ("sbs", 5.0), ("mbs", 50.0))]
    links = [LinkProfile("ue", "sbs", 20.0, 0.2), LinkProfile("sbs", "mbs", 50.0, 0.1)]
    topo = make_topology("c3", devs, links, (1, 1, 1))
    return build_space(topo, image_size=8, in_channels=1, num_classes=10, device_channels=(8, 12, 12),
                       device_strides=(1, 1, 1), stem_channels=8, head_channels=8)


def compact(space, seed=0):
    """(ops, params, state) of a random compact network with drawn batch-norm statistics."""
    rng = np.random.default_rng(seed)
    mask = space.mask()
    ops = tuple(int(rng.choice(np.flatnonzero(mask[n] & (np.arange(mask.shape[1]) > 0)))) for n in range(len(mask)))
    params, state = supernet.init(jax.random.PRNGKey(seed), space)
    cp, cs = supernet.extract(space, params, state, ops)
    draw = lambda path, a: (np.abs(rng.normal(1.0, 0.3, a.shape)) + 0.1 if str(getattr(path[-1], "key", "")) == "var"
                            else rng.normal(0.0, 0.3, a.shape)).astype(np.float32)
    return ops, cp, jax.tree_util.tree_map_with_path(draw, cs)


def images(n=4, seed=1):
    return np.random.default_rng(seed).standard_normal((n, 8, 8, 1)).astype(np.float32)


def write_run(d, space, ch, cfg, a, cp, cs, mp):
    N.write_parts(d, space, cfg, a, cp, cs, mp)
    names = space.topology.device_names
    result = {"flow": "search", "topology": space.topology.name, "dataset": "digits", "seed": 0, "time": 0.0,
              "space": S.to_dict(space), "compose": N.to_result(space, ch, cfg),
              "architecture": [{"layer": n, "op": OP_NAMES[int(cfg.ops[n])], "device": names[int(a[n])]}
                               for n in range(space.num_layers)]}
    if len(a) > space.num_layers:  # a split that sends the input: the stem's device, as the composed search writes it
        result["compose"]["stem_device"] = names[int(a[-1])]
    with open(os.path.join(d, "result.json"), "w") as f:
        json.dump(result, f)
    return d


def test_all_off_is_the_compact_network_bit_for_bit():
    for space in (chain_space(), mesh_space()):
        ops, cp, cs = compact(space)
        ch = C.make_choices(space.topology)
        L, n = len(space.topology.links), space.num_layers
        cfg = C.Config(np.array(ops), np.zeros(n, int), np.zeros(L, int), np.zeros(L, int))
        x = images()
        want = jax.jit(lambda p, s, x: supernet.compact_apply(space, ops, p, s, x, train=False)[0])(cp, cs, x)
        got = jax.jit(lambda p, s, x: N.composed_apply(space, ch, cfg, None, p, s, {}, x)[0])(cp, cs, x)
        assert np.array_equal(np.asarray(want), np.asarray(got)), space.topology.name


def test_only_quantizing_devices_quantize_their_kernels():
    space = chain_space()
    ops, cp, cs = compact(space)
    ch = C.make_choices(space.topology, weight_bits=(3, 32))  # default: the UE quantizes, the cloud does not
    assert ch.quantize == (True, False)
    cfg = C.Config(np.array(ops), np.zeros(3, int), np.zeros(1, int), np.zeros(1, int))  # 3 bits everywhere
    assert N.layer_bits(space, ch, cfg) == (3, 3, 32)
    by_hand = dict(cp, layers=tuple({k: v if isinstance(v, dict) or n == 2 else fake_quant_weight(v, 3)
                                     for k, v in cp["layers"][n].items()} for n in range(3)))
    x = images()
    want = supernet.compact_apply(space, ops, by_hand, cs, x, train=False)[0]
    got = N.composed_apply(space, ch, cfg, None, cp, cs, {}, x)[0]
    np.testing.assert_array_equal(np.asarray(want), np.asarray(got))
    plain = supernet.compact_apply(space, ops, cp, cs, x, train=False)[0]
    assert not np.array_equal(np.asarray(want), np.asarray(plain))
    ch_none = C.make_choices(space.topology, weight_bits=(3, 32), quantize=(False, False))
    np.testing.assert_array_equal(np.asarray(N.composed_apply(space, ch_none, cfg, None, cp, cs, {}, x)[0]),
                                  np.asarray(plain))


def test_modules_and_bits_have_straight_through_gradients():
    space = chain_space()
    ops, cp, cs = compact(space)
    ch = C.make_choices(space.topology, modules=(2,), weight_bits=(4,), act_bits=(4,))
    mp = N.init_modules(jax.random.PRNGKey(3), space, ch)
    assert sorted(mp) == ["0", "1", "2", "3"] and mp["2"]["reduce"].shape == (1, 1, 8, 4)
    cfg = C.Config(np.array(ops), np.zeros(3, int), np.ones(1, int), np.zeros(1, int))
    loss = lambda p, m: jnp.sum(N.composed_apply(space, ch, cfg, None, p, cs, m, images(), train=True)[0] ** 2)
    gp, gm = jax.grad(loss, argnums=(0, 1))(cp, mp)
    assert float(jnp.abs(gm["2"]["reduce"]).sum()) > 0 and float(jnp.abs(gm["2"]["recover"]).sum()) > 0
    assert float(jnp.abs(gm["1"]["reduce"]).sum()) == 0  # boundary 1 is crossed by no link
    assert float(jnp.abs(gp["layers"][0]["expand"]).sum()) > 0  # through the 4-bit kernels and the 4-bit wire


@pytest.mark.parametrize("bits", [1, 3, 4, 8, 16, 32])
def test_the_wire_format_decodes_to_what_composed_apply_computes(bits):
    """encode -> bytes -> decode is wire_values bit for bit, in frame_bytes bytes: at 1..8 bits the range and
    2^bits levels between the batch's min and max."""
    z = jnp.asarray(np.random.default_rng(bits).normal(0.5, 2.0, (3, 4, 4, 5)).astype(np.float32))
    wire = D.encode(z, bits)
    assert wire.dtype == jnp.uint8 and wire.shape == (frame_bytes(4 * 4 * 5, bits, 3),)
    got, want = D.decode(wire, bits, 3, (4, 4, 5)), N.wire_values(z, bits)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if bits <= 8:
        assert len(np.unique(np.asarray(got))) <= 2 ** bits
        assert float(got.min()) == float(z.min()) and abs(float(got.max()) - float(z.max())) <= 1e-5
    else:
        err = np.abs(np.asarray(got) - np.asarray(z))  # float16: half an ulp, 2^-11 of the value
        assert np.all(err <= (2.0 ** -11 * np.abs(np.asarray(z)) if bits == 16 else 0.0))


def _chain_run(tmp, bits=(4, 16)):
    """3-device chain, the SBS a relay (layers 0, 1 on the UE, 2 on the MBS): both links cross boundary 2 with other
    modules (r 2, 4) and bits; the UE and SBS quantize at 4 bits."""
    space = chain3()
    ops, cp, cs = compact(space, seed=2)
    ch = C.make_choices(space.topology, modules=(2, 4), weight_bits=(4, 32), act_bits=tuple(sorted(set(bits))))
    mp = N.init_modules(jax.random.PRNGKey(4), space, ch)
    a = np.array([0, 0, 2])
    cfg = C.Config(np.array(ops), np.zeros(3, int), np.array([1, 2]),
                   np.array([ch.act_bits.index(b) for b in bits]))
    return write_run(str(tmp), space, ch, cfg, a, cp, cs, mp), space, ch, cfg, a


def test_chain_parts_with_a_relay_compute_composed_apply(tmp_path):
    d, space, ch, cfg, a = _chain_run(tmp_path / "run")
    plan = N.cuts(space, ch, cfg, a)
    assert [(c.boundary, c.r, c.d, c.bits) for c in plan] == [(2, 2, 6, 4), (2, 4, 3, 16)]
    m = D.export_composed(d, batch=2)
    terms = TT.build_terms(space, analytic_table(space), ch)
    for c, link in zip(plan, m["links"]):  # a frame of 2 images: twice the codes, one range
        per_image = int(terms.wire_bytes[c.boundary, 1 + ch.modules.index(c.r), ch.act_bits.index(c.bits)])
        assert link["wire"]["bytes_per_image"] == per_image
        assert link["bytes"] == 2 * (per_image - link["wire"]["range_bytes"]) + link["wire"]["range_bytes"]
    assert m["links"][0]["bytes"] == 8 + 2 * packed_bytes(8 * 8 * 6, 4) and m["links"][1]["bytes"] == 2 * 64 * 3 * 2
    ue = dict(np.load(os.path.join(d, "export", "ue.npz")))
    packed, scale = ue["params/layers/0/expand/w_packed"], ue["params/layers/0/expand/w_scale"]  # at 4 bits
    assert packed.dtype == np.uint8 and packed.size == packed_bytes(space.layers[0].in_ch * scale.size, 4)
    assert ue["params/links/0/reduce"].shape == (1, 1, 12, 6)
    mbs = dict(np.load(os.path.join(d, "export", "mbs.npz")))
    assert not any("w_packed" in k for k in mbs) and mbs["params/links/1/recover"].shape == (1, 1, 3, 12)
    parts = {dev: load_part(os.path.join(d, "export"), dev) for dev in m["order"]}
    x = images(4)
    got = np.concatenate([parts["mbs"](parts["sbs"](parts["ue"](x[i:i + 2]))) for i in (0, 2)])
    want = D.whole_network(d, 2)(x)
    assert np.max(np.abs(got - want)) <= 1e-5
    assert np.max(np.abs(D.whole_network(d, 4)(x) - want)) > 0  # the range is the batch's: another batch, another net


def _input_run(tmp, input_bits=8):
    """3-device chain whose UE runs nothing: it sends the 8x8x1 image (``input_bits``; the module chosen there, r 2,
    has nothing to reduce in one channel: none) to the SBS, which runs the stem and layers 0, 1 and sends layer 1's
    output to the MBS (r 2, 4 bits)."""
    space = chain3()
    ops, cp, cs = compact(space, seed=6)
    ch = C.make_choices(space.topology, modules=(2,), weight_bits=(4, 32), act_bits=tuple(sorted({input_bits, 4})),
                        send_input=True)
    mp = N.init_modules(jax.random.PRNGKey(7), space, ch)
    a = np.array([1, 1, 2, 1])  # the layers' devices, then the stem's
    cfg = C.Config(np.array(ops), np.zeros(3, int), np.array([1, 1]),
                   np.array([ch.act_bits.index(input_bits), ch.act_bits.index(4)]))
    return write_run(str(tmp), space, ch, cfg, a, cp, cs, mp), space, ch, cfg, a


def test_parts_that_send_the_input_compute_composed_apply(tmp_path):
    """The stem moves to the SBS: the UE's part sends the image at its bits, the SBS's runs the stem on what
    arrives; the parts compute composed_apply within 1e-5 and the input link carries the predicted bytes."""
    d, space, ch, cfg, a = _input_run(tmp_path / "run")
    plan = N.cuts(space, ch, cfg, a)
    assert [(c.boundary, c.r, c.c, c.d, c.bits) for c in plan] == [(4, 0, 1, 1, 8), (2, 2, 12, 6, 4)]
    m = D.export_composed(d, batch=1)
    assert [m["parts"][dev]["stem"] for dev in ("ue", "sbs", "mbs")] == [False, True, False]
    assert m["parts"]["ue"]["layers"] == [] and m["links"][0]["bytes"] == 8 + 64
    terms = TT.build_terms(space, analytic_table(space), ch)
    j = TT.input_boundary(space)
    assert int(terms.wire_bytes[j, 0, ch.act_bits.index(8)]) == int(terms.wire_bytes[j, 1, ch.act_bits.index(8)]) \
        == 8 + 64 and float(terms.send_ms[0, j, 1]) == 0.0  # the module does not reduce one channel: none
    assert "4" not in N.init_modules(jax.random.PRNGKey(0), space, ch)
    sbs = dict(np.load(os.path.join(d, "export", "sbs.npz")))
    assert any(k.startswith("params/stem/") for k in sbs)
    parts = {dev: load_part(os.path.join(d, "export"), dev) for dev in m["order"]}
    x = images(3)
    got = np.concatenate([parts["mbs"](parts["sbs"](parts["ue"](x[i:i + 1]))) for i in range(3)])
    want = D.whole_network(d, 1)(x)
    assert np.max(np.abs(got - want)) <= 1e-5


def test_where_the_stem_runs_does_not_change_a_float_network():
    """With float32 on the wire, sending the image and running the stem on the SBS computes what running it on the
    UE computes; at 4 bits the image's quantization changes the logits."""
    space = chain3()
    ops, cp, cs = compact(space, seed=6)
    ch = C.make_choices(space.topology, act_bits=(4, 32), send_input=True)
    x = images(3)
    run = lambda a, bits0: np.asarray(N.composed_apply(space, ch, C.Config(np.array(ops), np.zeros(3, int),
                                                                             np.zeros(2, int), np.array([bits0, 1])),
                                                       np.array(a), cp, cs, {}, x)[0])
    on_ue, on_sbs = run([1, 1, 2], 1), run([1, 1, 2, 1], 1)
    np.testing.assert_allclose(on_sbs, on_ue, rtol=1e-6, atol=1e-6)
    assert np.max(np.abs(run([1, 1, 2, 1], 0) - on_ue)) > 1e-4
    with pytest.raises(ValueError, match="optionally the stem's last"):
        N.composed_apply(space, ch, C.Config(np.array(ops), np.zeros(3, int), np.zeros(2, int), np.ones(2, int)),
                         np.array([1, 1, 2, 1, 0]), cp, cs, {}, x)


def _mesh_run(tmp):
    """The tiny mesh: root -> b0 (r 2, 4 bits), root -> b1 (no module, 8 bits), b0 -> agg (r 4, float32), b1 -> agg
    (r 2, 4 bits); root and branches quantize at 5 bits."""
    space = mesh_space()
    ops, cp, cs = compact(space, seed=3)
    ch = C.make_choices(space.topology, modules=(2, 4), weight_bits=(5, 32), act_bits=(4, 8, 32))
    mp = N.init_modules(jax.random.PRNGKey(5), space, ch)
    a = space.layer_devices()
    cfg = C.Config(np.array(ops), np.zeros(4, int), np.array([1, 0, 2, 1]), np.array([0, 1, 2, 0]))
    return write_run(str(tmp), space, ch, cfg, a, cp, cs, mp), space, ch, cfg, a


def test_mesh_parts_compute_composed_apply(tmp_path):
    d, space, ch, cfg, a = _mesh_run(tmp_path / "mesh")
    m = D.export_composed(d)
    root = m["parts"]["root"]
    assert root["send_slices"] == {"b0": [0, m["links"][0]["bytes"]],
                                  "b1": [m["links"][0]["bytes"], m["links"][0]["bytes"] + m["links"][1]["bytes"]]}
    ex = os.path.join(d, "export")
    parts = {dev: load_part(ex, dev) for dev in m["order"]}
    x = images(3)
    got = []
    for i in range(3):
        y = parts["root"](x[i:i + 1])
        sl = root["send_slices"]
        zs = [parts[b](y[sl[b][0]:sl[b][1]]) for b in ("b0", "b1")]
        got.append(parts["agg"](*zs))
    assert np.max(np.abs(np.concatenate(got) - D.whole_network(d, 1)(x))) <= 1e-5


def test_mesh_parts_with_relays_compute_composed_apply(tmp_path):
    """A searched split on the mesh p0 -> root -> b0, b1 -> agg -> q0 that leaves the root and the aggregator no
    layer: the root's part relays p0's tensor through each branch's own fork link, the aggregator's averages the
    two branches once and sends the average to q0 through its module and bits; the parts compute composed_apply
    within 1e-5 (``composed_apply`` averages before it sends too)."""
    space = mesh_ends_space()
    ops, cp, cs = compact(space, seed=8)
    ch = C.make_choices(space.topology, modules=(2, 4), weight_bits=(5, 32), act_bits=(4, 8, 32))
    mp = N.init_modules(jax.random.PRNGKey(9), space, ch)
    a = np.array([0, 0, 2, 3, 5, 5])
    cfg = C.Config(np.array(ops), np.zeros(6, int), np.array([1, 1, 0, 2, 1, 1]), np.array([0, 1, 2, 0, 1, 0]))
    d = write_run(str(tmp_path / "run"), space, ch, cfg, a, cp, cs, mp)
    assert [c.boundary for c in N.cuts(space, ch, cfg, a)] == [2, 2, 2, 3, 4, 4]  # the merge: boundary 4 on agg->q0
    m = D.export_composed(d)
    assert m["parts"]["root"]["layers"] == [] and m["parts"]["agg"]["layers"] == []
    parts = {dev: load_part(os.path.join(d, "export"), dev) for dev in m["order"]}
    sl = m["parts"]["root"]["send_slices"]
    x = images(3)
    got = []
    for i in range(3):
        y = parts["root"](parts["p0"](x[i:i + 1]))
        got.append(parts["q0"](parts["agg"](*[parts[b](y[sl[b][0]:sl[b][1]]) for b in ("b0", "b1")])))
    want = D.whole_network(d, 1)(x)
    assert np.max(np.abs(np.concatenate(got) - want)) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["chain", "mesh", "input"])
def test_pipeline_check_runs_the_parts_and_every_link_carries_the_predicted_bytes(tmp_path, capsys, kind):
    d, space, ch, cfg, a = (_chain_run(tmp_path / "run", bits=(4, 4)) if kind == "chain" else
                            _input_run(tmp_path / "run", 4) if kind == "input" else _mesh_run(tmp_path / "run"))
    assert cli.main(["pipeline", "--workdir", d, "--images", "4", "--phase", "latency", "--bandwidth-scale", "100",
                     "--check", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)[0]
    assert out["max_abs_diff"] <= 1e-5
    terms = TT.build_terms(space, analytic_table(space), ch)
    for c, link in zip(N.cuts(space, ch, cfg, a), space.topology.links):
        want = int(terms.wire_bytes[c.boundary, 0 if c.r == 0 else 1 + ch.modules.index(c.r),
                                    ch.act_bits.index(c.bits)])
        assert out["link_bytes"][f"{link.src}->{link.dst}"] == {"predicted": want, "measured": [want]}, link
    if kind == "chain":
        assert cli.main(["pipeline", "--workdir", d, "--images", "4", "--phase", "latency", "--bandwidth-scale",
                         "100", "--check"]) == 0
        assert "every link carried the predicted bytes" in capsys.readouterr().out


def _one_line(capsys, argv, needle):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_broken_runs_and_parts_end_with_one_line(tmp_path, capsys):
    d, space, ch, cfg, a = _chain_run(tmp_path / "run")
    result = json.load(open(os.path.join(d, "result.json")))
    for k, (change, needle) in enumerate(((("activation_bits", [4, 9]), "activation_bits 9 is not one of"),
                                          (("modules", [2]), "modules must be a list of 2 values"),
                                          (("modules", [1, 2]), "module 1 is neither 0"),
                                          (("quantize", [True, "yes", False]), "quantize must be one true/false"))):
        bad = str(tmp_path / f"bad{k}")
        shutil.copytree(d, bad)
        with open(os.path.join(bad, "result.json"), "w") as f:
            json.dump(dict(result, compose=dict(result["compose"], **dict([change]))), f)
        _one_line(capsys, ["export", "--workdir", bad], needle)
    lacking = str(tmp_path / "lacking")  # the relay's part without the Conv-Reduce its outgoing link uses
    shutil.copytree(d, lacking)
    sbs = os.path.join(lacking, "parts", "sbs.npz")
    z = {k: v for k, v in np.load(sbs).items() if "reduce" not in k}
    np.savez(sbs, **z)
    _one_line(capsys, ["export", "--workdir", lacking], "lacks the Conv-Reduce of boundary 2")
    narrow = str(tmp_path / "narrow")  # the receiver's Conv-Recover of another width than the boundary's
    shutil.copytree(d, narrow)
    mbs = os.path.join(narrow, "parts", "mbs.npz")
    z = dict(np.load(mbs))
    z["params/modules/2/recover"] = z["params/modules/2/recover"][..., :5]
    np.savez(mbs, **z)
    _one_line(capsys, ["export", "--workdir", narrow], "params/modules/2/recover has shape [1, 1, 6, 5]")
    _one_line(capsys, ["pipeline", "--workdir", d, "--predict-table", "t.json"], "no bit dimension")
    with pytest.raises(DeployError, match="holds a composed configuration"):
        from jmsnas.deploy.export import export_run
        export_run(d)
    assert cli.main(["export", "--workdir", d]) == 0
    capsys.readouterr()
    with open(os.path.join(d, "export", "sbs.jaxexport"), "r+b") as f:  # a corrupt part
        f.seek(40)
        f.write(b"\0\1\2\3")
    _one_line(capsys, ["pipeline", "--workdir", d, "--images", "2", "--phase", "latency"], "is corrupt")
