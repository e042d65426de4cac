"""Your own JAX model (jmsnas.traced): references, the traced layer graph against the zoo, segments, Auto-Split
with measured accuracy, and bad references (one line, exit 2)."""
import json
import math
import os
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_zoo
from jmsnas import cli, topology
from jmsnas.split import compare, solvers, zoo
from jmsnas.topology import resolve
from jmsnas.traced import ref, run, trace

from paths import REPO
DIGITS_REF = os.path.join(REPO, "experiments", "your_model", "digits_cnn.py") + ":trained"


def _traced_zoo(name, shape=(224, 224, 3), classes=1000):
    module = getattr(flax_zoo, name)(classes)
    return trace.trace(ref.from_linen(module, flax_zoo.abstract_variables(module, shape), shape, name=name))


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "mobilenet_v2"])
def test_traced_flax_matches_zoo(name):
    """Oracle: torchvision's definitions in flax, traced (shapes only), give the zoo's layers, MACs, parameters
    and the bytes crossing every cut."""
    t, z = _traced_zoo(name), zoo.get(name)
    assert len(t.net.layers) == len(z.layers)
    for a, b in zip(t.net.layers, z.layers):
        assert (a.kind, a.macs, a.params, a.out_shape, set(a.inputs)) == \
            (b.kind, b.macs, b.params, b.out_shape, set(b.inputs)), (a, b)
    assert (t.net.total_macs, t.net.total_params) == (z.total_macs, z.total_params)
    cut = solvers.cut_bytes(np.array([l.out_elems * 4 for l in z.layers], float), z.input_elems, tuple(z.edges()))
    ours = solvers.cut_bytes(np.array([l.out_elems * 4 for l in t.net.layers], float), t.net.input_elems,
                             tuple(t.net.edges()))
    np.testing.assert_array_equal(ours, cut)
    np.testing.assert_array_equal(np.array(trace.live_elems(t)[1:-1]) * 4, cut[1:-1])  # what the parts send


def test_cut_across_a_skip_pays_for_both_tensors():
    t = _traced_zoo("resnet18")
    names = [l.name for l in t.net.layers]
    k = names.index("layer1_0.conv1") + 1  # cut between conv1 and conv2 of the first basic block
    assert len(t.live[k]) == 2  # the block input (the skip) and conv1's output
    assert trace.live_elems(t)[k] == 2 * 56 * 56 * 64
    assert trace.live_elems(t)[names.index("layer1_0.add") + 1] == 56 * 56 * 64  # after the sum: one tensor
    setup = compare.make_setup(t.net, resolve("chain"), act_bits=8)
    assert solvers.cut_bytes(setup.out_bytes, setup.input_bytes, setup.edges)[k] == 2 * 56 * 56 * 64


def test_sizes_the_zoo_cannot_express():
    t = _traced_zoo("resnet18", (32, 32, 3), 7)
    fc = t.net.layers[-1]
    assert (fc.name, fc.out_shape, fc.macs, fc.params) == ("fc", (7,), 512 * 7, 512 * 7 + 7)
    assert t.net.layers[0].out_shape == (16, 16, 64) and t.net.layers[0].macs == 16 * 16 * 64 * 7 * 7 * 3


