"""A separable network deployed (jmsnas.deploy.separable): G = 4 worker processes, each running its group as a
sequence of stages and exchanging sparse float16 features with the others; the outputs equal the training code's
whole network (``separable.network.apply``)."""
import json
import os
import shutil

import jax
import numpy as np
import pytest

from jmsnas import cli, data
from jmsnas.deploy.pipeline import run_pipeline
from jmsnas.deploy import netlab, separable as DSEP
from jmsnas.deploy.separable import export_separable, whole_network
from jmsnas.separable import config as sconfig, cost, decisions as dec, network as net
from jmsnas.separable.parts import read_parts, write_parts
from jmsnas.separable.search import build_cluster
from test_deploy_hosts import _daemon, _hosts_file, _no_session_left

PERM_IDS, LEVELS = (9, 20), (1, 2)  # step 0: the cycle 0->1->2->3->0; step 1: (3, 1, 0, 2), node 1 keeps its own
LINK_LATENCY_MS = 100.0  # every cluster link's: long against a loaded machine's wake-up and GIL delays (~2 ms)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny G = 4, alpha = 2 network (2 steps, 3 sparsity levels, float16 transfer) stored as ``jmsnas
    separable`` stores it, random weights; the stem on node1, the head on node2."""
    d = str(tmp_path_factory.mktemp("separable"))
    spec = net.make_spec(num_groups=4, image_size=8, in_channels=1, num_classes=10, stem_channels=8,
                         stage_channels=(8, 12), stage_blocks=(2, 2), stage_strides=(1, 2), cardinality=8,
                         path_width=2, alpha=2, num_levels=3, float16=True, output_group=2)
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(lambda a: np.asarray(a) + rng.normal(0.0, 0.1, np.shape(a)).astype(np.float32),
                                    net.init(jax.random.PRNGKey(0), spec))
    cfg = sconfig.tiny(sconfig.default_config())
    cfg.cluster.link_latency_ms = LINK_LATENCY_MS
    write_parts(d, spec, params, PERM_IDS, LEVELS, build_cluster(cfg), input_device=1)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"command": "separable", "config": cfg.to_dict()}, f)
    x = rng.normal(0.0, 1.0, (3, 8, 8, 1)).astype(np.float32)
    want = np.asarray(jax.jit(net.apply, static_argnums=0)(spec, params, x, np.asarray(PERM_IDS), np.asarray(LEVELS)))
    return d, spec, params, x, want


@pytest.mark.slow
def test_four_groups_through_the_pipeline_equal_the_whole_network(run):
    """Four worker processes, links per (sender, receiver): outputs == network.apply within 1e-5 of the largest
    logit; the stored parts read back as the params written; every link carries the sender's first N_send channels
    in float16."""
    d, spec, params, x, want = run
    back = read_parts(d)
    assert back.spec == spec and back.perm_ids.tolist() == list(PERM_IDS) and back.levels.tolist() == list(LEVELS)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(back.params),
                                                    jax.tree_util.tree_leaves(params)))
    m = export_separable(d)
    assert m["kind"] == "separable" and m["order"][-1] == "node2"  # the output node last
    assert [d for d in m["order"] for i in m["parts"][d]["inputs"] if i["from"] == "image"] == ["node1"]
    dest = dec.permutation_table(4)[list(PERM_IDS)]
    want_links = {}
    for s in range(2):  # by hand: step s, node g sends 8 x 8 (s = 0) / 4 x 4 (s = 1) pixels x N_send x 2 bytes
        px = 64 if s == 0 else 16
        for g in range(4):
            if dest[s, g] != g:
                key = (f"node{g}", f"node{dest[s, g]}")
                want_links[key] = want_links.get(key, 0) + px * spec.nsend[s][LEVELS[s]] * 2
    for g in (0, 2, 3):  # the stem's output, float32 8 x 8 x 8, from node1 to every other node
        want_links[("node1", f"node{g}")] = want_links.get(("node1", f"node{g}"), 0) + 64 * 8 * 4
    assert {(l["src"], l["dst"]): l["bytes"] for l in m["links"]} == want_links
    # float32, summed in another order by every program (XLA fuses each part on its own): 1e-5 of the largest
    # logit (an AVX2 host gave 1.7e-5 on logits up to 7.8, 2e-6 of them; an AVX-512 one under 1e-5)
    tol = 1e-5 * max(1.0, float(np.max(np.abs(want))))
    assert np.max(np.abs(whole_network(d)(x) - want)) <= tol
    raw = run_pipeline(os.path.join(d, "export"), x, phase="latency")
    diff = float(np.max(np.abs(raw["outputs"] - want)))
    print(f"max |pipeline - whole network| = {diff:.2e} (tolerance {tol:.1e})")
    assert diff <= tol
    senders = {f"node{g}": {a for a, b in want_links if b == f"node{g}"} for g in range(4)}
    senders["node1"] |= {"image"}
    for dev, srcs in senders.items():  # every receiver heard from exactly its senders
        assert set(raw["records"]["latency"][dev][0]["in"]) == srcs


@pytest.mark.slow
def test_a_missing_stage_file_one_line_exit_2(run, tmp_path, capsys):
    """A stage's program missing from the export: one line naming the part and the file, exit 2, no process."""
    d = run[0]
    out = str(tmp_path / "export")
    assert cli.main(["export", "--workdir", d, "--out", out]) == 0
    assert "node2" in capsys.readouterr().out
    os.remove(os.path.join(out, "node3.1.jaxexport"))
    assert cli.main(["pipeline", "--workdir", d, "--export-dir", out, "--images", "2", "--check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "part 'node3'" in err[0] and "node3.1.jaxexport is missing" in err[0], err
    # a device's part missing from the run itself: the export refuses with one line and writes nothing
    bad = tmp_path / "run"
    shutil.copytree(d, bad, ignore=shutil.ignore_patterns("export"))
    os.remove(bad / "parts" / "node0.npz")
    assert cli.main(["export", "--workdir", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "node0.npz" in err[0] and not (bad / "export").exists(), err


def test_the_pipelines_images_are_the_runs_test_split(run):
    """``jmsnas pipeline --workdir RUN`` streams the run's own test images (its stored config's digits split)."""
    x, y = DSEP.test_images(run[0], 4)
    ds = data.load("digits", seed=0, val_fraction=0.15, max_train=256)  # the tiny config's
    assert np.array_equal(x, ds.test.images[:4]) and np.array_equal(y, ds.test.labels[:4])


def test_a_latency_table_for_a_separable_run_is_one_line(run, tmp_path, capsys):
    """--predict-table times the JMSNAS space, not a separable network's blocks: one line, exit 2, nothing written."""
    d = str(tmp_path / "run")
    shutil.copytree(run[0], d, ignore=shutil.ignore_patterns("export", "deploy"))
    assert cli.main(["pipeline", "--workdir", d, "--predict-table", str(tmp_path / "table.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "separable.cost" in err[0] and "table.json" in err[0], err
    assert not os.path.exists(os.path.join(d, "export")) and not os.path.exists(os.path.join(d, "deploy"))


def _cost_of(run_dir: str, bandwidth_mbps: float) -> dict:
    """The oracle: ``separable.cost.evaluate`` of the stored decisions on the cluster the run's config builds with
    every link at ``bandwidth_mbps`` (a config edit, not the deploy code's scaling)."""
    cfg = sconfig.tiny(sconfig.default_config())
    cfg.cluster.link_latency_ms, cfg.cluster.bandwidth_mbps = LINK_LATENCY_MS, bandwidth_mbps
    return cost.evaluate(read_parts(run_dir).spec, build_cluster(cfg), np.asarray(PERM_IDS), np.asarray(LEVELS), 1)


def test_the_prediction_is_the_cost_model_of_the_stored_decisions(run, tmp_path):
    """The separable pipeline's prediction at a bandwidth scale equals ``separable.cost.evaluate`` on the run's
    cluster with its links at that bandwidth; the export records the per-device compute and per-link times, and
    its link bytes are the cost model's."""
    d = run[0]
    base = build_cluster(sconfig.tiny(sconfig.default_config())).links[0].bandwidth_mbps
    for scale in (1.0, 0.25):
        assert DSEP.evaluate(d, scale) == _cost_of(d, base * scale)
    want = _cost_of(d, base)
    # node1 -> the others (the stem), the cycle 0->1->2->3->0, then 0->3, 2->0, 3->2 (1->2 carries two frames)
    assert want["latency_ms"] > 0 and len(want["link_ms"]) == 9
    m = export_separable(d, str(tmp_path / "export"))
    assert {p: m["parts"][p]["predicted_compute_ms"] for p in m["order"]} == want["compute_ms"]
    assert {f"{l['src']}->{l['dst']}": l["predicted_ms"] for l in m["links"]} == want["link_ms"]
    assert {f"{l['src']}->{l['dst']}": l["bytes"] for l in m["links"]} == want["link_bytes"]


@pytest.mark.slow
def test_separable_parts_over_hosts_check_and_predicted_vs_measured(run, tmp_path, capsys):
    """``jmsnas pipeline --hosts --check`` on the four groups, each on a ``jmsnas worker --listen`` at its own
    address: the composed parts equal the whole network; the report holds the cost model's figures (predicted ==
    ``separable.cost.evaluate``) beside a measured term for every device and link. In network namespaces (every
    link also under the kernel's tbf at the cluster's rate) each link's measured time is within 5% of its predicted
    one; on loopback (no namespaces here): structure and sign only. The links are paced in user space in both:
    every frame of this run (<= 2 KB) fits tbf's 3000-byte burst, and this kernel has no netem for the latency, so
    the kernel alone would not shape them."""
    d = run[0]
    devices = [f"node{g}" for g in range(4)]
    reason, lab, daemons = netlab.available(), None, []
    if reason and os.environ.get("JMSNAS_REQUIRE_NETNS") == "1":
        pytest.fail(f"JMSNAS_REQUIRE_NETNS=1 but network namespaces cannot be used: {reason}")
    m = read_parts(d)
    secret = str(tmp_path / "secret")  # every link authenticated (the cycle of data links too)
    with open(secret, "w") as f:
        f.write("separable-hosts-secret-0123456789")
    try:
        if reason is None:
            links = {(l["src"], l["dst"]): l["bandwidth_mbps"] for l in m.links}
            lab = netlab.create(devices, links)
            hosts = {x: f"{lab.addresses[x]}:7000" for x in devices}
            daemons = [_daemon(hosts[x], lab=lab, device=x, wait=False, flags=["--secret-file", secret])
                       for x in devices]
            for p in daemons:
                line = p.stdout.readline()
                assert "listening on" in line, line
        else:
            from jmsnas.deploy import links as L
            ports = []
            for _ in devices:
                s = L.listen(0)
                ports.append(s.getsockname()[1])
                s.close()
            hosts = {x: f"127.0.0.1:{p}" for x, p in zip(devices, ports)}
            daemons = [_daemon(hosts[x], flags=["--secret-file", secret]) for x in devices]
        argv = ["pipeline", "--workdir", d, "--export-dir", str(tmp_path / "export"), "--hosts",
                _hosts_file(tmp_path, hosts), "--check", "--phase", "latency", "--images", "8", "--json",
                "--secret-file", secret]
        assert cli.main(argv) == 0, capsys.readouterr().err
        a = json.loads(capsys.readouterr().out)[0]
    finally:
        if lab is not None:
            netlab.destroy(lab)
        for p in daemons:
            p.terminate()
            p.wait()
    _no_session_left()
    assert a["max_abs_diff"] <= 1e-5 and a["where"] == hosts
    want = DSEP.evaluate(d)
    p, got = a["predicted"], a["measured"]
    assert p["total"] == want["latency_ms"] and p["per_device"] == want["compute_ms"]
    assert p["per_link"] == want["link_ms"]
    assert set(got["per_device"]) == set(devices) and set(got["per_link"]) == set(want["link_ms"])
    assert all(v > 0 for v in [got["total"], *got["per_device"].values(), *got["per_link"].values()]), got
    assert a["error_pct"] == pytest.approx(100 * (got["total"] / p["total"] - 1))
    print({k: (round(v, 3), round(p["per_link"][k], 3)) for k, v in got["per_link"].items()}, a["clock"])
    if lab is not None:
        for k, v in got["per_link"].items():
            assert v == pytest.approx(p["per_link"][k], rel=0.05), (k, v, p["per_link"][k])
