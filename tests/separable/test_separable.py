"""Tests of the separable network over G devices (paper 004): decisions, bytes, staleness latency, the network's
exchange, the controller, the run and its bad inputs."""
import itertools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tinyrun
from jmsnas import cli, tensorboard
from jmsnas.runcheck import ConfigError
from jmsnas.separable import config as sconfig, cost, decisions as dec, network as net, search
from jmsnas.separable.controller import ask_many, make_controller, make_random
from jmsnas.separable.parts import read_parts
from jmsnas.strategies.base import sample_valid
from jmsnas.topology import DeviceProfile, LinkProfile, TopologyError, cluster
import paths


# tiny programs: compile them without XLA's optimisation passes (compile time dominates)
pytestmark = pytest.mark.usefixtures("fast_compiles")


def spec(**kw):
    args = dict(num_groups=4, image_size=8, in_channels=1, num_classes=10, stem_channels=8, stage_channels=(8, 16),
                stage_blocks=(2, 2), stage_strides=(1, 2), cardinality=8, path_width=2, alpha=2)
    args.update(kw)
    return net.make_spec(**args)


def uniform_cluster(g, gflops=1.0, mbps=100.0):
    devs = [DeviceProfile(f"n{i}", gflops, 1e9, efficiency=1.0) for i in range(g)]
    return cluster("c", devs, [LinkProfile(f"n{i}", f"n{j}", mbps) for i in range(g) for j in range(g) if i != j])


# ------------------------------------------------------------------------------------------------ decisions

def test_permutation_ids_follow_table3():
    t = dec.permutation_table(4)
    assert t.shape == (24, 4)
    assert t[7].tolist() == [1, 0, 3, 2] and t[12].tolist() == [2, 0, 1, 3] and t[23].tolist() == [3, 2, 1, 0]
    for i, p in enumerate(t):
        assert dec.permutation_id(p, 4) == i
    assert sum(dec.is_intensive(p) for p in t) == 9  # derangements of 4


def test_sparsity_levels_follow_table4_and_eq10():
    pct = [float(dec.send_fraction(k, 9, 50.0)) * 100 for k in range(9)]
    assert pct == [50.0, 56.25, 62.5, 68.75, 75.0, 81.25, 87.5, 93.75, 100.0]
    assert [dec.n_send(16, k, 9, 50.0) for k in range(9)] == [8, 9, 10, 11, 12, 13, 14, 15, 16]
    assert dec.n_send(10, 1, 9, 50.0) == 5  # floor(10 * 0.5625)
    assert dec.n_send(7, 0, 1, 50.0) == 7  # K = 1: always everything


@pytest.mark.parametrize("kind", ["controller", "random"])
def test_every_sampled_decision_is_a_valid_permutation(kind):
    space = dec.make_space(4, 5, num_levels=9)
    make = make_controller if kind == "controller" else make_random
    strat = make(space, population=8, **({"hidden": 16} if kind == "controller" else {}))
    state = strat.init(jax.random.PRNGKey(0))
    tokens = ask_many(strat, jax.random.PRNGKey(1), state, 8)
    assert tokens.shape == (64, 10)
    pids, levels = space.decode(tokens)
    assert pids.min() >= 0 and pids.max() < 24 and levels.min() >= 0 and levels.max() < 9
    for p in dec.permutation_table(4)[pids.reshape(-1)]:
        assert sorted(p.tolist()) == [0, 1, 2, 3]
    assert np.array_equal(space.encode(pids, levels), tokens)


@pytest.mark.slow
def test_controller_learns_a_rewarded_decision_and_random_does_not():
    """REINFORCE over the token sequence: reward 1 when step 0 uses decision 7 and step 1 sparsity level 2."""
    space = dec.make_space(4, 2, num_levels=3)

    def reward(ops):
        pid, lv = space.decode(np.asarray(ops))
        return jnp.asarray((pid[:, 0] == 7) & (lv[:, 1] == 2), jnp.float32)

    hits = {}
    for kind, strat in (("controller", make_controller(space, population=16, hidden=16, learning_rate=0.05)),
                        ("random", make_random(space, population=16))):
        ask, tell = jax.jit(strat.ask), jax.jit(strat.tell)
        st = strat.init(jax.random.PRNGKey(0))
        for t in range(40):
            archs, st = ask(jax.random.PRNGKey(t), st)
            st, _ = tell(jax.random.PRNGKey(t), archs, reward(archs.ops), st)
        hits[kind] = float(reward(ask_many(strat, jax.random.PRNGKey(99), st, 8)).mean())
    assert hits["controller"] > 0.5 > 0.2 > hits["random"]  # random: 1/24 * 1/3


