"""The composed search end to end (``jmsnas.compose.flow`` through ``pipeline.search``) on a tiny chain: it writes
every cut's module and every layer's bits, all off is today's search, every group of logits learns from its
sampled gates, the fake quantizers' straight-through gradient, and the configuration's one-line refusals."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas import cli, configs, gates as G, pipeline, supernet, tensorboard
from jmsnas.compose import choices as C, cost as K, flow, net as N, steps as S, terms as TT
from jmsnas.quant import quantizers as Q
from jmsnas.space import OP_NAMES
from cli_errors import cli_error, refused_writing_nothing

pytestmark = pytest.mark.usefixtures("fast_compiles")  # tiny programs: compile time dominates


def _tiny(modules=(2, 4), weight_bits=(4, 32), act_bits=(8, 32), split="fixed", gate_mode="two_path"):
    cfg = configs.tiny(configs.default_config())
    cfg.max_train, cfg.max_eval = 96, 64
    cfg.compose.modules, cfg.compose.weight_bits, cfg.compose.activation_bits = modules, weight_bits, act_bits
    cfg.split, cfg.search.gate_mode = split, gate_mode
    cfg.tensorboard = False
    return cfg


def _config_of(result, choices, space) -> C.Config:
    """The discrete configuration result.json reports, as indices."""
    arch = sorted(result["architecture"], key=lambda e: e["layer"])
    dev = {n: i for i, n in enumerate(space.topology.device_names)}
    wb = [choices.weight_bits.index(e["weight_bits"]) if choices.quantize[dev[e["device"]]]
          else None for e in arch]
    cuts = result["compose"]["cuts"]
    mod = [0 if c["module"] is None else 1 + choices.modules.index(c["module"]["reduction"]) for c in cuts]
    return C.Config(np.array([OP_NAMES.index(e["op"]) for e in arch]), np.array(wb, dtype=object), np.array(mod),
                    np.array([choices.act_bits.index(c["activation_bits"]) for c in cuts]))


@pytest.mark.parametrize("split,gate_mode,topology", [("fixed", "two_path", "chain"),
                                                      ("searched", "gumbel_hard", "chain"),
                                                      ("fixed", "gumbel_soft", "mesh"),
                                                      ("searched", "two_path", "mesh")])
def test_the_composed_search_runs_and_lists_every_cut_and_every_layer(tmp_path, capsys, split, gate_mode, topology):
    """On the chain with D^m and with the split searched (the input sent where that is faster:
    ``compose.send_input``), and on the mesh (its parts run as one process per device in
    tests/compose/test_network.py)."""
    cfg = _tiny(split=split, gate_mode=gate_mode)
    input_sent = cfg.compose.send_input = split == "searched" and topology == "chain"
    if topology == "mesh":
        cfg.topology, cfg.layers_per_device = "mesh", (1,) * 6
        cfg.space.device_channels, cfg.space.device_strides = (8,) * 6, (1, 2, 1, 1, 1, 2)
    cfg.tensorboard = split == "fixed" and topology == "chain"  # its logs are checked on one of the runs
    result = pipeline.search(cfg, str(tmp_path / "run"), progress=False)
    space, table = pipeline.build(cfg, pipeline.load_data(cfg))
    ch = flow.choices_of(cfg, space.topology)
    comp = result["compose"]
    assert [c["link"] for c in comp["cuts"]] == list(space.topology.link_names)
    assert all(c["activation_bits"] in (8, 32) and (c["module"] is None or c["module"]["reduction"] in (2, 4))
               for c in comp["cuts"])
    assert comp["quantize"] == [True] * (space.topology.num_devices - 1) + [False]
    assert all(e["weight_bits"] in ((4, 32) if e["device"] != "cloud" else (32,)) for e in result["architecture"])
    # T is the composed cost of the reported configuration under the reported split (one-hot probabilities)
    config = _config_of(result, ch, space)
    wb = np.array([0 if b is None else b for b in config.weight_bits])
    names = space.topology.device_names
    a = np.array([names.index(e["device"]) for e in sorted(result["architecture"], key=lambda e: e["layer"])])
    assert ("stem_device" in comp) == input_sent
    if input_sent:  # the stem's device, last: a split that may send the input
        a = np.append(a, names.index(comp["stem_device"]))
        assert {c["tensor"] for c in comp["cuts"]} <= {"input", "stem"} | {f"layer {n}" for n in range(8)}
    bounds = np.asarray(K.link_boundaries(space, a))
    assert [c["boundary"] for c in comp["cuts"]] == bounds.tolist()
    terms = TT.build_terms(space, table, ch)
    t = K.latency(space, table, terms, C.onehot(space, ch, config._replace(weight_bits=wb)), a).total
    np.testing.assert_allclose(result["latency_ms"]["total"], float(t), rtol=1e-6)
    assert result["budget"]["met"] == (result["latency_ms"]["total"] <= cfg.t_const_ms * (1 + 1e-6))
    summary = open(tmp_path / "run" / "summary.txt").read()
    assert "Weight bits per layer" in summary and all(f"{c['link']} @ {c['boundary']} ({c['tensor']}):" in summary
                                                       for c in comp["cuts"])
    assert (f"The stem runs on {comp.get('stem_device')}" in summary) == input_sent
    manifest = json.load(open(tmp_path / "run" / "parts" / "manifest.json"))
    assert [c["reduction"] for c in manifest["cuts"]] == [0 if c["module"] is None else c["module"]["reduction"]
                                                         for c in comp["cuts"]]
    assert os.path.isfile(tmp_path / "run" / "latency_breakdown.png")
    if cfg.tensorboard:
        _logs_every_epoch_the_gates_and_the_result(str(tmp_path / "run"), cfg, space, result)
        _exports_and_passes_the_pipeline_check(str(tmp_path / "run"), result, space, terms, ch, capsys)


def _logs_every_epoch_the_gates_and_the_result(d, cfg, space, result):
    """TensorBoard: every epoch of both stages, the composed gates per link and layer, the result and its
    figures."""
    scalars, images = tensorboard.read(d)
    steps = lambda tag: [s for s, _ in scalars[tag]]
    values = lambda tag: [v for _, v in scalars[tag]]
    epochs = cfg.search.warmup_epochs + cfg.search.epochs
    assert steps("val/accuracy") == list(range(epochs + cfg.retrain.epochs))
    for name in space.topology.link_names:
        tag = f"compose/link/{name.replace('->', '_to_')}"
        assert steps(f"{tag}/sent_fraction") == list(range(epochs))
        assert all(1 / 4 - 1e-6 <= v <= 1 + 1e-6 for v in values(f"{tag}/sent_fraction"))
        assert all(8 - 1e-4 <= v <= 32 + 1e-4 for v in values(f"{tag}/bits"))
    assert all(4 - 1e-4 <= v <= 32 + 1e-4 for v in values("compose/weight_bits/layer_00"))
    final = len(json.load(open(os.path.join(d, "history.json"))))
    assert scalars["result/accuracy/test"] == [(final, pytest.approx(result["accuracy"]["test"]))]
    assert images


def _exports_and_passes_the_pipeline_check(d, result, space, terms, ch, capsys):
    """What the composed search writes is what ``jmsnas export`` reads: its parts run as one process per device
    and give the fake-quantized whole network (``deploy.composed.whole_network``) within 1e-5, and every link
    carries the bytes the search's cost terms charge for its (boundary, module, bits)."""
    assert cli.main(["export", "--workdir", d]) == 0
    capsys.readouterr()
    assert cli.main(["pipeline", "--workdir", d, "--images", "4", "--phase", "latency", "--bandwidth-scale", "100",
                     "--check", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)[0]
    assert out["max_abs_diff"] <= 1e-5
    for c, link in zip(result["compose"]["cuts"], space.topology.links):
        k = 0 if c["module"] is None else 1 + ch.modules.index(c["module"]["reduction"])
        want = int(terms.wire_bytes[c["boundary"], k, ch.act_bits.index(c["activation_bits"])])
        assert out["link_bytes"][f"{link.src}->{link.dst}"] == {"predicted": want, "measured": [want]}, link


def test_all_off_is_the_plain_search(tmp_path):
    plain = _tiny()
    del plain["compose"]  # a configuration from before the composed search: today's search
    off = _tiny(modules=(), weight_bits=(32,), act_bits=())
    a = pipeline.search(plain, str(tmp_path / "plain"), progress=False)
    b = pipeline.search(off, str(tmp_path / "off"), progress=False)
    for r in (a, b):
        r.pop("time", None)
        assert "compose" not in r
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _setup(modules=(2,), weight_bits=(4, 32), act_bits=(8, 32)):
    cfg = _tiny(modules, weight_bits, act_bits)
    ds = pipeline.load_data(cfg)
    space, table = pipeline.build(cfg, ds)
    ch = flow.choices_of(cfg, space.topology)
    return cfg, ds, space, table, ch, TT.build_terms(space, table, ch)


def test_all_off_forward_is_the_supernet():
    cfg, ds, space, table, ch, terms = _setup((), (), ())
    hp = pipeline._hparams(cfg, space, table)
    st = S.init_state(jax.random.PRNGKey(0), space, ch, hp, "fixed")
    gates = G.single_path_gates(jax.random.PRNGKey(1), st.logits.ops, jnp.asarray(space.mask()))
    cg = N.weight_gates(jax.random.PRNGKey(2), st.logits[1:], ch)
    x = ds.train.images[:8]
    want, _ = supernet.apply(space, {k: v for k, v in st.params.items() if k != "modules"}, st.bn, gates, x,
                             train=True)
    got, _ = N.apply(space, ch, "fixed", st.params, st.bn, gates, cg, None, x, train=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("kind", ["chain", "mesh", "input", "mesh_relays"])
def test_the_supernet_at_one_configuration_computes_the_derived_network(kind):
    """The stage-1 forward with one-hot gates (ops, modules, transmitted bits) equals the deployed network's forward
    (``compose.network.composed_apply``) of that configuration, on a chain, on a mesh where each branch receives
    the root's tensor through its own link (b0 with an r = 2 module at 4 bits, b1 with none at 8 bits), and on a
    chain whose UE sends the image at 4 bits (a searched split with the stem on the cloud), and on a mesh under a
    searched split where the root and the aggregator hold no layer: the root relays p0's tensor to both branches,
    the aggregator averages the branches' tensors once and sends the average on to q0."""
    from spaces import chain_space, mesh_ends_space, mesh_space
    space = {"mesh": mesh_space, "mesh_relays": mesh_ends_space}.get(kind, chain_space)()
    ch = C.make_choices(space.topology, (2, 4), (32,), (4, 8, 32), send_input=kind == "input")
    split = "searched" if kind in ("input", "mesh_relays") else "fixed"
    a = {"input": np.array([1, 1, 1, 1]),  # every layer and the stem on the cloud
         "mesh_relays": np.array([0, 0, 2, 3, 5, 5])}.get(kind)
    params, bn = supernet.init(jax.random.PRNGKey(0), space)
    params = {**params, "modules": N.init_modules(jax.random.PRNGKey(1), space, ch, split)}
    bn = jax.tree_util.tree_map(lambda v: v + 0.1 * jax.random.uniform(jax.random.PRNGKey(2), v.shape), bn)
    mask = space.mask()
    ops = np.array([np.flatnonzero(mask[n])[(3 * n + 1) % mask[n].sum()] for n in range(space.num_layers)])
    mod, ab = {"mesh": ([1, 0, 2, 1], [0, 1, 2, 0]), "mesh_relays": ([1, 1, 0, 2, 1, 1], [0, 1, 2, 0, 1, 0])}.get(
        kind, ([1], [0]))
    config = C.Config(ops, np.zeros(space.num_layers, int), np.array(mod), np.array(ab))
    x = jax.random.normal(jax.random.PRNGKey(3), (4, 8, 8, 1))
    gates, cg = G.onehot_gates(jnp.asarray(ops), len(OP_NAMES)), N.onehot_gates(ch, config)
    got = N.apply(space, ch, split, params, bn, gates, cg, a, x, train=False)[0]
    net = N.derived(space, ch, config, a)
    cp, cs = N.extract(space, params, bn, net)
    want = N.compact_apply(space, net, cp, cs, x, train=False)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    plain = N.compact_apply(space, N.derived(space, ch, config._replace(module=np.zeros(len(mod), int),
                                                                            act_bits=np.full(len(ab), 2)), a),
                            cp, cs, x, train=False)[0]
    assert np.max(np.abs(np.asarray(want) - np.asarray(plain))) > 1e-3  # the links' transforms are in both


@pytest.mark.parametrize("gate_mode", ["two_path", "gumbel_soft", "softmax"])
def test_the_sampled_gates_reach_every_group(gate_mode):
    """One architecture step with the latency term off (lambda2 = 0): only the cross-entropy through the sampled
    gates moves the logits, and every group moves."""
    cfg, ds, space, table, ch, terms = _setup()
    cfg.search.lambda2, cfg.search.gate_mode = 0.0, gate_mode
    hp = pipeline._hparams(cfg, space, table)
    st = S.init_state(jax.random.PRNGKey(0), space, ch, hp, "fixed")
    _, arch_step, _ = S.make_steps(space, table, terms, ch, hp)
    x, y = ds.val.images[:32], ds.val.labels[:32]
    st, m = arch_step(st, x, y)
    for name, a in zip(C.ChoiceProbs._fields, st.logits):
        assert np.abs(np.asarray(a)).max() > 0, name
    assert np.isfinite(float(m["arch_loss"]))


def test_the_fake_quantizers_pass_the_gradient_straight_through():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
    c = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
    for bits in (2, 4, 8, 16, 32):
        q = N.fake_quant_weight(w, bits)
        np.testing.assert_array_equal(np.asarray(q), np.asarray(Q.fake_quant_weight(w, 0 if bits == 32 else bits)))
        g = jax.grad(lambda v: jnp.sum(N.fake_quant_weight(v, bits) * c))(w)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(c))  # identity: every w is inside the range
    x = jnp.asarray(rng.normal(size=(2, 4, 4, 3)), jnp.float32)
    cx = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    q4 = N.fake_quant_act(x, 4)
    levels = np.unique(np.round((np.asarray(q4) - float(x.min())) / ((float(x.max()) - float(x.min())) / 15), 4))
    assert len(levels) <= 16 and np.allclose(levels, np.round(levels))  # 16 levels over [min, max]
    g = jax.grad(lambda v: jnp.sum(N.fake_quant_act(v, 4) * cx))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(cx), rtol=1e-6)
    # hand check against a finite difference of the straight-through surrogate v + (Q(v) - v) held fixed
    eps, i = 1e-3, (0, 1, 2, 0)
    bump = jnp.zeros_like(x).at[i].set(eps)
    qx = jax.lax.stop_gradient(N.fake_quant_act(x, 4) - x)
    fd = (jnp.sum((x + bump + qx) * cx) - jnp.sum((x - bump + qx) * cx)) / (2 * eps)
    np.testing.assert_allclose(float(fd), float(g[i]), rtol=1e-2)
    # sent channels only: the range is that of the valid channels, the others come back as 0
    valid = jnp.asarray([1.0, 1.0, 0.0])
    qv = N.fake_quant_act(x * 10 * (1 - valid) + x * valid, 8, valid)
    assert np.all(np.asarray(qv)[..., 2] == 0)
    np.testing.assert_allclose(np.asarray(qv)[..., :2], np.asarray(x)[..., :2], atol=float(x.max() - x.min()) / 255)