@pytest.mark.slow
def test_segments_compose_to_the_model_and_quantize():
    module = flax_zoo.TinyResidual()
    variables = flax_zoo.numpy_variables(module, (8, 8, 3))
    t = trace.trace(ref.from_linen(module, variables, (8, 8, 3)))
    assert [l.name for l in t.net.layers] == ["conv1", "conv2", "res_a", "res_b", "add", "pool", "fc"]
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 8, 8, 3))
    want = jax.jit(module.apply)(variables, x)
    leaves = run.leaves_dict(t)
    h = [x]
    cuts = [0, 3, 4, 6, len(t.net.layers)]  # 3 and 4 cross the skip: two tensors packed into one
    assert [len(t.live[c]) for c in cuts] == [1, 2, 2, 1, 1]
    for a, b in zip(cuts[:-1], cuts[1:]):
        h = run.unpack(t, a, run.pack(h, 3), 3)
        assert run.pack(h, 3).shape == run.packed_shape(t, a, 3)[0]
        h = jax.jit(run.segment(t, a, b))({i: leaves[i] for i in run.segment_leaves(t, a, b)}, *h)
    assert float(jnp.max(jnp.abs(h[0] - want))) <= 1e-5
    wb, ab, rg = run.float_bits(t)
    fq = run.quant_forward(t)  # one compilation for every bit assignment
    assert float(jnp.max(jnp.abs(fq(leaves, x, wb, ab, rg) - want))) <= 1e-5
    y8 = fq(leaves, x, wb + 8, ab, rg)
    assert 0 < float(jnp.max(jnp.abs(y8 - want))) < 0.1 * float(jnp.max(jnp.abs(want)))


@pytest.mark.slow
def test_nnx_and_plain_apply(tmp_path):
    from flax import nnx

    class Tiny(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)
            self.fc = nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, x):
            return self.fc(nnx.relu(self.bn(self.conv(x))).mean((1, 2)))
    m = Tiny(nnx.Rngs(0))
    m.eval()
    t = trace.trace(ref.from_nnx(m, (8, 8, 1)))
    assert [l.kind for l in t.net.layers] == ["conv", "pool", "fc"]
    assert t.net.layers[0].params == 3 * 3 * 4 + 4 + 2 * 4  # kernel, bias, BN scale + bias (not its statistics)
    assert t.net.layers[0].name == "conv"
    x = jnp.ones((2, 8, 8, 1))
    np.testing.assert_allclose(run.forward(t)(run.leaves_dict(t), x), m(x), atol=1e-6)
    np.savez(tmp_path / "w.npz", **{"dense/w": np.ones((64, 5), np.float32)})
    plain = ref.from_apply(lambda p, x: x.reshape(len(x), -1) @ p["dense"]["w"], str(tmp_path / "w.npz"), (8, 8, 1))
    net = trace.net_spec(plain)  # the flattening of the input is a layer of its own (nothing to fuse it into)
    assert [tuple(l) for l in net.layers] == [("act", "act", 0, 0, (64,), ()), ("dense", "fc", 320, 320, (5,), (0,))]
    import orbax.checkpoint as ocp
    ocp.PyTreeCheckpointer().save(str(tmp_path / "ckpt"), {"dense": {"w": np.ones((64, 5), np.float32)}})
    assert trace.net_spec(plain._replace(params=ref.load_params(str(tmp_path / "ckpt")))) == net


@pytest.fixture(scope="module")
def digits_cnn(tmp_path_factory):
    """The example CNN trained briefly (80 steps) and its evaluation file."""
    sys.path.insert(0, os.path.join(REPO, "experiments", "your_model"))
    try:
        import digits_cnn as D
    finally:
        sys.path.pop(0)
    out = tmp_path_factory.mktemp("digits_cnn")
    D.main([str(out), "--steps", "80"])
    return out