# ----------------------------------------------------------------------------------------------------- bytes

def test_bytes_match_a_hand_count_with_sparsity_and_float16():
    s = spec(num_levels=9, float16=True)
    ids, lv = dec.from_permutations(s.decision_space(), [[1, 0, 3, 2], [0, 2, 1, 3]], [4, 0])
    assert ids.tolist() == [7, 2]
    # stem broadcast: 3 nodes x 8x8x8 float32 = 6144; step 0 (8x8x8 output of block 0): 4 senders x 64 px x
    # floor(8 * 75 %) = 6 ch x 2 B = 3072; step 1 (4x4x16 output of block 2): 2 senders x 16 px x 8 ch x 2 B = 512
    assert cost.bytes_per_image(s, ids, lv) == 6144 + 3072 + 512
    # non-separated with ring all-reduce: stem broadcast + per block 2 (G-1) x output x 4 B
    assert cost.reference_bytes(s) == 6144 + 2 * (2 * 3 * 8 * 8 * 8 * 4) + 2 * (2 * 3 * 4 * 4 * 16 * 4)
    full = spec(num_levels=9, float16=False)
    assert cost.bytes_per_image(full, ids, np.array([8, 8])) == 6144 + 4 * 64 * 8 * 4 + 2 * 16 * 16 * 4
    ev = cost.evaluate(s, uniform_cluster(4), ids, lv)
    assert ev["bytes_per_image"] == 9728 and sum(ev["link_bytes"].values()) == 9728
    assert ev["link_bytes"]["n0->n1"] == 2048 + 768 and ev["link_bytes"]["n2->n1"] == 256


# -------------------------------------------------------------------------------------------------- latency

def test_block_flops_hand_count():
    b = net.BlockShape(cin=8, cout=8, stride=1, size_in=8, size_out=8, paths=2, width=2)
    assert cost.block_flops(b) == 2 * 64 * 8 * 4 + 2 * 64 * 9 * 2 * 4 + 2 * 64 * 4 * 8
    b = net.BlockShape(cin=8, cout=16, stride=2, size_in=8, size_out=4, paths=1, width=2)
    assert cost.block_flops(b) == 2 * 64 * 8 * 2 + 2 * 16 * 9 * 2 * 2 + 2 * 16 * 2 * 16 + 2 * 16 * 8 * 16


def two_node_case(alpha):
    """G = 2, two identical blocks of 8704 FLOPs; node0 computes a block in 1 ms, node1 in 2 ms; a 2048-byte
    transfer takes 3 ms on n0->n1 and 1 ms on n1->n0."""
    s = net.make_spec(num_groups=2, image_size=8, in_channels=1, num_classes=10, stem_channels=8,
                      stage_channels=(8,), stage_blocks=(2,), stage_strides=(1,), cardinality=2, path_width=2,
                      alpha=alpha)
    assert [cost.block_flops(b) for b in s.blocks] == [8704, 8704]
    devs = [DeviceProfile("n0", 8704e-6, 1e9, efficiency=1.0), DeviceProfile("n1", 4352e-6, 1e9, efficiency=1.0)]
    topo = cluster("two", devs, [LinkProfile("n0", "n1", 16.384 / 3), LinkProfile("n1", "n0", 16.384)])
    stem_ms, head_ms = 9216 / 8704, 160 / 8704  # stem 2*64*9*1*8 FLOPs and head 2*8*10 FLOPs on n0
    return s, topo, stem_ms + 3.0 + head_ms  # + the stem broadcast n0 -> n1 (2048 B, 3 ms)