@pytest.mark.parametrize("override, needle", [
    ("--config.compose.modules=[1]", "compose.modules: 1"),
    ("--config.compose.modules=[2, 2]", "repeats"),
    ("--config.compose.modules=[2.5]", "2.5"),
    ("--config.compose.weight_bits=[9]", "compose.weight_bits: 9"),
    ("--config.compose.weight_bits=[1]", "compose.weight_bits: 1"),
    ("--config.compose.activation_bits=[0]", "compose.activation_bits: 0"),
    ("--config.compose.activation_bits=[12]", "12"),
    ("--config.compose.modules=[true]", "True"),
    ("--config.compose.module_optional=False", "compose.module_optional: false needs at least one reduction"),
    ("--config.compose.send_input=True", "needs split='searched'"),
])
def test_bad_values_exit_2_with_one_line_and_write_nothing(capsys, tmp_path, override, needle):
    assert needle in refused_writing_nothing(capsys, tmp_path, "search", [override])


def _topology_file(tmp_path, quantize):
    path = tmp_path / "topo.yaml"
    path.write_text("devices:\n"
                    f"  - {{name: phone, preset: raspberry_pi4, quantize: {quantize}}}\n"
                    "  - {name: edge, gflops: 1000, memory_mb: 8192}\n"
                    "links:\n  - {src: phone, dst: edge, mbps: 10}\n")
    return path


