"""Split solvers against hand-computed cases, the literal eq. (1)/(2) and brute-force enumeration."""
import itertools

import numpy as np
import pytest

from jmsnas.split import dag, mesh, solvers
from jmsnas.split.mesh import MeshNet
from jmsnas.topology import DeviceProfile, LinkProfile, chain, make_topology, transfer_ms

SEEDS = range(6)


def rand_chain(rng, m):
    devs = [DeviceProfile(f"d{i}", 10.0, 1e9) for i in range(m)]
    return chain("rand", devs, list(rng.uniform(2, 60, m - 1)), [1] * m,
                 latencies_ms=list(rng.choice([0.0, 0.5, 2.0], m - 1)))


def rand_costs(rng, n, m):
    speed = np.sort(rng.uniform(0.1, 2.0, m))[::-1]  # later devices tend to be faster
    return rng.uniform(0.2, 4.0, (n, m)) * speed, rng.uniform(200, 30_000, n), float(rng.uniform(1e3, 4e4))


def rand_peak(rng, n):
    w, act = rng.uniform(0, 1000, n), rng.uniform(0, 800, n)
    return lambda layers: float(w[list(layers)].sum() + act[list(layers)].max())


def chain_enumeration(c, b, inb, topo, **kw):
    """All contiguous forward-only assignments (nondecreasing path positions), evaluated one by one."""
    path = np.array(solvers.chain_path(topo))
    best = None
    for pos in itertools.combinations_with_replacement(range(len(path)), c.shape[0]):
        r = solvers.path_latency(path[list(pos)], c, b, inb, topo, **kw)
        if r.feasible and (best is None or r.total_ms < best.total_ms):
            best = r
    return best


# ----------------------------------------------------------------------------------------------- eq. (1)

def hand_topo():
    devs = [DeviceProfile(n, 10.0, 1e9) for n in ("ue", "edge", "cloud")]
    return chain("hand", devs, [8.0, 16.0], [1, 1, 1], latencies_ms=[1.0, 0.0])


HAND_C = np.array([[1.0, 0.5, 0.25], [3.0, 2.0, 1.0], [4.0, 3.0, 1.5], [2.0, 1.0, 0.5]])
HAND_B = np.array([2000.0, 1000.0, 3000.0, 10.0])


def test_eq1_hand_computed():
    topo = hand_topo()
    # ue runs layer 0 and sends 2000 B at 8 Mbit/s (2 ms + 1 ms latency); edge runs 1-2 and sends 3000 B at
    # 16 Mbit/s (1.5 ms); cloud runs 3. Compute 1 + 2 + 3 + 0.5 = 6.5 ms.
    r = solvers.path_latency(np.array([0, 1, 1, 2]), HAND_C, HAND_B, 4000.0, topo)
    assert r.total_ms == pytest.approx(11.0)
    assert r.per_link_ms == pytest.approx({"ue->edge": 3.0, "edge->cloud": 1.5})
    assert r.per_device_ms == pytest.approx({"ue": 1.0, "edge": 5.0, "cloud": 0.5})
    # edge idle: it relays layer 1's 1000 B (1 + 1 ms, then 0.5 ms)
    r = solvers.path_latency(np.array([0, 0, 2, 2]), HAND_C, HAND_B, 4000.0, topo)
    assert r.per_link_ms == pytest.approx({"ue->edge": 2.0, "edge->cloud": 0.5})
    assert r.total_ms == pytest.approx(1 + 3 + 1.5 + 0.5 + 2.5)
    r = solvers.cloud_only(HAND_C, HAND_B, 4000.0, topo)
    assert r.per_link_bytes == {"ue->edge": 4000.0, "edge->cloud": 4000.0}
    assert r.total_ms == pytest.approx(5.0 + 2.0 + 3.25)
    r = solvers.edge_only(HAND_C, HAND_B, 4000.0, topo)
    assert r.total_ms == pytest.approx(10.0) and r.transmitted_bytes == 0