def test_alpha1_latency_is_the_synchronous_sum():
    s, topo, fixed = two_node_case(1)
    ev = cost.evaluate(s, topo, [1, 1], [0, 0])  # swap at both steps
    # each block: the slower node (2 ms), then the slower transfer (3 ms), twice
    assert ev["latency_ms"] == pytest.approx(fixed + 2 * (2 + 3))
    assert ev["synchronous_ms"] == pytest.approx(ev["latency_ms"])
    ev = cost.evaluate(s, topo, [0, 1], [0, 0])  # identity then swap: no transfer at step 0
    assert ev["latency_ms"] == pytest.approx(fixed + 2 + (2 + 3))


def test_alpha2_overlaps_by_hand():
    s, topo, fixed = two_node_case(2)
    ev = cost.evaluate(s, topo, [1], [0])
    # first block 2 ms, then the 3 ms transfer overlaps the second block (2 ms): 2 + max(2, 3)
    assert ev["latency_ms"] == pytest.approx(fixed + 2 + 3)
    assert ev["synchronous_ms"] == pytest.approx(fixed + 2 + 2 + 3)
    assert ev["compute_ms"]["n1"] == pytest.approx(4.0)
    assert ev["compute_ms"]["n0"] == pytest.approx(2.0 + 9216 / 8704 + 160 / 8704)


def test_overlapped_latency_never_exceeds_synchronous():
    rng = np.random.default_rng(0)
    for alpha in (1, 2):
        s = spec(alpha=alpha, num_levels=3)
        for _ in range(20):
            devs = [DeviceProfile(f"n{i}", float(rng.uniform(0.05, 2)), 1e9, efficiency=1.0) for i in range(4)]
            links = [LinkProfile(f"n{i}", f"n{j}", float(rng.uniform(1, 500))) for i in range(4) for j in range(4)
                     if i != j]
            ids, lv = rng.integers(0, 24, s.num_steps), rng.integers(0, 3, s.num_steps)
            ev = cost.evaluate(s, cluster("r", devs, links), ids, lv)
            if alpha == 1:
                assert ev["latency_ms"] == pytest.approx(ev["synchronous_ms"])
            else:
                assert ev["latency_ms"] <= ev["synchronous_ms"] + 1e-12


# -------------------------------------------------------------------------------------------------- network

@pytest.mark.slow
def test_all_identity_equals_independent_group_networks():
    s = spec()
    params = net.init(jax.random.PRNGKey(0), s)
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 8, 8, 1))
    params["blocks"] = [dict(p, gain=jnp.full_like(p["gain"], 0.7)) for p in params["blocks"]]
    ident = jnp.zeros((s.num_steps,), jnp.int32)
    feats = jax.jit(lambda p: net.features(s, p, x, ident, jnp.zeros_like(ident)))(params)

    @jax.jit
    def alone(params, g):  # group g's network on its own: the stem, then its blocks, nothing received
        h = net.stem_apply(params["stem"], x)
        for b, p in zip(s.blocks, params["blocks"]):
            h = net.block_apply({k: v[g] for k, v in p.items()}, h, b)
        return h

    for g in range(4):
        np.testing.assert_allclose(feats[g], alone(params, g), rtol=1e-5, atol=1e-5)
    other = jax.jit(lambda p: net.features(s, p, x, jnp.asarray([7, 7]), jnp.zeros_like(ident)))(params)
    assert not np.allclose(other[0], feats[0])  # an exchange does change the features


@pytest.mark.slow
def test_exchange_adds_stale_sparse_float16_features_of_the_sender():
    s = spec(alpha=2, num_levels=9, float16=True)
    params = net.init(jax.random.PRNGKey(0), s)
    params["blocks"] = [dict(p, gain=jnp.full_like(p["gain"], 0.7)) for p in params["blocks"]]
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 8, 1))
    perm = [1, 2, 3, 0]  # node j sends to j + 1
    ids = jnp.asarray([dec.permutation_id(perm, 4), 0], jnp.int32)
    levels = jnp.asarray([0, 0], jnp.int32)  # 50 %: the first 4 of 8 channels at step 0
    got = jax.jit(lambda p: net.features(s, p, x, ids, levels))(params)
    blk = lambda i, h: jax.vmap(lambda p, v: net.block_apply(p, v, s.blocks[i]))(params["blocks"][i], h)
    h0 = jnp.broadcast_to(net.stem_apply(params["stem"], x), (4, 2, 8, 8, 8))
    b0 = blk(0, h0)
    sent = np.array(b0.astype(jnp.float16).astype(jnp.float32))
    sent[..., 4:] = 0
    recv = sent[[3, 0, 1, 2]]  # node i receives from i - 1
    want = blk(3, blk(2, blk(1, b0) + recv))  # added after block 1 (alpha = 2); identity at step 1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ bad inputs