def test_bad_quantize_field_and_sending_the_input_on_a_mesh_exit_2(capsys, tmp_path):
    bad = _topology_file(tmp_path, '"yes"')
    err = cli_error(capsys, ["search", "--workdir", str(tmp_path / "a"), f"--config.topology={bad}",
                              "--config.layers_per_device=[2, 2]"])
    assert "quantize" in err and "yes" in err
    assert not (tmp_path / "a").exists()
    err = cli_error(capsys, ["search", "--workdir", str(tmp_path / "c"), "--config.topology=mesh",
                              "--config.layers_per_device=[2, 2, 2, 2, 2, 2]",
                              "--config.space.device_channels=[24, 32, 48, 48, 48, 64]",
                              "--config.space.device_strides=[1, 2, 1, 1, 1, 2]", "--config.compose.send_input=True",
                              "--config.split=searched"])
    assert "send_input" in err and "needs a chain" in err and "'mesh'" in err
    assert not (tmp_path / "c").exists()


def test_a_mesh_search_keeps_the_root_within_its_memory(tmp_path):
    """flow.decide on a mesh whose root (sbs) has less memory than the derived configuration needs there: the repair
    runs within the limit (it was dropped on a mesh) and the configuration it returns fits every device."""
    topo = tmp_path / "mesh.yaml"
    cfg = _tiny(modules=(2, 4), weight_bits=(4, 32), act_bits=(4, 32))
    cfg.topology, cfg.layers_per_device = str(topo), (1,) * 6
    cfg.space.device_channels, cfg.space.device_strides = (8,) * 6, (1, 2, 1, 1, 1, 2)

    def run(limit):
        body = open(os.path.join(os.path.dirname(configs.__file__), "..", "experiments", "topologies",
                                 "paper_mesh.yaml")).read()
        body = body.replace("{name: sbs, preset: xps15_rtx3050}",
                            "{name: sbs, preset: xps15_rtx3050" + (f", memory_bytes: {limit}}}" if limit else "}"))
        topo.write_text(body.replace("layers_per_device: {ue: 2, sbs: 2, mbs1: 2, mbs2: 2, mbs3: 2, cloud: 2}",
                                     "layers_per_device: [1, 1, 1, 1, 1, 1]"))
        ds = pipeline.load_data(cfg)
        space, table = pipeline.build(cfg, ds)
        ch = flow.choices_of(cfg, space.topology)
        terms = TT.build_terms(space, table, ch)
        from jmsnas import limits as L
        lim = L.device_limits(space, cfg.cost.activation_bits)
        rng = np.random.default_rng(4)
        logits = C.ChoiceProbs(*(rng.normal(scale=2.0, size=x).astype(np.float32)
                                 for x in C.logits_shapes(space, ch)))
        fix, split, _ = flow.decide(cfg, space, table, terms, ch, logits, lim)
        used = K.memory(space, lim.mem, table, terms, C.onehot(space, ch, fix.config), None).total
        return fix, np.asarray(used, np.float64), space
    free, used_free, space = run(None)
    root = space.topology.root
    limit = int(used_free[root]) - 1  # the unconstrained answer does not fit
    fix, used, _ = run(limit)
    assert used[root] <= limit * (1 + 1e-6) and used_free[root] > limit
    assert fix.repaired and fix.logprob_loss > 0