@pytest.mark.parametrize("seed", SEEDS)
def test_path_latency_is_eq1_when_every_device_is_busy(seed):
    rng = np.random.default_rng(seed)
    m, n = 4, 7
    topo = rand_chain(rng, m)
    c, b, inb = rand_costs(rng, n, m)
    bounds = np.sort(rng.choice(np.arange(1, n), m - 1, replace=False))
    groups = np.split(np.arange(n), bounds)  # D^m, all non-empty
    eps = [transfer_ms(b[g[-1]], l.bandwidth_mbps, l.latency_ms) for g, l in zip(groups, topo.links)] + [0.0]
    eq1 = sum(c[g, mi].sum() + eps[mi] for mi, g in enumerate(groups))
    a = np.concatenate([[mi] * len(g) for mi, g in enumerate(groups)])
    assert solvers.path_latency(a, c, b, inb, topo).total_ms == pytest.approx(eq1)


# ----------------------------------------------------------------------------------------------- chain DP

@pytest.mark.parametrize("seed", SEEDS)
def test_chain_dp_matches_enumeration(seed):
    rng = np.random.default_rng(seed)
    m, n = int(rng.integers(2, 5)), int(rng.integers(3, 8))
    topo = rand_chain(rng, m)
    c, b, inb = rand_costs(rng, n, m)
    r = solvers.chain_dp(c, b, inb, topo)
    assert r.total_ms == pytest.approx(chain_enumeration(c, b, inb, topo).total_ms)
    assert sum(r.per_device_ms.values()) + sum(r.per_link_ms.values()) == pytest.approx(r.total_ms)


def test_chain_dp_instances_are_not_trivial():
    """The random instances above do exercise multi-device optima (otherwise the oracle test proves little)."""
    busy = []
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        m, n = int(rng.integers(2, 5)), int(rng.integers(3, 8))
        topo = rand_chain(rng, m)
        r = solvers.chain_dp(*rand_costs(rng, n, m), topo)
        busy.append(len(set(r.assignment.tolist())))
    assert max(busy) >= 2


@pytest.mark.parametrize("seed", SEEDS)
def test_chain_dp_memory_limits_match_enumeration(seed):
    rng = np.random.default_rng(100 + seed)
    m, n = int(rng.integers(2, 5)), int(rng.integers(3, 8))
    topo = rand_chain(rng, m)
    c, b, inb = rand_costs(rng, n, m)
    peak = rand_peak(rng, n)
    limits = [float(rng.uniform(900, 3000)) for _ in range(m - 1)] + [np.inf]
    r = solvers.chain_dp(c, b, inb, topo, peak=peak, memory_limits=limits)
    ref = chain_enumeration(c, b, inb, topo, peak=peak, memory_limits=limits)
    assert r.feasible and r.total_ms == pytest.approx(ref.total_ms)
    calls = []
    counted = lambda layers: calls.append(layers) or peak(layers)  # rand_peak is monotone in the range
    fast = solvers.chain_dp(c, b, inb, topo, peak=counted, memory_limits=limits, monotone_peak=True)
    assert fast.total_ms == pytest.approx(ref.total_ms)
    assert len(calls) <= 2 * (n + 1) * m + n  # two pointers per device (+ the final evaluation)
    assert all(r.peak_bytes[d] <= lim for d, lim in zip(topo.device_names, limits))


@pytest.mark.parametrize("seed", SEEDS)
def test_chain_dp_with_skip_edges_matches_contiguous_enumeration(seed):
    rng = np.random.default_rng(200 + seed)
    m, n = 3, 6
    topo = rand_chain(rng, m)
    c, b, inb = rand_costs(rng, n, m)
    edges = [(i - 1, i) for i in range(n)] + [(-1, 2), (0, 3), (1, 5)]
    r = solvers.chain_dp(c, b, inb, topo, edges=edges)
    assert r.total_ms == pytest.approx(chain_enumeration(c, b, inb, topo, edges=edges).total_ms)


