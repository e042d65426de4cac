"""Auto-Split on a compact jmsnas network (a run directory written the way ``jmsnas search`` writes it, with
random weights so no training is needed) and on zoo networks; the CLI's bad inputs; Table 10's volumes."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas import cli, configs, pipeline, supernet, topology
from jmsnas.quant import autosplit as AS, network, parts, solver
from jmsnas.deploy import links as L
from jmsnas.deploy.autosplit import export_autosplit, fake_quant_reference
from jmsnas.deploy.pipeline import run_pipeline
from jmsnas.deploy.runtime import DeployError, load_manifest, load_part
from jmsnas.quant.packing import packed_bytes, unpack
from jmsnas.quant.quantizers import act_codes
from jmsnas.space import OP_NAMES, op_index, to_dict as space_to_dict
from jmsnas.split import zoo
from jmsnas.split.solvers import cut_bytes
import paths

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile time dominates: 94 -> 71 s of test time, AVX2 EPYC, 2 cores


def _randomise(tree, key, low, high):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return jax.tree_util.tree_unflatten(treedef, [jax.random.uniform(k, l.shape, minval=low, maxval=high)
                                                  for k, l in zip(keys, leaves)])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny chain run: config.json, result.json and parts/ as the pipeline writes them, random weights and BN."""
    d = tmp_path_factory.mktemp("run")
    cfg = configs.tiny(configs.default_config())
    ds = pipeline.load_data(cfg)
    space, _ = pipeline.build(cfg, ds)
    params, state = supernet.init(jax.random.PRNGKey(0), space)
    ops = [op_index("mbconv_k5_e3_res"), op_index("mbconv_k3_e3"), op_index("identity"), op_index("mbconv_k3_e6")]
    space.validate_arch(ops)
    cp, cs = supernet.extract(space, params, state, ops)
    cs = {k: (_randomise(v, jax.random.PRNGKey(i), 0.5, 1.5) if k != "layers" else
              tuple(_randomise(l, jax.random.PRNGKey(10 + j), 0.2, 1.2) for j, l in enumerate(v)))
          for i, (k, v) in enumerate(cs.items())}
    pipeline.write_parts(space, cp, cs, ops, str(d))
    names = space.topology.device_names
    result = {"architecture": [{"layer": s.index, "device": names[s.device], "op": OP_NAMES[i]}
                               for s, i in zip(space.layers, ops)], "accuracy": {"val": None, "test": None},
              "space": space_to_dict(space)}
    (d / "result.json").write_text(json.dumps(result))
    (d / "config.json").write_text(cfg.to_json_best_effort())
    return str(d), space, ops, cp, cs, ds


@pytest.mark.slow
def test_folded_network_computes_what_the_compact_network_computes(run_dir):
    d, space, ops, cp, cs, ds = run_dir
    run = network.load_run(d)
    x = jnp.asarray(ds.test.images[:32])
    want, _ = supernet.compact_apply(space, tuple(ops), cp, cs, x, train=False, dw_impl="xla")
    got = network.forward(run.net.units, run.net.params, x, *network.float_bits(run.net))
    assert np.allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    kinds = [u.kind for u in run.net.units]
    assert kinds == ["conv"] + ["pw", "dw", "pw"] * 3 + ["pw", "fc"]  # the identity layer adds no unit
    assert run.net.units[3].inputs == (2, 0)  # the shortcut: the project unit also reads the layer input


