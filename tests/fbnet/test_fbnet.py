"""The FBNet space (jmsnas.fbnet): layout, blocks as pure functions, latency-constrained search with the
Raspberry Pi 4 table of HELP's data (tests/data/help_fbnet)."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import tinyrun
from jmsnas import topology as T
from jmsnas.topology import presets
from jmsnas.fbnet import help as H, net, search as S, space as SP
import paths

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile time dominates: 74 -> 39 s of test time, AVX2 EPYC, 2 cores

DATA = os.path.join(paths.DATA, "help_fbnet")


def test_layout_is_hw_nas_bench_cifar100():
    sp = SP.fbnet_c100()
    lay = sp.layers
    assert len(lay) == 22 and sp.op_names[8] == "skip" and sp.blocks[1] == SP.Block("k3_e1_g2", 3, 1, 2)
    assert [l.index for l in lay if l.stride == 2] == [5, 9, 17]
    assert [l.out_ch for l in lay][::4] == [16, 24, 32, 64, 112, 184]
    assert lay[-1].out_ch == 352 and lay[-1].out_hw == 4 and lay[0].in_ch == 16
    assert [l.keeps_shape for l in lay[:3]] == [True, False, True]


@pytest.mark.slow
def test_grouped_pointwise_is_a_grouped_convolution():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 3, 8))
    w = jax.random.normal(jax.random.PRNGKey(1), (2, 4, 6))
    ref = lax.conv_general_dilated(x, jnp.concatenate([w[0], w[1]], axis=1)[None, None], (1, 1), "SAME",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=2)
    np.testing.assert_allclose(net._grouped_pointwise(x, w), ref, rtol=1e-5, atol=1e-5)
    s = net._shuffle(jnp.arange(6.0).reshape(1, 6), 2)
    np.testing.assert_array_equal(s, [[0, 3, 1, 4, 2, 5]])


@pytest.mark.slow
def test_blocks_keep_the_layer_shapes_and_skip_is_the_identity():
    sp = SP.scaled(SP.fbnet_c100(), width=0.25, image_size=8, in_channels=1, num_classes=10)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8, sp.layers[1].in_ch))
    inits = [net.block_init(jax.random.PRNGKey(1), b, sp.layers[1]) for b in sp.blocks]  # 4 -> 6 channels
    every = jax.jit(lambda ps, x: [net.block_apply(p, s, x, b, sp.layers[1], train=True, dw_impl="xla")[0]
                                   for b, (p, s) in zip(sp.blocks, ps)])
    assert [y.shape for y in every(inits, x)] == [(2, 8, 8, 6)] * 9
    skip = sp.blocks[8]
    p, s = net.block_init(jax.random.PRNGKey(1), skip, sp.layers[0])
    xs = x[..., :4]
    assert p == {} and net.block_apply(p, s, xs, skip, sp.layers[0], True)[0] is xs


@pytest.mark.slow
def test_network_forward_of_a_fixed_architecture():
    sp = SP.scaled(SP.fbnet_c100(), width=0.125, image_size=8, in_channels=1, num_classes=10)
    arch = (8, 1, 8, 8, 8, 0, 8, 8, 8, 4, 8, 8, 8, 8, 8, 8, 8, 5, 8, 8, 8, 8)
    params, state = net.init(jax.random.PRNGKey(0), sp, arch)
    logits, new = jax.jit(lambda p, s, x: net.apply(sp, arch, p, s, x, train=True, dw_impl="xla"))(
        params, state, jnp.ones((2, 8, 8, 1)))
    assert logits.shape == (2, 10) and np.isfinite(np.asarray(logits)).all()
    assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(state)


@pytest.fixture(scope="module")
def raspi4_plan():
    topo = T.make_topology("pi", [presets.device("raspberry_pi4", "pi")], [], [22])
    return S.plan(SP.fbnet_c100(), topo, {"pi": H.tables(DATA)["raspi4"]})


def _proxy(archs):
    """A cheap fitness for the test (the command uses a trained supernet's accuracy): larger blocks score more."""
    b = SP.fbnet_c100().blocks
    return np.array([sum(b[i].expand * b[i].kernel for i in a) for a in archs], np.float64)


@pytest.mark.slow
def test_search_on_one_device_with_the_raspi4_table_meets_t_const(raspi4_plan):
    t_const = 25.0
    r = S.search(jax.random.PRNGKey(0), raspi4_plan, t_const, _proxy, population=16, generations=3)
    assert r.latency_ms <= t_const and np.isfinite(r.fitness)
    # oracle: the data's own relative form, summed by hand, for the architecture found
    raw = json.load(open(os.path.join(DATA, H.LUT_FILE)))["devices"]["raspi4"]
    by_hand = raw["base_all_k3_e1_ms"] + sum(raw["delta_ms[layer][op]"][l][o] for l, o in enumerate(r.arch))
    assert r.latency_ms == pytest.approx(by_hand, abs=1e-9)
    data = H.load(DATA)  # and the table equals the published values of every architecture in the data
    np.testing.assert_allclose(S.latency_ms(raspi4_plan, data["archs"]), data["ms"]["raspi4"], atol=1e-9)


def test_t_const_below_the_fastest_network_is_one_line(raspi4_plan):
    fastest = S.latency_ms(raspi4_plan, S.fastest(raspi4_plan))[0]
    brute = min(S.latency_ms(raspi4_plan, np.random.default_rng(0).integers(0, 9, (2000, 22))))
    assert fastest <= brute
    with pytest.raises(ValueError, match="below the fastest network") as e:
        S.search(jax.random.PRNGKey(0), raspi4_plan, fastest - 0.01, _proxy, population=4, generations=1)
    assert "\n" not in str(e.value)


def test_chain_of_two_devices_adds_the_link_and_both_tables():
    tabs = H.tables(DATA)
    devs = [presets.device("raspberry_pi4", "ue"), presets.device("raspberry_pi4", "edge")]
    topo = T.chain("c", devs, [10.0], [5, 17], latencies_ms=[2.0])
    p = S.plan(SP.fbnet_c100(), topo, {"ue": tabs["raspi4"], "edge": tabs["pixel3"]})
    a = np.arange(22) % 9
    comm = 4 * 32 * 32 * 24 * 8 / (10.0 * 1e3) + 2.0  # layer 4's output, 32x32x24 float32, over 10 Mbit/s
    want = tabs["raspi4"].const_ms + sum(tabs["raspi4"].entry_ms[l, a[l]] for l in range(5)) \
        + sum(tabs["pixel3"].entry_ms[l, a[l]] for l in range(5, 22)) + comm
    b = S.breakdown(p, a)
    assert b["total"] == pytest.approx(want) and b["per_link"] == [pytest.approx(comm)]
    assert sum(b["per_device"].values()) + comm == pytest.approx(want)
    with pytest.raises(T.TopologyError, match="sums to 21"):
        S.plan(SP.fbnet_c100(), T.chain("c", devs, [10.0], [5, 16]), {"ue": tabs["raspi4"], "edge": tabs["pixel3"]})


@pytest.mark.slow
def test_search_command_in_the_fbnet_space_on_the_raspi4(tmp_path, capsys):
    """``jmsnas search`` with the shipped FBNet config (FLOPs fitness: no training) meets T_const, and its
    result's latency is the data's relative form summed by hand for the architecture it names."""
    from jmsnas.cli import main
    cfg = os.path.join(paths.REPO, "experiments", "configs", "fbnet_raspi4.py")
    assert main(["search", "--config", cfg, "--workdir", str(tmp_path / "run"), "--config.fbnet.fitness=flops",
                 "--config.fbnet.population=8", "--config.fbnet.generations=2", "--config.t_const_ms=20"]) == 0
    res = json.loads((tmp_path / "run" / "result.json").read_text())
    assert res["met"] and res["latency_ms"] <= 20.0
    tinyrun.assert_common_top_level(res, "fbnet")
    ops = [SP.OP_NAMES.index(a["op"]) for a in res["architecture"]]
    raw = json.load(open(os.path.join(DATA, H.LUT_FILE)))["devices"]["raspi4"]
    by_hand = raw["base_all_k3_e1_ms"] + sum(raw["delta_ms[layer][op]"][l][o] for l, o in enumerate(ops))
    assert res["latency_ms"] == pytest.approx(by_hand, abs=1e-9)
    from jmsnas import tensorboard  # TensorBoard: the fitness of both generations and the final breakdown
    scalars, _ = tensorboard.read(str(tmp_path / "run"))
    assert [s for s, _ in scalars["evolution/fitness_best"]] == [0, 1]
    assert scalars["result/latency_ms"][0][1] == pytest.approx(res["latency_ms"])
    assert main(["evolve", "--config", cfg, "--workdir", str(tmp_path / "run2"), "--config.t_const_ms=5"]) == 2
    assert "below the fastest network's latency 7.7982 ms" in capsys.readouterr().err


@pytest.mark.slow
def test_fbnet_flow_resumes_from_its_evolution_checkpoint(tmp_path, capsys):
    """The FBNet flow on the run layer: a run stopped after its second generation (the third's checkpoint and the
    result gone) continues with --resume to the uninterrupted result.json apart from time; a refused resume (other
    settings) writes nothing."""
    from jmsnas.cli import main
    cfg = os.path.join(paths.REPO, "experiments", "configs", "fbnet_raspi4.py")
    run = tmp_path / "run"
    argv = ["search", "--config", cfg, "--workdir", str(run), "--config.fbnet.fitness=flops",
            "--config.fbnet.population=8", "--config.fbnet.generations=3", "--config.t_const_ms=20", "--no-progress"]
    assert main(argv) == 0
    whole = json.loads((run / "result.json").read_text())
    assert json.loads((run / "config.json").read_text())["command"] == "search"
    evo = run / "checkpoints" / "evolution"
    assert sorted(int(p.name) for p in evo.iterdir() if p.name.isdigit()) == [2, 3]
    shutil.rmtree(evo / "3")
    (run / "result.json").unlink()
    before = tinyrun.digest(run)
    assert main(argv[:-1] + ["--config.fbnet.population=6", "--resume"]) == 2
    assert "other settings" in capsys.readouterr().err and tinyrun.digest(run) == before
    assert main(argv + ["--resume"]) == 0
    again = json.loads((run / "result.json").read_text())
    assert {**again, "time": None} == {**whole, "time": None}


def test_numpy_init_has_the_shapes_and_scales_of_the_jax_init():
    sp = SP.scaled(SP.fbnet_c100(), width=0.25)
    lay, b = sp.layers[1], sp.blocks[3]  # k3_e6, 4 -> 6 channels
    shapes = jax.eval_shape(lambda: net.block_init(jax.random.PRNGKey(0), b, lay))
    p, s = net.numpy_init(shapes)
    assert jax.tree_util.tree_structure((p, s)) == jax.tree_util.tree_structure(shapes)
    assert (np.asarray(s["bn1"]["var"]) == 1).all() and (np.asarray(p["bn1"]["bias"]) == 0).all()
    big = net.numpy_init(jax.ShapeDtypeStruct((1, 64, 4096), jnp.float32))  # a grouped 1x1: fan-in 64
    assert np.std(np.asarray(big)) == pytest.approx(np.sqrt(2 / 64), rel=0.02)


@pytest.mark.slow
def test_search_runs_on_a_table_adapted_from_the_library(tmp_path, capsys):
    """The FBNet config end to end on a Raspberry Pi 4 table adapted (jmsnas adapt --library) from its 10 reference
    networks and the shipped library without it: the result's latency is the adapted table's for its architecture."""
    from jmsnas.cli import main
    from jmsnas.cost import layertable as LT, networks as NW
    data = H.load(DATA)
    NW.save(H.measured(data, "raspi4", data["reference"]), tmp_path / "ten.json")
    lib = os.path.join(paths.REPO, "jmsnas", "fbnet", "library")
    others = [os.path.join(lib, f"{d}.json") for d in ("pixel3", "samsung_a50", "silver_4114", "silver_4210r",
                                                         "titan_rtx_32")]
    table = tmp_path / "rpi_adapted.json"
    assert main(["adapt", "--table", os.path.join(DATA, H.LUT_FILE) + ":pixel3", "--measured",
                 str(tmp_path / "ten.json"), "--library", *others, "--out", str(table)]) == 0
    cfg = os.path.join(paths.REPO, "experiments", "configs", "fbnet_raspi4.py")
    assert main(["search", "--config", cfg, "--workdir", str(tmp_path / "run"), "--config.fbnet.fitness=flops",
                 f"--config.fbnet.tables.raspberry_pi4={table}", "--config.fbnet.population=8",
                 "--config.fbnet.generations=2", "--config.t_const_ms=20", "--no-progress"]) == 0
    res = json.loads((tmp_path / "run" / "result.json").read_text())
    ops = [SP.OP_NAMES.index(a["op"]) for a in res["architecture"]]
    assert res["met"] and res["latency_ms"] <= 20.0
    assert res["latency_ms"] == pytest.approx(float(LT.predict_ms(LT.load(table), ops)[0]), abs=1e-9)