@pytest.mark.parametrize("kw, needle", [
    (dict(num_groups=1), "G (number of groups/nodes) must be an integer >= 2, got 1"),
    (dict(alpha=0), "alpha (staleness factor) must be an integer >= 1, got 0"),
    (dict(num_levels=0), "K (sparsity levels) must be an integer >= 1, got 0"),
    (dict(alpha=3), "stage_blocks[0]=2 must be a multiple of alpha=3"),
])
def test_bad_spec_values_name_themselves(kw, needle):
    with pytest.raises(ValueError, match=None) as e:
        spec(**kw)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_decisions_and_cluster():
    space = spec().decision_space()
    with pytest.raises(ConfigError, match=r"decision at step 1 \[0, 0, 1, 3\] is not a permutation of 0..3"):
        dec.from_permutations(space, [[1, 0, 3, 2], [0, 0, 1, 3]])
    with pytest.raises(ConfigError, match="needs 2 permutations"):
        dec.from_permutations(space, [[1, 0, 3, 2]])
    with pytest.raises(TopologyError, match=r"G=4 does not match topology 'c' with 3 devices"):
        cost.check_cluster(spec(), uniform_cluster(3))
    with pytest.raises(TopologyError, match=r"missing links \['n1->n0'\]"):
        cluster("c", [DeviceProfile("n0", 1, 1), DeviceProfile("n1", 1, 1)], [LinkProfile("n0", "n1", 1)])


