"""jmsnas.modular: blocks, load-time model, balanced splits (exact / Q-learning / equal), children on disk, parallel
loading with streaming inference, last-child fine-tuning, the modularize / load / finetune commands."""
import glob
import hashlib
import itertools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas import cli, configs, ops as O, pipeline, supernet
from jmsnas.modular import blocks as B, finetune as F, loadmodel as L, partition as P, store
from jmsnas.modular.blocks import ModularError
from jmsnas.space import OPS
from jmsnas.split import zoo

# coefficients of a load model fitted on this project's 2-core machine (benchmarks/README.md); fixed so tests do
# not depend on the machine's load
MODEL = L.LoadModel(overhead_ms=15.0, per_array_ms=0.3, ms_per_mb=6.0, rmse_ms=0.0, samples=[])


@pytest.fixture(scope="module")
def tiny():
    """(space, ops, compact params, compact state, dataset, cfg) of a tiny chain network with random weights."""
    cfg = configs.tiny(configs.default_config())
    ds = pipeline.load_data(cfg)
    space, _ = pipeline.build(cfg, ds)
    mask = space.mask()
    rng = np.random.default_rng(3)
    ops = tuple(int(rng.choice(np.flatnonzero(mask[n]))) for n in range(space.num_layers))
    keys = jax.random.split(jax.random.key(1), space.num_layers + 2)
    stem = O.conv_bn_init(keys[0], 3, space.in_channels, space.stem_channels)
    layers = [O.op_init(kn, OPS[i], s.in_ch, s.out_ch) for kn, s, i in zip(keys[1:], space.layers, ops)]
    head = O.head_init(keys[-1], space.layers[-1].out_ch, space.head_channels, space.num_classes)
    cp = {"stem": stem[0], "head": head[0], "layers": tuple(p for p, _ in layers)}
    cs = {"stem": stem[1], "head": head[1], "layers": tuple(st for _, st in layers)}
    return space, ops, cp, cs, ds, cfg


@pytest.fixture(scope="module")
def run_dir(tiny, tmp_path_factory):
    """A directory laid out like a jmsnas search run (config.json, result.json, parts/) of the tiny network."""
    space, ops, cp, cs, ds, cfg = tiny
    d = str(tmp_path_factory.mktemp("run"))
    pipeline.write_parts(space, cp, cs, ops, d)
    from jmsnas.space import OP_NAMES, to_dict as space_to_dict
    with open(os.path.join(d, "result.json"), "w") as f:
        json.dump({"architecture": [{"layer": n, "op": OP_NAMES[i]} for n, i in enumerate(ops)],
                   "space": space_to_dict(space)}, f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, default=list)
    return d


def _load_model_file(tmp_path):
    path = str(tmp_path / "lm.json")
    with open(path, "w") as f:
        json.dump(MODEL.to_json(), f)
    return path