def test_chain_dp_devices_restriction_and_infeasible():
    rng = np.random.default_rng(7)
    topo = rand_chain(rng, 4)
    c, b, inb = rand_costs(rng, 6, 4)
    r = solvers.chain_dp(c, b, inb, topo, devices=["d0", "d2"])
    assert set(r.assignment.tolist()) <= {0, 2}
    ref = min(solvers.path_latency(np.array([0] * k + [2] * (6 - k)), c, b, inb, topo).total_ms for k in range(7))
    assert r.total_ms == pytest.approx(ref)
    with pytest.raises(solvers.InfeasibleSplitError, match="memory limits"):
        solvers.chain_dp(c, b, inb, topo, peak=lambda layers: 10.0 * len(layers), memory_limits=[5.0] * 4)


def test_cut_bytes_counts_each_tensor_once():
    # layer 0 is read by layers 1, 2 and 3: across cuts 1..3 it counts once; the input is read by layer 2 too
    cut = solvers.cut_bytes(np.array([10.0, 20.0, 40.0, 80.0]), 5.0, ((-1, 0), (0, 1), (0, 2), (0, 3), (-1, 2),
                                                                      (1, 2), (2, 3)))
    assert cut.tolist() == [5.0, 15.0, 35.0, 50.0, 0.0]


# ----------------------------------------------------------------------------------------------- Neurosurgeon

@pytest.mark.parametrize("pair", [None, ("d0", "d2"), ("d1", "d3")])
def test_neurosurgeon_matches_single_split_enumeration(pair):
    for seed in SEEDS:
        rng = np.random.default_rng(300 + seed)
        topo = rand_chain(rng, 4)
        n = 7
        c, b, inb = rand_costs(rng, n, 4)
        da, db = (0, 3) if pair is None else (int(pair[0][1]), int(pair[1][1]))
        ref = min(solvers.path_latency(np.array([da] * k + [db] * (n - k)), c, b, inb, topo).total_ms
                  for k in range(n + 1))
        r = solvers.neurosurgeon(c, b, inb, topo, devices=pair)
        assert r.total_ms == pytest.approx(ref)


def mobilenet_like():
    """MobileNet-v2-like stages on a 224x224x3 8-bit input: bytes per layer output (int8) and MACs."""
    hw_c = [(112, 32), (112, 16), (56, 24), (28, 32), (14, 64), (14, 96), (7, 160), (7, 320), (7, 1280), (1, 1280),
            (1, 1000)]
    macs = np.array([10.8, 5.0, 40.0, 38.0, 30.0, 45.0, 40.0, 35.0, 16.0, 0.06, 1.28]) * 1e6
    return np.array([h * h * ch for h, ch in hw_c], float), macs, 224 * 224 * 3.0


def test_neurosurgeon_bandwidth_sweep():
    out_b, macs, inb = mobilenet_like()
    c = np.stack([macs * 2 / 5e9 * 1e3, macs * 2 / 1e12 * 1e3], axis=1)  # ms: edge 5 GFLOP/s, cloud 1 TFLOP/s
    sent, splits = [], []
    for bw in np.geomspace(1e5, 0.5, 14):  # Mbit/s, high to low
        topo = chain("sweep", [DeviceProfile("edge", 5.0, 1e9), DeviceProfile("cloud", 1000.0, 1e12)], [bw], [1, 1])
        r = solvers.neurosurgeon(c, out_b, inb, topo)
        sent.append(r.transmitted_bytes)
        splits.append(int((r.assignment == 0).sum()))
    assert splits[0] == 0  # fast link, faster cloud: cloud-only, the raw input is sent
    assert all(x >= y for x, y in zip(sent, sent[1:])), sent
    assert splits[-1] == len(out_b) and sent[-1] == 0  # slow link: edge-only
    assert len(set(splits)) >= 3  # the sweep passes through intermediate splits
    assert splits == sorted(splits)  # the cloud is faster on every layer, so the index never moves back