@pytest.mark.parametrize("override, needle", [
    ("--config.net.num_groups=1", "G (number of groups/nodes) must be an integer >= 2, got 1"),
    ("--config.cluster.num_devices=3", "G=4 does not match topology 'cluster3' with 3 devices"),
    ("--config.cluster.num_devices=1", "cluster.num_devices must be an integer >= 2, got 1"),
    ("--config.net.alpha=0", "alpha (staleness factor) must be an integer >= 1, got 0"),
    ("--config.net.num_levels=0", "K (sparsity levels) must be an integer >= 1, got 0"),
    ("--config.search.baseline_decay=1.0", "search.baseline_decay must be a finite number >= 0 and < 1, got 1.0"),
    ("--config.search.augment_shift=-1", "search.augment_shift must be an integer >= 0, got -1"),
    ("--config.decisions=[[1,0,3,2],[0,0,1,3]]", "decision at step 1 [0, 0, 1, 3] is not a permutation of 0..3"),
    ("--config.cluster.topology=experiments/topologies/paper_chain.yaml", "is a 'chain' topology; a separable"),
    ("--config.net.num_groups=2 --config.cluster.topology=experiments/topologies/pi_cluster4.yaml",
     "G=2 does not match topology 'pi_cluster4' with 4 devices"),
])
def test_cli_bad_input_one_line_exit_2_and_no_workdir(tmp_path, capsys, override, needle):
    wd = tmp_path / "run"
    assert cli.main(["separable", "--workdir", str(wd), *override.split()]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
    assert not wd.exists()


def test_an_unknown_network_setting_in_a_config_file_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "sep.py"
    cfg.write_text("from jmsnas.separable.config import default_config\n\n\ndef get_config():\n"
                   "    c = default_config()\n    c.net.widht = 3\n    return c\n")
    wd = tmp_path / "run"
    assert cli.main(["separable", "--config", str(cfg), "--workdir", str(wd)]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown net settings ['widht']" in err and len(err.splitlines()) == 1 and not wd.exists()


# ------------------------------------------------------------------------------------------------------ run

@pytest.mark.slow
def test_cli_run_outputs_and_resume(tmp_path, capsys):
    """The tiny config end to end through the CLI; then a run resumed from its first round ends the same."""
    cfg_file = os.path.join(paths.REPO, "experiments", "configs", "separable.py")
    wd = tmp_path / "run"
    given = "--config.decisions=[[1,0,3,2],[0,1,2,3]]"
    assert cli.main(["separable", "--config", f"{cfg_file}:g4a2k3f16:tiny", "--workdir", str(wd), given,
                     "--no-progress"]) == 0
    assert "controller" in capsys.readouterr().out
    res = json.loads((wd / "result.json").read_text())
    tinyrun.assert_common_top_level(res, "separable")
    for f in ("reward_curve.png", "bytes_accuracy.png", "history.json"):
        assert (wd / f).stat().st_size > 0
    for arm in ("controller", "random"):
        d = res[arm]["decisions"]
        assert len(d["permutations"]) == 2 and all(sorted(p) == [0, 1, 2, 3] for p in d["permutations"])
        c = res[arm]["cost"]
        assert c["bytes_per_image"] == sum(c["link_bytes"].values())
        assert c["latency_ms"] <= c["synchronous_ms"] and set(c["compute_ms"]) == {f"node{i}" for i in range(4)}
        assert 0 <= res[arm]["test_acc"] <= 1
    assert len(json.loads((wd / "history.json").read_text())) == 2
    stored = read_parts(str(wd))  # the controller arm's fine-tuned network, per device, with its decisions
    assert stored.perm_ids.tolist() == res["controller"]["decisions"]["perm_ids"]
    assert stored.devices == [f"node{i}" for i in range(4)] and stored.spec.num_groups == 4
    assert net.num_params(stored.params) == res["network"]["num_params"]
    # TensorBoard: per round and per controller step (2 rounds x 2 steps), the final costs and both figures
    scalars, images = tensorboard.read(str(wd))
    names = {f"{arm}/{k}" for arm in ("controller", "random") for k in ("reward", "train_loss", "best_accuracy",
                                                                         "sample_bytes_ratio_mean")}
    names |= {"control_group/reward", "result/controller/test_accuracy", "result/controller/latency_ms",
              "result/reference/test_accuracy", "result/random/device/node1_ms"}
    assert names <= set(scalars), sorted(names - set(scalars))
    assert [s for s, _ in scalars["controller/reward"]] == [0, 1, 2, 3]
    assert images == ["figures/bytes_accuracy", "figures/reward_curve"]
    events = set(os.listdir(wd / "tensorboard"))
    # the given decisions: stem broadcast 3 x 8x8x8 float32 + step 0: 4 senders x 64 px x 8 ch x 2 B
    assert res["given"]["decisions"]["perm_ids"] == [7, 0]
    assert res["given"]["cost"]["bytes_per_image"] == 3 * 64 * 8 * 4 + 4 * 64 * 8 * 2
    # resume: drop the last round's checkpoint, continue from round 1
    ck = wd / "checkpoints" / "separable"
    shutil.rmtree(ck / "2")
    os.remove(wd / "result.json")
    assert cli.main(["separable", "--config", f"{cfg_file}:g4a2k3f16:tiny", "--workdir", str(wd), "--resume",
                     given, "--no-progress", "--config.tensorboard=False"]) == 0
    assert set(os.listdir(wd / "tensorboard")) == events  # logs off: no new event file, and resuming is allowed
    again = json.loads((wd / "result.json").read_text())
    for arm in ("controller", "random"):
        assert again[arm]["decisions"] == res[arm]["decisions"]
        assert again[arm]["test_acc"] == res[arm]["test_acc"]
    assert again["reward_summary"] == res["reward_summary"]
    # a second run into the same workdir refuses without touching it
    assert cli.main(["separable", "--config", f"{cfg_file}:tiny", "--workdir", str(wd), "--no-progress"]) == 2
    assert "already holds a run" in capsys.readouterr().err


@pytest.mark.parametrize("stride, size", [(1, 8), (2, 8), (2, 7)])
def test_grouped_conv_equals_xla_grouped_convolution(stride, size):
    h = jax.random.normal(jax.random.PRNGKey(0), (2, size, size, 6))
    w = jax.random.normal(jax.random.PRNGKey(1), (3, 3, 2, 6))
    want = jax.lax.conv_general_dilated(h, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        feature_group_count=3)
    np.testing.assert_allclose(net.grouped_conv3x3(h, w, stride, 3), want, rtol=1e-5, atol=1e-5)


def test_cluster_from_a_topology_file_equals_the_config_numbers():
    """experiments/topologies/pi_cluster4.yaml describes the default cluster (4 Pi-class nodes, 300 Mbit/s between
    every pair): loading it gives a 'cluster' with the same devices and links as the config's numbers."""
    from jmsnas.separable.config import default_config
    from jmsnas.separable.search import build_cluster
    cfg = default_config()
    from_numbers = build_cluster(cfg)
    cfg.cluster.topology = os.path.join(paths.REPO, "experiments", "topologies",
                                        "pi_cluster4.yaml")
    from_file = build_cluster(cfg)
    assert from_file.kind == "cluster" and from_file.device_names == from_numbers.device_names
    assert [(d.peak_gflops, d.efficiency) for d in from_file.devices] == \
        [(d.peak_gflops, d.efficiency) for d in from_numbers.devices]
    assert sorted((l.src, l.dst, l.bandwidth_mbps, l.latency_ms) for l in from_file.links) == \
        sorted((l.src, l.dst, l.bandwidth_mbps, l.latency_ms) for l in from_numbers.links)


@pytest.mark.slow
def test_control_group_is_uniform_decisions_judged_on_the_controller_arms_weights(tmp_path):
    """Section 4.5's control group: at every controller step, population-many uniform decisions evaluated on the
    controller arm's network (trained this round, fixed during the controller steps) and the validation data."""
    cfg = sconfig.tiny(sconfig.default_config())
    cfg.search.rounds, cfg.reference = 1, False  # the non-separated network plays no part here
    run, cfg = search.prepare(cfg, str(tmp_path / "run"), resume=False)
    state, entry = run.round(run.init_state(), 0)
    control = entry["controller"]["random_on_controller_weights"]
    assert len(control) == cfg.search.ctrl_steps
    params = state["arms"]["controller"]["params"]
    mask = jnp.asarray(run.space.mask())
    draws = [np.asarray(sample_valid(jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(cfg.seed + 2), 0), t),
                                     mask, cfg.search.population)) for t in range(len(control))]
    for got, ops in zip(control, draws):
        assert all(sorted(p) == list(range(run.spec.num_groups))
                   for p in dec.permutation_table(run.spec.num_groups)[run.space.decode(ops)[0].reshape(-1)])
        want = np.mean(run.acc(params, ops) - cfg.search.comm_cost * run.ratio(ops))
        assert got == pytest.approx(float(want), abs=1e-12)
    # on other weights (the random arm's) the same draws score differently: the measurement reads the weights
    other = np.mean([np.mean(run.acc(state["arms"]["random"]["params"], ops)) for ops in draws])
    assert other != pytest.approx(np.mean(control), abs=1e-9)
    assert set(search.reward_summary([entry])["random_on_controller_weights"]) == {"mean_reward",
                                                                                  "last_round_mean_reward"}