def _tree_bytes(tree):
    return {jax.tree_util.keystr(p): np.asarray(x).tobytes() for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# ------------------------------------------------------------------------------------------------ blocks

@pytest.mark.parametrize("name,num_blocks", [("resnet50", 20), ("mobilenet_v2", 34)])
def test_zoo_blocks_have_the_real_parameter_shapes(name, num_blocks):
    net = B.from_zoo(name)
    assert len(net.blocks) == num_blocks  # ResNet-50: stem, max pool, 16 bottlenecks, pool, fc
    assert sum(B.block_bytes(b) for b in net.blocks) == 4 * zoo.get(name).total_params
    w = net.blocks[0].params["l0"]["w"]
    assert w.shape == ((7, 7, 3, 64) if name == "resnet50" else (3, 3, 3, 32))


def test_zoo_cut_points_leave_one_live_tensor():
    net = zoo.resnet50()
    cuts = set(B.zoo_cut_points(net))
    for i, layer in enumerate(net.layers):  # no layer reads across a cut except the tensor at the cut
        for src in layer.inputs:
            assert not any(src < c < i for c in cuts)
    assert len(cuts) == 20 and len(net.layers) - 1 in cuts


@pytest.mark.slow
def test_run_blocks_equal_the_compact_network(tiny, run_dir):
    space, ops, cp, cs, ds, _ = tiny
    x = jnp.asarray(ds.test.images[:32])
    want = jax.jit(lambda p, s, x: supernet.compact_apply(space, ops, p, s, x, train=False)[0])(cp, cs, x)
    net = B.from_run(run_dir)
    assert len(net.blocks) == space.num_layers + 2
    np.testing.assert_array_equal(np.asarray(B.forward([b.spec for b in net.blocks])([b.params for b in net.blocks], x)), np.asarray(want))


# ------------------------------------------------------------------------------------------------ splits

def test_exact_split_is_the_brute_force_optimum():
    rng = np.random.default_rng(0)
    for _ in range(150):
        n = int(rng.integers(1, 9))
        k = int(rng.integers(1, n + 1))
        c = rng.random(n) * rng.choice([1, 10, 100], n)
        best = min(P.max_child(c, [0, *cs, n]) for cs in itertools.combinations(range(1, n), k - 1))
        cuts = P.exact(c, k)
        assert len(cuts) == k + 1 and cuts[0] == 0 and cuts[-1] == n
        assert P.max_child(c, cuts) == pytest.approx(best, rel=1e-12)


def test_equal_layers_and_hand_computed_cases():
    assert P.equal(10, 3) == [0, 3, 7, 10]
    assert P.exact([1, 1, 1, 9], 2) == [0, 3, 4]
    assert P.max_child([4, 1, 1, 1, 1], P.exact([4, 1, 1, 1, 1], 2)) == 4.0
    assert L.makespan_ms([3.0, 1.0, 1.0, 2.0], 2) == 4.0  # t=0: 3 | 1; t=1: 1 on B; t=2: 2 on B -> 4
    assert L.makespan_ms([3.0, 1.0], 8) == 3.0


@pytest.mark.parametrize("k", [0, -1, 35, 2.5, True])
def test_split_refuses_bad_k(k):
    with pytest.raises(ModularError, match="children|blocks"):
        P.exact(np.ones(34), k)


@pytest.mark.slow
@pytest.mark.parametrize("name,k", [("resnet50", 4), ("mobilenet_v2", 3)])
def test_qlearning_within_ten_percent_of_the_exact_optimum(name, k):
    costs = L.block_ms(MODEL, B.from_zoo(name).blocks)
    opt = P.max_child(costs, P.exact(costs, k))
    r = P.qlearning(jax.random.key(0), costs, k, steps=120, reference_ms=opt)
    assert r.max_ms <= 1.1 * opt
    assert r.episodes_to_10pct is not None and r.episodes_to_10pct <= r.episodes
    assert P.max_child(costs, P.equal(len(costs), k)) > 1.1 * opt  # the baseline is not already there


def test_auto_k_minimises_the_predicted_makespan():
    costs = np.array([5.0, 5.0, 5.0, 5.0])
    k, cuts, table = P.choose_k("exact", costs, overhead_ms=1.0, threads=2)
    assert table == {1: 21.0, 2: 11.0, 3: 17.0, 4: 12.0} and k == 2 and cuts == [0, 2, 4]


# ------------------------------------------------------------------------------------------------ load model

def test_fit_recovers_known_coefficients():
    samples = [{"bytes": b, "arrays": a, "ms": 2.0 + 0.5 * a + 3.0 * b / 1e6}
               for b in (1e5, 1e6, 8e6) for a in (1, 8, 64)]
    m = L.fit(samples)
    assert (m.overhead_ms, m.per_array_ms, m.ms_per_mb) == pytest.approx((2.0, 0.5, 3.0), rel=1e-9)
    blk = [{"bytes": 2_000_000, "arrays": 4}]
    assert L.block_ms(m, blk)[0] == pytest.approx(0.5 * 4 + 3.0 * 2)


def test_drop_cache_empties_the_page_cache(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(1 << 20))
    p.read_bytes()
    before = L.resident_bytes(str(p))
    assert before > 0
    L.drop_cache(str(tmp_path))
    assert L.resident_bytes(str(p)) < before // 4


def test_measurements_cover_every_configuration(tiny, tmp_path):
    samples = L.measure(sizes_bytes=(4096, 65536), arrays=(1, 4), reps=1, directory=str(tmp_path))
    assert [(s["bytes"], s["arrays"]) for s in samples] == [(4096, 1), (4096, 4), (65536, 1), (65536, 4)]
    assert all(s["ms"] > 0 and len(s["runs_ms"]) == 1 for s in samples)
    assert not os.listdir(tmp_path)  # the synthetic children are removed
    space, ops, cp, cs, _, _ = tiny
    net = B.from_compact(space, ops, cp, cs)
    assert L.inference_ms(net, reps=1).shape == (len(net.blocks),)
    assert L.raw_read_ms(8192, 2, reps=1, directory=str(tmp_path)) > 0


# ------------------------------------------------------------------------------------------------ store + load

@pytest.mark.slow
def test_children_reassemble_bitwise_with_streaming_inference(tiny, tmp_path):
    space, ops, cp, cs, ds, _ = tiny
    net = B.from_compact(space, ops, cp, cs)
    x = np.asarray(ds.test.images[:32])
    mono = np.asarray(B.forward([b.spec for b in net.blocks])([b.params for b in net.blocks], x))
    store.write(net, [0, 2, 4, len(net.blocks)], str(tmp_path / "c3"))
    events = []
    res = store.load(str(tmp_path / "c3"), parallel=2, x=x, on_event=events.append)
    np.testing.assert_array_equal(res.output, mono)  # bitwise, float32
    for c, tree in zip(res.manifest["children"], res.children):
        for j in range(*c["blocks"]):
            assert _tree_bytes(tree.get(store.block_key(j), {})) == _tree_bytes(store.prune(net.blocks[j].params))
    inferred = [e.child for e in events if e.what == "inferred"]
    assert inferred == [0, 1, 2]
    for e in events:  # child i runs only after children 0..i are loaded
        if e.what == "inferred":
            assert max(res.child_loaded_s[: e.child + 1]) <= e.t_s
    one = store.load(str(tmp_path / "c3"), parallel=1)
    assert [_tree_bytes(t) for t in one.children] == [_tree_bytes(t) for t in res.children]


def test_load_refuses_missing_corrupt_and_mixed_children(tiny, tmp_path):
    space, ops, cp, cs, ds, _ = tiny
    net = B.from_compact(space, ops, cp, cs)
    other = B.from_compact(space, ops, jax.tree_util.tree_map(lambda a: a + 1, cp), cs, name="other")
    cuts = [0, 3, len(net.blocks)]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    store.write(net, cuts, a)
    store.write(other, cuts, b)
    # mixed: child 1 of another network
    mixed = str(tmp_path / "mixed")
    shutil.copytree(a, mixed)
    shutil.rmtree(os.path.join(mixed, "child_01"))
    shutil.copytree(os.path.join(b, "child_01"), os.path.join(mixed, "child_01"))
    with pytest.raises(ModularError, match="child 1 .*belongs to network .*mixed"):
        store.load(mixed, parallel=2)
    # missing
    gone = str(tmp_path / "gone")
    shutil.copytree(a, gone)
    shutil.rmtree(os.path.join(gone, "child_00"))
    with pytest.raises(ModularError, match=r"child directories \['child_00'\] are missing"):
        store.load(gone)
    # corrupt: one byte of a data file flipped (caught by orbax or by the sha256)
    bad = str(tmp_path / "bad")
    shutil.copytree(a, bad)
    data = max((p for p in glob.glob(os.path.join(bad, "child_01", "state", "**", "*"), recursive=True)
                if os.path.isfile(p)), key=os.path.getsize)
    raw = bytearray(open(data, "rb").read())
    raw[len(raw) // 2] ^= 0xFF
    open(data, "wb").write(bytes(raw))
    with pytest.raises(ModularError, match="child 1 .*corrupt"):
        store.load(bad, parallel=2)
    # a manifest that is not JSON
    broken = str(tmp_path / "broken")
    shutil.copytree(a, broken)
    open(os.path.join(broken, "manifest.json"), "w").write("{not json")
    with pytest.raises(ModularError, match="manifest.json.*corrupt"):
        store.load(broken)
    m = json.load(open(os.path.join(a, "manifest.json")))
    del m["children"][1]["leaves"]
    json.dump(m, open(os.path.join(broken, "manifest.json"), "w"))
    with pytest.raises(ModularError, match="manifest.json' is corrupt: child entry 1 is malformed"):
        store.load(broken)


def test_write_refuses_bad_cuts_and_a_used_directory(tiny, tmp_path):
    space, ops, cp, cs, _, _ = tiny
    net = B.from_compact(space, ops, cp, cs)
    with pytest.raises(ModularError, match="increase strictly"):
        store.write(net, [0, 3, 3, len(net.blocks)], str(tmp_path / "x"))
    assert not os.path.exists(tmp_path / "x")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("mine")
    with pytest.raises(ModularError, match="not empty"):
        store.write(net, [0, len(net.blocks)], str(tmp_path / "used"))
    assert os.listdir(tmp_path / "used") == ["keep.txt"]
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


# ------------------------------------------------------------------------------------------------ fine-tuning

def _dir_digest(path):
    h = hashlib.sha256()
    for p in sorted(glob.glob(os.path.join(path, "**", "*"), recursive=True)):
        if os.path.isfile(p):
            h.update(p[len(path):].encode())
            h.update(open(p, "rb").read())
    return h.hexdigest()


@pytest.mark.slow
def test_finetune_trains_only_the_last_child(tiny, tmp_path):
    space, ops, cp, cs, ds, _ = tiny
    net = B.from_compact(space, ops, cp, cs)
    d = str(tmp_path / "ft")
    store.write(net, [0, 3, 5, len(net.blocks)], d)
    before = store.load(d)
    digests = [_dir_digest(os.path.join(d, c)) for c in ("child_00", "child_01")]
    r = F.finetune(d, ds.train.images, ds.train.labels, steps=15, lr=3e-3, batch=64)
    assert r.directory == "child_02.ft1" and not os.path.exists(os.path.join(d, "child_02"))
    assert r.losses[-1] < r.losses[0]
    after = store.load(d)  # the manifest's sha256 of the new last child verifies
    assert [_dir_digest(os.path.join(d, c)) for c in ("child_00", "child_01")] == digests
    for i in (0, 1):
        assert _tree_bytes(after.children[i]) == _tree_bytes(before.children[i])  # bitwise unchanged
    new, old = _tree_bytes(after.children[2]), _tree_bytes(before.children[2])
    stats = [p for p in old if "'state'" in p]  # batch-norm statistics are not trained
    assert stats and all(new[p] == old[p] for p in stats)
    assert any(new[p] != old[p] for p in old if "'params'" in p)
    assert np.all(np.isfinite(r.losses))
    last, *_ = F.train_last(before.manifest, before.children, ds.train.images[:64], ds.train.labels[:64], steps=1)
    assert jax.tree_util.tree_structure(last) == jax.tree_util.tree_structure(before.children[2])


# ------------------------------------------------------------------------------------------------ commands

@pytest.mark.slow
def test_cli_modularize_load_and_finetune_a_run(run_dir, tmp_path, capsys):
    lm = _load_model_file(tmp_path)
    out = str(tmp_path / "kids")
    assert cli.main(["modularize", "--model", run_dir, "--children", "auto", "--out", out, "--load-model", lm,
                     "--threads", "2", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["children"] == 2 and len(rep["cuts"]) == 3 and rep["auto_predicted_ms"]
    assert rep["predicted_ms"]["max_child"] == pytest.approx(rep["predicted_ms"]["exact_max_child"])
    assert cli.main(["load", out, "--infer", "--batch", "3", "--parallel", "2", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["output_shape"] == [3, 10] and rep["first_prediction_ms"] >= rep["child_loaded_ms"][0]
    assert cli.main(["finetune", out, "--steps", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["child_dir"] == "child_01.ft1"
    assert cli.main(["load", out]) == 0


@pytest.mark.parametrize("argv,message", [
    (["--children", "0"], "--children must be an integer >= 1 or 'auto', got '0'"),
    (["--children", "99"], "99 children need at least 99 blocks; mobilenet_v2 has 34"),
    (["--children", "2", "--strategy", "greedy"], "--strategy must be one of"),
    (["--children", "two"], "--children must be an integer"),
])
def test_cli_modularize_bad_inputs_exit_2_and_write_nothing(argv, message, tmp_path, capsys):
    out = str(tmp_path / "never")
    rc = cli.main(["modularize", "--model", "mobilenet_v2", "--out", out, "--load-model",
                   _load_model_file(tmp_path)] + argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and message in err
    assert not os.path.exists(out) and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_cli_load_bad_inputs_exit_2(tmp_path, capsys):
    assert cli.main(["load", str(tmp_path / "nothing")]) == 2
    assert "is not a directory of children" in capsys.readouterr().err
    assert cli.main(["modularize", "--model", "no_such_net", "--children", "2", "--out", str(tmp_path / "o"),
                     "--load-model", _load_model_file(tmp_path)]) == 2
    assert "neither a zoo network" in capsys.readouterr().err
    assert cli.main(["finetune", str(tmp_path / "nothing")]) == 2