def test_neurosurgeon_split_index_can_move_back():
    """Bytes sent never increase as bandwidth falls, but the split index can retreat to an earlier layer with a
    smaller output when the edge runs some layer faster than the cloud (here layer 1: 1 ms vs 3 ms)."""
    c = np.array([[4.0, 1.0], [1.0, 3.0], [8.0, 1.0]])  # ms on (edge, cloud)
    out_b, inb = np.array([5e4, 8e4, 10.0]), 1e5
    splits, sent = [], []
    for bw in np.geomspace(400, 20, 16):
        topo = chain("back", [DeviceProfile("edge", 5.0, 1e9), DeviceProfile("cloud", 1000.0, 1e12)], [bw], [1, 1])
        r = solvers.neurosurgeon(c, out_b, inb, topo)
        splits.append(int((r.assignment == 0).sum()))
        sent.append(r.transmitted_bytes)
    assert [k for i, k in enumerate(splits) if i == 0 or k != splits[i - 1]] == [0, 2, 1, 3]
    assert all(x >= y for x, y in zip(sent, sent[1:]))


# ----------------------------------------------------------------------------------------------- mesh

def rand_mesh(rng, n_pre, n_br, n_post):
    names = [f"p{i}" for i in range(n_pre)] + ["r"] + [f"b{i}" for i in range(n_br)] + [f"q{i}" for i in range(n_post)]
    devs = [DeviceProfile(x, 10.0, 1e9) for x in names]
    bw = lambda: float(rng.uniform(2, 60))
    chain_pre = [f"p{i}" for i in range(n_pre)] + ["r"]
    post = [f"q{i}" for i in range(n_post)]
    links = [LinkProfile(x, y, bw(), float(rng.choice([0.0, 1.0]))) for x, y in zip(chain_pre, chain_pre[1:])]
    links += [LinkProfile("r", f"b{i}", bw()) for i in range(n_br)]
    links += [LinkProfile(f"b{i}", "q0", bw(), float(rng.choice([0.0, 1.0]))) for i in range(n_br)]
    links += [LinkProfile(x, y, bw()) for x, y in zip(post, post[1:])]
    return make_topology("randmesh", devs, links, [1] * len(devs))


def mesh_assignments(topo, net):
    pre, post, agg = tuple(topo.pre) + (topo.root,), tuple(topo.post), topo.post[0]
    for pp in itertools.combinations_with_replacement(pre, net.prefix):
        for us in itertools.product(*[range(L + 1) for L in net.branches]):
            br = [d for i, (u, L) in enumerate(zip(us, net.branches)) for d in [topo.branches[i]] * u + [agg] * (L - u)]
            for sp in itertools.combinations_with_replacement(post, net.suffix):
                yield np.array(list(pp) + br + list(sp), dtype=int)


MESH_CASES = [((1, 2, 2), MeshNet(2, (2, 1), 2)), ((0, 3, 1), MeshNet(1, (1, 2, 1), 1)),
              ((1, 3, 2), MeshNet(2, (1, 1, 2), 2)), ((2, 2, 1), MeshNet(0, (2, 2), 1))]


@pytest.mark.parametrize("shape,net", MESH_CASES)
def test_mesh_split_matches_enumeration(shape, net):
    for seed in range(3):
        rng = np.random.default_rng(400 + seed)
        topo = rand_mesh(rng, *shape)
        c, b, inb = rand_costs(rng, net.num_layers, topo.num_devices)
        r = mesh.mesh_split(c, b, inb, topo, net)
        ref = min(mesh.mesh_latency(a, c, b, inb, topo, net).total_ms for a in mesh_assignments(topo, net))
        assert r.total_ms == pytest.approx(ref)