def test_shifted_batches_by_hand_and_the_same_for_every_arm():
    """augment_shift: each image moved by its own offset in [-s, s]^2 with the edge rows/columns repeated; the
    training batch of a step is a pure function of (seed, step), so both arms and the reference see the same."""
    x = np.arange(2 * 4 * 4, dtype=np.float32).reshape(2, 4, 4, 1)
    y = search.shift_images(x, 1, np.random.default_rng(0))
    # default_rng(0).integers(0, 3, size=(2, 2)) -> dy = [2, 1], dx = [1, 0]: image 0 one row up, image 1 one
    # column right (offsets dy - 1, dx - 1)
    assert np.array_equal(y[0, :, :, 0], np.array([[4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [12, 13, 14, 15]]))
    assert np.array_equal(y[1, :, :, 0], np.array([[16, 16, 17, 18], [20, 20, 21, 22], [24, 24, 25, 26],
                                                   [28, 28, 29, 30]]))
    assert search.shift_images(x, 0, np.random.default_rng(0)) is x
    cfg = sconfig.tiny(sconfig.default_config())
    assert cfg.search.augment_shift == 1  # the default
    ds = search.data.load("digits", max_train=cfg.max_train)
    a, b = search._batch(ds, cfg, 3), search._batch(ds, cfg, 3)
    cfg.search.augment_shift = 0
    plain = search._batch(ds, cfg, 3)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], plain[1])
    assert not np.array_equal(a[0], plain[0]) and a[0].shape == plain[0].shape