def test_the_quantize_field_reaches_the_choices(tmp_path):
    from jmsnas.topology import file as TF
    topo = TF.load(_topology_file(tmp_path, "false"))
    cfg = _tiny(weight_bits=(4, 32))
    assert flow.choices_of(cfg, topo).quantize == (False, False)  # the phone's field; the edge (last): default
    assert TF.from_dict(TF.to_dict(topo)) == topo
    topo = TF.load(_topology_file(tmp_path, "true"))
    assert flow.choices_of(cfg, topo).quantize == (True, False)


def test_module_parameters_follow_the_agreed_format():
    cfg, ds, space, table, ch, terms = _setup((2, 4), (32,), ())
    mods = N.init_modules(jax.random.PRNGKey(0), space, ch, "fixed")
    shapes = TT.boundary_shapes(space)
    assert sorted(mods, key=int) == [str(j) for j in np.asarray(K.link_boundaries(space))]
    for j, p in mods.items():
        c = shapes[int(j)][1]
        assert p["reduce"].shape == (1, 1, c, max(1, c // 2)) and p["recover"].shape == (1, 1, max(1, c // 2), c)
    assert sorted(N.init_modules(jax.random.PRNGKey(0), space, ch, "searched"), key=int) == [
        str(j) for j in range(space.num_layers + 1)]


def test_the_split_is_data_one_trace_serves_every_split():
    """Under a searched split the forward takes the assignment as an argument: one trace for two splits, and at
    D^m it computes what the fixed split's forward (cuts known when tracing) computes."""
    cfg, ds, space, table, ch, terms = _setup()
    hp = pipeline._hparams(cfg, space, table)
    st = S.init_state(jax.random.PRNGKey(0), space, ch, hp, "searched")
    config = C.Config(np.asarray(G.derive(st.logits.ops, jnp.asarray(space.mask()))), np.zeros(4, int),
                      np.array([1, 0, 1]), np.array([0, 1, 0]))
    gates, cg = G.onehot_gates(config.ops, len(OP_NAMES)), N.onehot_gates(ch, config)
    x = ds.train.images[:8]
    traces = []

    @jax.jit
    def fwd(a):
        traces.append(1)
        return N.apply(space, ch, "searched", st.params, st.bn, gates, cg, a, x, train=False)[0]

    dm = np.asarray(space.layer_devices(), np.int32)
    other = np.array([0, 0, 1, 3], np.int32)
    y_dm, y_other = fwd(dm), fwd(other)
    assert len(traces) == 1
    assert not np.allclose(np.asarray(y_dm), np.asarray(y_other))
    fixed_params = {**st.params, "modules": {j: st.params["modules"][j] for j in
                                             map(str, N.module_boundaries(space, "fixed"))}}
    want = N.apply(space, ch, "fixed", fixed_params, st.bn, gates, cg, None, x, train=False)[0]
    np.testing.assert_allclose(np.asarray(y_dm), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_evolve_refuses_a_composed_switch(capsys, tmp_path):
    err = cli_error(capsys, ["evolve", "--workdir", str(tmp_path / "e"), "--config.compose.weight_bits=[4, 8]"])
    assert "compose.weight_bits" in err and "jmsnas search" in err
    assert not (tmp_path / "e").exists()


def test_a_resumed_composed_search_ends_with_the_same_result(tmp_path):
    """Stage 1's checkpoint restores the composed state (every group's logits, the modules): a run resumed after
    its search (its retraining lost) writes the same result.json."""
    import shutil
    cfg = _tiny(modules=(2,), weight_bits=(4, 32), act_bits=(8, 32))
    w = str(tmp_path / "run")
    a = pipeline.search(cfg, w, progress=False)
    os.remove(os.path.join(w, "result.json"))
    shutil.rmtree(os.path.join(w, "checkpoints", "retrain"))
    b = pipeline.search(cfg, w, resume=True, progress=False)
    a.pop("time", None), b.pop("time", None)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)