@pytest.mark.parametrize("agg_limited", [False, True])
def test_mesh_split_memory_matches_enumeration(agg_limited):
    shape, net = (1, 2, 2), MeshNet(2, (2, 2), 2)
    for seed in range(3):
        rng = np.random.default_rng(500 + seed)
        topo = rand_mesh(rng, *shape)
        n = net.num_layers
        c, b, inb = rand_costs(rng, n, topo.num_devices)
        peak = rand_peak(rng, n)
        limits = {d: float(rng.uniform(900, 2500)) for d in ("p0", "r", "b0", "b1", "q1")}
        limits["q0"] = float(rng.uniform(2000, 3500)) if agg_limited else np.inf
        feas = [mesh.mesh_latency(a, c, b, inb, topo, net, peak=peak, memory_limits=limits)
                for a in mesh_assignments(topo, net)]
        ref = min(x.total_ms for x in feas if x.feasible)
        r = mesh.mesh_split(c, b, inb, topo, net, peak=peak, memory_limits=limits)
        assert r.feasible and r.total_ms == pytest.approx(ref)


def test_mesh_latency_is_eq2_when_every_device_is_busy():
    rng = np.random.default_rng(9)
    topo = rand_mesh(rng, 1, 3, 2)  # p0, r, b0..b2, q0 (aggregator), q1
    net = MeshNet(3, (2, 3, 2), 3)
    c, b, inb = rand_costs(rng, net.num_layers, topo.num_devices)
    ix = {d: i for i, d in enumerate(topo.device_names)}
    D = {"p0": [0, 1], "r": [2], "b0": [3], "b1": [5, 6], "b2": [8], "q0": [4, 7, 9, 10], "q1": [11, 12]}
    a = np.zeros(net.num_layers, dtype=int)
    for d, ls in D.items():
        a[ls] = ix[d]
    tau = {d: c[ls, ix[d]].sum() for d, ls in D.items()}
    eps = lambda x, y, layer: transfer_ms(b[layer], topo.links[topo.link_index(ix[x], ix[y])].bandwidth_mbps,
                                          topo.links[topo.link_index(ix[x], ix[y])].latency_ms)
    chain_part = tau["p0"] + eps("p0", "r", 1) + tau["q0"] + eps("q0", "q1", 10) + tau["q1"]
    tree = max(tau["r"] + eps("r", f"b{i}", 2) + tau[f"b{i}"] + eps(f"b{i}", "q0", max(D[f"b{i}"])) for i in range(3))
    r = mesh.mesh_latency(a, c, b, inb, topo, net)
    assert r.total_ms == pytest.approx(chain_part + tree)


# ----------------------------------------------------------------------------------------------- DAG min-cut

DAG_EDGES = [(-1, 0), (0, 1), (1, 2), (0, 2), (2, 3), (0, 3), (3, 4), (-1, 4), (4, 5), (2, 5), (5, 6), (3, 6)]


def rand_dag_costs(rng, n, m):
    """Per-layer device preferences vary and tensors are small, so DAG optima split across devices."""
    return rng.uniform(0.2, 6.0, (n, m)), rng.uniform(50, 1500, n), float(rng.uniform(500, 3000))


def dag_enumeration(c, b, inb, edges, topo, devices):
    best = np.inf
    for a in itertools.product(devices, repeat=c.shape[0]):
        if all(u < 0 or a[u] <= a[v] for u, v in edges):  # downward-closed: data only moves forward
            best = min(best, solvers.path_latency(np.array(a), c, b, inb, topo, edges=edges).total_ms)
    return best


@pytest.mark.parametrize("seed", SEEDS)
def test_dag_min_cut_two_devices_matches_all_closed_subsets(seed):
    rng = np.random.default_rng(600 + seed)
    topo = rand_chain(rng, 3)
    c, b, inb = rand_dag_costs(rng, 7, 3)
    r = dag.dag_min_cut(c, b, inb, DAG_EDGES, topo, devices=("d0", "d2"))
    assert r.total_ms == pytest.approx(dag_enumeration(c, b, inb, DAG_EDGES, topo, (0, 2)))


@pytest.mark.parametrize("seed", SEEDS)
def test_dag_min_cut_multiway_matches_enumeration(seed):
    rng = np.random.default_rng(700 + seed)
    topo = rand_chain(rng, 3)
    c, b, inb = rand_dag_costs(rng, 7, 3)
    r = dag.dag_min_cut(c, b, inb, DAG_EDGES, topo)
    assert r.total_ms == pytest.approx(dag_enumeration(c, b, inb, DAG_EDGES, topo, (0, 1, 2)))