@pytest.mark.slow
def test_written_parts_are_packed_and_reproduce_the_quantized_network(run_dir, tmp_path):
    d = run_dir[0]
    run = network.load_run(d)
    fn = run.net
    ranges, _ = network.calibrate(fn, run.dataset.train.images)
    n = 5
    wbits, abits = (2, 3, 4, 16, 8), (8, 6, 4, 16, 3)
    sol = solver.Solution("autosplit", n, wbits, abits, 0, 0, 0, 0, 0, 0, 0)
    topo = topology.resolve("autosplit")
    m = parts.write_parts(fn, ranges, sol, str(tmp_path), topo)
    assert m["sent"] == [{"tensor": 4, "bits": 3, "bytes": -(-int(np.prod(fn.units[4].out_shape)) * 3 // 8)}]
    edge = np.load(tmp_path / "edge.npz")
    assert edge["0/w_packed"].nbytes == -(-fn.params[0]["w"].size * 2 // 8)  # stored at 2 bits
    net2, ab2, rg2 = parts.load_parts(str(tmp_path))
    wb = np.zeros(len(fn.units), np.int32)
    wb[:n] = wbits
    ab = np.zeros(len(fn.units), np.int32)
    ab[:n] = abits
    x = jnp.asarray(run.dataset.test.images[:16])
    want = network.forward(fn.units, fn.params, x, wb, ab, ranges)
    got = network.forward(net2.units, net2.params, x, np.zeros_like(wb), ab2, rg2)
    assert np.array_equal(ab2, ab)
    assert np.allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_cli_on_a_run_directory(run_dir, capsys, tmp_path):
    d = run_dir[0]
    argv = ["autosplit", "--model", d, "--topology", "autosplit", "--bandwidth", "0.2", "--memory-mb", "0.05",
            "--max-accuracy-drop", "0.02", "--bits", "2,4,8,16", "--json", "--write-parts", str(tmp_path / "p")]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    m = out["methods"]
    assert set(m) == {"cloud_only", "edge_only_u8", "neurosurgeon", "u8_split", "autosplit"}
    limit = 0.05 * 2**20
    for name in ("cloud_only", "neurosurgeon", "u8_split", "autosplit"):
        assert m[name]["edge_memory_bytes"] <= limit
    a = m["autosplit"]
    assert a["accuracy_drop"]["val"] <= 0.02 + 1e-12
    assert a["latency_ms"]["total"] <= min(m[k]["latency_ms"]["total"] for k in ("cloud_only", "neurosurgeon",
                                                                                   "u8_split")) + 1e-9
    assert os.path.exists(tmp_path / "p" / "manifest.json")
    assert json.loads((tmp_path / "p" / "manifest.json").read_text())["split"] == a["split"]


@pytest.mark.slow
def test_zoo_network_works_from_shapes_and_says_so(capsys):
    assert cli.main(["autosplit", "--model", "mobilenet_v2", "--topology", "autosplit", "--memory-mb", "2",
                     "--max-accuracy-drop", "0.05"]) == 0
    text = capsys.readouterr().out
    assert "without trained weights" in text and "autosplit" in text and "neurosurgeon" in text


def test_resnet50_split_volumes_match_auto_split_table_10():
    net = zoo.get("resnet50")
    names = [l.name for l in net.layers]
    ones = np.array([float(l.out_elems) for l in net.layers])
    cut = cut_bytes(ones, float(net.input_elems), tuple(net.edges()))  # elements crossing each cut
    for block in ("layer4.0", "layer4.1", "layer4.2"):  # the conv3 output with its residual add fused
        assert cut[names.index(f"{block}.add") + 1] == 100_352
        assert net.layers[names.index(f"{block}.conv3")].out_shape == (7, 7, 2048)
    assert net.layers[names.index("fc")].out_elems == 1_000
    assert net.input_elems == 150_528


@pytest.mark.parametrize("argv, needle", [
    (["--bits", ","], "bit set is empty"),
    (["--bits", "4,12"], "unsupported bit width(s) [12]"),
    (["--bits", "4,x"], "--bits must be comma-separated integers"),
    (["--memory-mb", "0.00001"], "is below any edge part"),
    (["--memory-mb", "0"], "--memory-mb must be a positive number"),
    (["--max-accuracy-drop", "-0.1"], "--max-accuracy-drop must be a number >= 0"),
    (["--model", "no_such_net"], "neither a zoo network"),
    (["--model", "/no/such/run_dir"], "neither a zoo network"),
    (["--topology", "ring"], "unknown topology 'ring'"),
    (["--write-parts", "/tmp/x"], "--write-parts needs a run directory"),
])
def test_bad_inputs_end_with_one_line(capsys, argv, needle):
    base = {"--model": "resnet18", "--topology": "autosplit", "--memory-mb": "4", "--max-accuracy-drop": "0.01"}
    args = dict(base)
    extra = []
    for k, v in zip(argv[::2], argv[1::2]):
        if k in args:
            args[k] = v
        else:
            extra += [k, v]
    full = ["autosplit"] + [x for kv in args.items() for x in kv] + extra
    assert cli.main(full) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jmsnas autosplit: error:") and needle in err[0], err


def test_run_directory_without_config_is_refused(tmp_path, capsys):
    (tmp_path / "result.json").write_text("{}")
    assert cli.main(["autosplit", "--model", str(tmp_path), "--topology", "chain", "--memory-mb", "1",
                     "--max-accuracy-drop", "0.01"]) == 2
    err = capsys.readouterr().err
    assert "has no configuration" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_space_comes_from_result_json(run_dir, tmp_path):
    """result.json records the space (jmsnas.space.to_dict): it equals the run's, and the config's copy of the
    space is not read (a changed config does not change the network)."""
    import shutil
    from jmsnas import space as S
    d, space = run_dir[0], run_dir[1]
    result = json.loads(open(os.path.join(d, "result.json")).read())
    assert S.from_dict(result["space"]) == space
    copy = tmp_path / "run"
    shutil.copytree(d, copy)
    stored = json.loads((copy / "config.json").read_text())
    stored["space"]["device_channels"] = [99, 99, 99, 99]
    (copy / "config.json").write_text(json.dumps(stored))
    a, b = network.load_run(d).net, network.load_run(str(copy)).net
    assert a.units == b.units and a.input_shape == b.input_shape
    assert all(np.array_equal(p["w"], q["w"]) for p, q in zip(a.params, b.params))


def test_topology_file_is_accepted(capsys):
    path = os.path.join(paths.REPO, "experiments", "topologies",
                        "paper_chain.yaml")
    assert cli.main(["autosplit", "--model", "resnet18", "--topology", path, "--memory-mb", "4",
                     "--max-accuracy-drop", "0.05", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["edge_device"], out["cloud_device"]) == ("ue", "cloud")
    assert out["methods"]["autosplit"]["latency_ms"]["total"] <= out["methods"]["cloud_only"]["latency_ms"]["total"]


# ------------------------------------------------------------------- deployed (jmsnas.deploy.autosplit)
# Every system's parts deployed: Auto-Split's quantized edge sends its packed sub-byte activations over the link;
# the outputs equal the fake-quantized network's and the codes the cloud unpacks are bit for bit the edge's.

@pytest.fixture(scope="module")
def autosplit_parts(run_dir, tmp_path_factory):
    """Split after unit 3: units 0 (the shortcut's source, 3 bits) and 2 (5 bits) cross the link."""
    run = network.load_run(run_dir[0])
    ranges, _ = network.calibrate(run.net, run.dataset.train.images)
    sol = solver.Solution("autosplit", 3, (2, 4, 16), (3, 8, 5), 0, 0, 0, 0, 0, 0, 0)
    d = str(tmp_path_factory.mktemp("autosplit"))
    m = parts.write_parts(run.net, ranges, sol, d, topology.resolve("autosplit"), source=run_dir[0])
    assert [s["tensor"] for s in m["sent"]] == [0, 2]
    return d, run, m


@pytest.mark.slow
def test_autosplit_edge_sends_packed_codes_and_the_parts_equal_the_fake_quantized_network(autosplit_parts):
    d, run, m = autosplit_parts
    em = export_autosplit(d, batch=4)
    elems = [int(np.prod(run.net.units[s["tensor"]].out_shape)) for s in m["sent"]]
    per_image = [packed_bytes(n, b) for n, b in zip(elems, (3, 5))]  # ceil(elements * b / 8)
    assert em["links"][0]["bytes"] == 4 * sum(per_image)
    edge, cloud = load_part(os.path.join(d, "export"), "edge"), load_part(os.path.join(d, "export"), "cloud")
    x = np.asarray(run.dataset.test.images[:4], np.float32)
    packed = edge(x)
    assert packed.dtype == np.uint8 and packed.shape == (4, sum(per_image))
    head, payload = L._encode(L.ARRAY, 0, packed)  # the frame on the wire: header + exactly the packed bytes
    assert len(payload) == 4 * sum(per_image) and len(head) == L._HEAD.size + 4 * packed.ndim + L._LEN.size
    net, abits, ranges = parts.load_parts(d)
    ref = network.forward_all(net.units, net.params, jnp.asarray(x), np.zeros(len(net.units), np.int32), abits,
                              ranges)
    at = 0
    for s, n, nb in zip(m["sent"], elems, per_image):  # the codes the cloud unpacks == the fake-quantized tensor's
        j, b = s["tensor"], s["bits"]
        got = np.asarray(unpack(packed[:, at:at + nb], b, n))
        want = np.asarray(act_codes(ref[j].reshape(4, -1), ranges[j, 0], ranges[j, 1], b))
        assert np.array_equal(got, want), j
        at += nb
    logits = cloud(packed)
    assert np.max(np.abs(logits - fake_quant_reference(d)(x))) <= 1e-5


@pytest.mark.slow
def test_autosplit_export_for_the_pipeline(autosplit_parts, tmp_path):
    """The export's link carries the packed bytes; a given prediction (a latency table's) never slows a device.
    (The pipeline itself runs in test_pipeline_command_on_autosplit_parts_streams_the_runs_test_images; the honest
    mode's host speed in tests/deploy/test_deploy_splitnets.py.)"""
    d, run, m = autosplit_parts
    export_autosplit(d, str(tmp_path / "export"))
    x = np.asarray(run.dataset.test.images[:8], np.float32)
    with pytest.raises(DeployError, match="host speed"):  # a table's prediction never slows a device
        run_pipeline(str(tmp_path / "export"), x, compute=2.0, predicted_compute_ms={"edge": 1.0, "cloud": 2.0})
    man = load_manifest(str(tmp_path / "export"))
    assert man["links"][0]["bytes"] == sum(packed_bytes(int(np.prod(run.net.units[s["tensor"]].out_shape)), s["bits"])
                                           for s in m["sent"])


@pytest.mark.slow
def test_pipeline_command_on_autosplit_parts_streams_the_runs_test_images(autosplit_parts, tmp_path, capsys):
    """``jmsnas pipeline --workdir PARTS`` exports the parts, streams the test images of the run they were cut from
    (the manifest's source) and --check holds the outputs against the fake-quantized network."""
    import shutil
    from jmsnas.deploy.autosplit import eval_images
    d = str(tmp_path / "parts")
    shutil.copytree(autosplit_parts[0], d, ignore=shutil.ignore_patterns("export"))
    x, labels = eval_images(d, 8)
    assert np.array_equal(x, autosplit_parts[1].dataset.test.images[:8])
    assert np.array_equal(labels, autosplit_parts[1].dataset.test.labels[:8])
    assert cli.main(["pipeline", "--workdir", d, "--images", "8", "--phase", "latency", "--bandwidth-scale", "10",
                     "--check", "--json"]) == 0
    a = json.loads(capsys.readouterr().out)[0]
    assert a["max_abs_diff"] <= 1e-5 and 0.0 <= a["accuracy"] <= 1.0
    assert os.path.isfile(os.path.join(d, "export", "manifest.json"))
    m = json.loads(open(os.path.join(d, "manifest.json")).read())
    m["source"] = str(tmp_path / "gone")
    (tmp_path / "parts" / "manifest.json").write_text(json.dumps(m))
    assert cli.main(["pipeline", "--workdir", d, "--images", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names the run" in err[0] and "gone" in err[0], err