@pytest.mark.slow
def test_split_and_autosplit_on_a_trained_flax_cnn(digits_cnn, monkeypatch, capsys):
    monkeypatch.setenv("DIGITS_CNN_PARAMS", str(digits_cnn / "params.npz"))
    assert cli.main(["split", "--model", DIGITS_REF, "--topology", "chain", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "digits_cnn" and len(out["methods"]["chain_dp"]["assignment"]) == 7
    argv = ["autosplit", "--model", DIGITS_REF, "--data", str(digits_cnn / "eval.npz"), "--topology", "autosplit",
            "--memory-mb", "0.05", "--max-accuracy-drop", "0.02", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    a = out["methods"]["autosplit"]
    assert out["kind"] == "traced" and out["data"]["val_examples"] == 250
    assert a["fits_memory"] and a["accuracy_drop"]["val"] <= 0.02
    assert out["float_accuracy"]["test"] > 0.8  # trained: far above chance
    assert a["latency_ms"]["total"] <= out["methods"]["neurosurgeon"]["latency_ms"]["total"] + 1e-12


BAD = textwrap.dedent('''
    import jax.numpy as jnp

    def boom():
        raise RuntimeError("boom")

    def three():
        return 3

    def mismatch():
        return (lambda p, x: x.reshape(len(x), -1) @ p["w"]), {"w": jnp.ones((63, 10))}, (8, 8, 1)

    def untraceable():
        def apply(p, x):
            if x.sum() > 0:
                return x.reshape(len(x), -1) @ p["w"]
            return -x.reshape(len(x), -1) @ p["w"]
        return apply, {"w": jnp.ones((64, 10))}, (8, 8, 1)

    def tiny():
        return (lambda p, x: x.reshape(len(x), -1) @ p["w"]), {"w": jnp.ones((64, 10))}, (8, 8, 1)
''')


@pytest.mark.parametrize("model,needle", [
    ("no_such_module_xyz:f", "module 'no_such_module_xyz' not found"),
    ("{d}/nope.py:f", "does not exist"),
    ("{d}/bad.py:missing", "has no function 'missing'"),
    ("{d}/bad.py:boom", "the factory raised RuntimeError: boom"),
    ("{d}/bad.py:three", "expected a UserModel or (apply, params"),
    ("{d}/bad.py:mismatch", "the parameters do not match the apply function"),
    ("{d}/bad.py:untraceable", "cannot be traced with jax.make_jaxpr"),
])
def test_bad_references_one_line_exit_2(tmp_path, capsys, model, needle):
    (tmp_path / "bad.py").write_text(BAD)
    assert cli.main(["split", "--model", model.format(d=tmp_path), "--topology", "chain"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("jmsnas split: error:") and needle in err, err


@pytest.mark.parametrize("arrays,needle", [
    ({"images": np.zeros((6, 9, 9, 1), np.float32), "labels": np.zeros(6, np.int32)}, "images have shape [6, 9, 9, 1]"),
    ({"images": np.zeros((6, 8, 8, 1), np.bool_), "labels": np.zeros(6, np.int32)}, "images have dtype bool"),
    ({"images": np.zeros((6, 8, 8, 1), np.float32), "labels": np.zeros(6, np.float32)}, "labels have dtype float32"),
    ({"images": np.zeros((6, 8, 8, 1), np.float32), "labels": np.zeros(5, np.int32)}, "labels have shape [5]"),
    ({"images": np.zeros((6, 8, 8, 1), np.float32), "labels": np.full(6, 10)}, "labels reach 10"),
    ({"pixels": np.zeros((6, 8, 8, 1), np.float32)}, "lacks ['images', 'labels']"),
])
def test_bad_data_one_line_exit_2(tmp_path, capsys, arrays, needle):
    (tmp_path / "bad.py").write_text(BAD)
    np.savez(tmp_path / "d.npz", **arrays)
    argv = ["autosplit", "--model", f"{tmp_path}/bad.py:tiny", "--data", str(tmp_path / "d.npz"),
            "--topology", "autosplit", "--memory-mb", "1", "--max-accuracy-drop", "0.01"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


COND = textwrap.dedent('''
    import jax
    import jax.numpy as jnp
    import numpy as np

    def model():
        def apply(p, x):
            h = jnp.tanh(x.reshape(len(x), -1) @ p["a"])
            h = jax.lax.cond(h.sum() > 0, lambda z: z * 2.0, lambda z: -z, h)
            return h @ p["b"]
        rng = np.random.default_rng(0)
        return apply, {"a": rng.normal(size=(64, 16)).astype(np.float32),
                       "b": rng.normal(size=(16, 10)).astype(np.float32)}, (8, 8, 1)
''')


def _cond_files(tmp_path, classes: int) -> tuple:
    (tmp_path / "condm.py").write_text(COND)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", images=rng.normal(size=(24, 8, 8, 1)).astype(np.float32),
             labels=(np.arange(24) % classes).astype(np.int32))
    return f"{tmp_path}/condm.py:model", str(tmp_path / "d.npz")


def test_autosplit_data_on_a_model_with_lax_cond(tmp_path, capsys):
    """A model with lax.cond (documented as supported) through autosplit --data: the fake-quantized runner left
    the cond's predicate alone (it quantized it to float32: a TypeError traceback)."""
    model, data = _cond_files(tmp_path, 10)
    assert cli.main(["autosplit", "--model", model, "--data", data, "--topology", "autosplit", "--memory-mb", "1",
                     "--max-accuracy-drop", "0.5", "--bits", "4,8"]) == 0
    assert "autosplit" in capsys.readouterr().out


def test_export_data_with_labels_beyond_the_models_outputs_is_one_line(tmp_path, capsys):
    """export --model --data with labels 0-19 for a 10-output model: refused as autosplit refuses it (the pipeline
    reported accuracy 0.000 without a word); nothing written."""
    model, data = _cond_files(tmp_path, 20)
    assert cli.main(["export", "--model", model, "--topology", "chain", "--workdir", str(tmp_path / "w"),
                     "--data", data]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "labels reach 19; the model has 10 outputs" in err, err
    assert not (tmp_path / "w").exists()


TINY = textwrap.dedent('''
    import flax_zoo
    from jmsnas.traced import ref

    def tiny():
        m = flax_zoo.TinyResidual()
        return ref.from_linen(m, flax_zoo.numpy_variables(m, (8, 8, 1)), (8, 8, 1), name="tiny_residual")
''')


SMALL_TOPOLOGIES = {  # few devices: one process each in the pipeline
    "chain": """
        name: three
        devices: [{name: ue, preset: raspberry_pi4}, {name: edge, preset: jetson_agx_xavier},
                  {name: cloud, preset: server_v100}]
        links: [{src: ue, dst: edge, mbps: 25}, {src: edge, dst: cloud, mbps: 200}]
    """,
    "mesh": """
        name: fork
        devices: [{name: root, preset: raspberry_pi4}, {name: b1, preset: jetson_agx_xavier},
                  {name: b2, preset: jetson_agx_xavier}, {name: agg, preset: server_v100}]
        links: [{src: root, dst: b1, mbps: 50}, {src: root, dst: b2, mbps: 50}, {src: b1, dst: agg, mbps: 200},
                {src: b2, dst: agg, mbps: 200}]
    """}


@pytest.mark.slow
@pytest.mark.parametrize("kind,cuts", [("chain", "3,4"), ("mesh", "2,4")])
def test_parts_of_a_traced_model_through_pipeline_check(tmp_path, capsys, kind, cuts):
    """The parts (cuts 3 and 4 cross the residual block's skip: two tensors packed) composed by one process per
    device give the model's own output; on the mesh the idle branch sends a token the aggregator ignores."""
    (tmp_path / "tiny.py").write_text(TINY)
    (tmp_path / "topo.yaml").write_text(textwrap.dedent(SMALL_TOPOLOGIES[kind]))
    work = tmp_path / "work"
    ref_ = f"{tmp_path}/tiny.py:tiny"
    assert cli.main(["export", "--model", ref_, "--topology", str(tmp_path / "topo.yaml"), "--cuts", cuts,
                     "--workdir", str(work)]) == 0
    m = json.loads((work / "export" / "manifest.json").read_text())
    first = m["order"][0]
    c0 = int(cuts.split(",")[0])
    assert m["kind"] == kind and m["parts"][first]["ops"] == ["conv1", "conv2", "res_a"][:c0]
    assert m["traced"]["ranges"][first] == [0, c0]
    packed = [d for d in m["order"] if m["parts"][d]["output"]["shape"] == [1, 2 * 4 * 4 * 16]]
    assert packed  # a cut inside the residual block sends both tensors
    if kind == "mesh":
        assert m["parts"]["b2"]["idle_branch"] and m["parts"]["b2"]["output"]["shape"] == [1, 1]
    capsys.readouterr()
    assert cli.main(["pipeline", "--workdir", str(work), "--check", "--images", "4", "--phase", "latency",
                     "--json"]) == 0
    (a,) = json.loads(capsys.readouterr().out)
    assert a["max_abs_diff"] <= 1e-5 and "accuracy" not in a


@pytest.mark.parametrize("argv,needle", [
    (["--cuts", "3,1,2"], "cuts must be 3 non-decreasing layer indices in 0..7"),
    (["--cuts", "1,x"], "--cuts must be comma-separated layer indices"),
    (["--method", "nope"], "method must be one of"),
    (["--data", "missing.npz"], "does not exist"),
    (["--out", "elsewhere"], "--out is for run directories"),
    (["--workdir", "{d}"], "holds other files"),
])
def test_export_bad_arguments_one_line(tmp_path, capsys, argv, needle):
    (tmp_path / "tiny.py").write_text(TINY)
    argv = [a.format(d=tmp_path) for a in argv]
    work = [] if "--workdir" in argv else ["--workdir", str(tmp_path / "w")]
    assert cli.main(["export", "--model", f"{tmp_path}/tiny.py:tiny", "--topology", "chain", *argv, *work]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert sorted(set(os.listdir(tmp_path)) - {"__pycache__"}) == ["tiny.py"]  # nothing written


def test_modularize_a_traced_model_and_infer_while_loading(tmp_path, capsys):
    """Children of your own model: blocks at the single-tensor cuts (the residual block stays whole), balanced by
    their parameters' bytes, and the children loaded in parallel compute the model's own output."""
    from jmsnas.modular import api, blocks as B
    from jmsnas.modular import loadmodel as L
    from jmsnas.modular import store
    (tmp_path / "tiny.py").write_text(TINY)
    lm = tmp_path / "lm.json"
    lm.write_text(json.dumps(L.LoadModel(15.0, 0.3, 6.0, 0.0, []).to_json()))
    ref_ = f"{tmp_path}/tiny.py:tiny"
    net = api.load_network(ref_)
    assert [b.name for b in net.blocks] == ["conv1", "conv2", "res_a..add", "pool", "fc"]
    assert [B.block_bytes(b) for b in net.blocks] == [4 * (9 * 8 + 2 * 8 + 2 * 8), 4 * (9 * 8 * 16 + 4 * 16),
                                                      4 * 2 * (9 * 16 * 16 + 4 * 16), 0, 4 * (16 * 10 + 10)]
    assert cli.main(["modularize", "--model", ref_, "--children", "2", "--out", str(tmp_path / "kids"),
                     "--load-model", str(lm), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["children"] == 2 and report["network"] == "traced:tiny_residual"
    x = np.random.default_rng(1).standard_normal((5, 8, 8, 1)).astype(np.float32)
    got = store.load(str(tmp_path / "kids"), parallel=2, x=x)
    module = flax_zoo.TinyResidual()
    want = jax.jit(module.apply)(flax_zoo.numpy_variables(module, (8, 8, 1)), x)
    assert float(np.max(np.abs(np.asarray(got.output) - np.asarray(want)))) <= 1e-5


@pytest.mark.slow
def test_a_plain_program_composes_across_cuts():
    """Closed-over constants, a multi-result op (split), concatenation, a loop and a softmax: cut where several
    tensors cross (the split's two halves) and at both ends, the two segments give apply's output."""
    mean = np.arange(64, dtype=np.float32).reshape(8, 8, 1) / 64

    def apply(p, x):
        a, b = jnp.split(((x - mean) * 2.0).reshape(len(x), -1), 2, axis=1)
        h = jnp.concatenate([jax.nn.relu(a @ p["w1"]), jnp.tanh(b @ p["w2"])], axis=1)
        h = jax.lax.fori_loop(0, 2, lambda i, v: v * 0.5 + 1.0, h)
        return jax.nn.softmax(h @ p["w3"])
    rng = np.random.default_rng(0)
    p = {k: rng.standard_normal(s).astype(np.float32) for k, s in (("w1", (32, 4)), ("w2", (32, 4)), ("w3", (8, 3)))}
    t = trace.trace(ref.from_apply(apply, p, (8, 8, 1)))
    n = len(t.net.layers)
    assert [l.name for l in t.net.layers if l.kind == "fc"] == ["fc", "fc#2", "fc#3"]
    assert max(len(v) for v in t.live) >= 2
    x = rng.standard_normal((3, 8, 8, 1)).astype(np.float32)
    leaves, want = run.leaves_dict(t), apply(p, x)
    for c in (0, next(c for c in range(n) if len(t.live[c]) > 1), n):
        y = run.segment(t, c, n)(leaves, *run.segment(t, 0, c)(leaves, x))[0]
        assert float(jnp.max(jnp.abs(y - want))) <= 1e-6, c


def test_an_idle_mesh_branch_receives_nothing_it_does_not_need(tmp_path):
    """Issue 39: the root sends an idle branch an empty frame (0 payload bytes: the trigger), not its output, and the
    manifest's link says so, so the predicted link term (eps of 0 bytes) is the one the pipeline measures. The
    frame as the worker builds it (runtime.load_stages' send entry) goes over a real socket into the idle part."""
    import socket

    from jmsnas.deploy import links as L
    from jmsnas.deploy import predict
    from jmsnas.deploy.runtime import load_manifest, load_stages
    (tmp_path / "tiny.py").write_text(TINY)
    (tmp_path / "topo.yaml").write_text(textwrap.dedent(SMALL_TOPOLOGIES["mesh"]))
    work = tmp_path / "work"
    assert cli.main(["export", "--model", f"{tmp_path}/tiny.py:tiny", "--topology", str(tmp_path / "topo.yaml"),
                     "--cuts", "2,4", "--workdir", str(work)]) == 0
    export = str(work / "export")
    m = load_manifest(export)
    assert m["parts"]["b2"]["idle_branch"] and not m["parts"]["b1"]["idle_branch"]
    assert m["parts"]["root"]["send_channels"] == {"b2": 0}
    bytes_of = {(l["src"], l["dst"]): l["bytes"] for l in m["links"]}
    assert bytes_of[("root", "b2")] == 0 and bytes_of[("root", "b1")] > 0
    (b2_in,) = m["parts"]["b2"]["inputs"]
    assert b2_in["shape"][-1] == 0 and b2_in["shape"][:-1] == m["parts"]["root"]["output"]["shape"][:-1]
    lat = {(l["src"], l["dst"]): l["latency_ms"] for l in m["links"]}
    pred = predict.predicted_links(m, 1.0)
    assert pred["root->b2"] == pytest.approx(lat[("root", "b2")])  # eps of 0 bytes: the link's latency alone
    root, b2 = load_stages(export, "root", m), load_stages(export, "b2", m)
    (prog, st), = root.stages
    sends = {s["to"]: s for s in st["send"]}
    assert sends["b1"]["channels"] is None and sends["b2"]["channels"] == 0
    y = prog(np.zeros(m["parts"]["root"]["inputs"][0]["shape"], np.float32))
    s = sends["b2"]
    out = np.ascontiguousarray(y[..., :s["channels"]].astype(s["dtype"]))  # as the worker's _StageRunner sends it
    a, b = socket.socketpair()
    with a, b:
        L.send_frame(a, L.ARRAY, 0, out, L.Pace(50.0, 0.0))
        fr = L.recv_frame(b)
    assert fr.value.nbytes == 0 and list(fr.value.shape) == b2_in["shape"]
    (bprog, _), = b2.stages
    assert bprog(fr.value).shape == (1, 1)