def test_dag_instances_are_not_trivial():
    used = []
    for seed in SEEDS:
        rng = np.random.default_rng(700 + seed)
        topo = rand_chain(rng, 3)
        used.append(len(set(dag.dag_min_cut(*rand_dag_costs(rng, 7, 3)[:3], DAG_EDGES, topo).assignment.tolist())))
    assert max(used) == 3


def test_dag_tensor_with_several_far_consumers_is_paid_once():
    # layer 0's 1000 B output feeds layers 1, 2 and 3; putting 1-3 on the cloud should cost one transfer
    topo = chain("two", [DeviceProfile("edge", 1.0, 1e9), DeviceProfile("cloud", 1.0, 1e9)], [8.0], [1, 1])
    edges = [(-1, 0), (0, 1), (0, 2), (0, 3)]
    c = np.array([[0.0, 100.0], [1.6, 1.0], [1.6, 1.0], [1.6, 1.0]])
    b = np.array([1000.0, 1.0, 1.0, 1.0])
    r = dag.dag_min_cut(c, b, 1e6, edges, topo)
    # once per tensor: 1 ms transfer + 3 ms cloud = 4 < 4.8 (all on the edge); counted once per consumer the
    # transfer would look like 3 ms, 6 > 4.8, and the cut would keep everything on the edge
    assert r.assignment.tolist() == [0, 1, 1, 1]
    assert r.total_ms == pytest.approx(4.0) and r.per_link_bytes["edge->cloud"] == 1000.0


def test_dag_chain_equals_chain_dp():
    rng = np.random.default_rng(11)
    topo = rand_chain(rng, 4)
    c, b, inb = rand_costs(rng, 30, 4)
    assert dag.dag_min_cut(c, b, inb, None, topo).total_ms == pytest.approx(solvers.chain_dp(c, b, inb, topo).total_ms)


# ----------------------------------------------------------------------------------------------- bad input

def test_bad_inputs_raise_value_error_naming_them():
    topo = hand_topo()
    with pytest.raises(ValueError, match=r"compute_ms must have shape \[N >= 1, 3\]"):
        solvers.chain_dp(HAND_C[:, :2], HAND_B, 10.0, topo)
    with pytest.raises(ValueError, match="out_bytes must have shape"):
        solvers.neurosurgeon(HAND_C, HAND_B[:3], 10.0, topo)
    neg = HAND_C.copy()
    neg[1, 2] = -1.0
    with pytest.raises(ValueError, match=r"compute_ms must be finite and >= 0, got -1.0 at index \(1, 2\)"):
        solvers.chain_dp(neg, HAND_B, 10.0, topo)
    nan = HAND_B.copy()
    nan[2] = np.nan
    with pytest.raises(ValueError, match="out_bytes must be finite"):
        solvers.edge_only(HAND_C, nan, 10.0, topo)
    with pytest.raises(ValueError, match="input_bytes"):
        solvers.cloud_only(HAND_C, HAND_B, float("nan"), topo)
    with pytest.raises(ValueError, match="edge"):
        dag.dag_min_cut(HAND_C, HAND_B, 10.0, [(-1, 0), (2, 1)], topo)
    with pytest.raises(ValueError, match="backwards"):
        solvers.path_latency(np.array([0, 1, 0, 2]), HAND_C, HAND_B, 10.0, topo)
    with pytest.raises(ValueError, match="without a peak"):
        solvers.chain_dp(HAND_C, HAND_B, 10.0, topo, memory_limits=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        solvers.neurosurgeon(HAND_C, HAND_B, 10.0, topo, devices=("ue", "gpu"))
    with pytest.raises(ValueError, match="mesh topology"):
        mesh.mesh_split(HAND_C, HAND_B, 10.0, topo, MeshNet(1, (1,), 2))
