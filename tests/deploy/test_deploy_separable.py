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
from jmsnas.deploy import separable as DSEP
from jmsnas.deploy.separable import export_separable, whole_network
from jmsnas.separable import config as sconfig, decisions as dec, network as net
from jmsnas.separable.parts import read_parts, write_parts
from jmsnas.separable.search import build_cluster

PERM_IDS, LEVELS = (9, 20), (1, 2)  # step 0: the cycle 0->1->2->3->0; step 1: (3, 1, 0, 2), node 1 keeps its own


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
    write_parts(d, spec, params, PERM_IDS, LEVELS, build_cluster(cfg), input_device=1)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"command": "separable", "config": cfg.to_dict()}, f)
    x = rng.normal(0.0, 1.0, (3, 8, 8, 1)).astype(np.float32)
    want = np.asarray(jax.jit(net.apply, static_argnums=0)(spec, params, x, np.asarray(PERM_IDS), np.asarray(LEVELS)))
    return d, spec, params, x, want


@pytest.mark.slow
def test_four_groups_through_the_pipeline_equal_the_whole_network(run):
    """Four worker processes, links per (sender, receiver): outputs == network.apply within 1e-5; the stored parts
    read back as the params written; every link carries the sender's first N_send channels in float16."""
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
    assert np.max(np.abs(whole_network(d)(x) - want)) <= 1e-5
    raw = run_pipeline(os.path.join(d, "export"), x, phase="latency")
    diff = float(np.max(np.abs(raw["outputs"] - want)))
    print(f"max |pipeline - whole network| = {diff:.2e}")
    assert diff <= 1e-5
    senders = {f"node{g}": {a for a, b in want_links if b == f"node{g}"} for g in range(4)}
    senders["node1"] |= {"image"}
    for dev, srcs in senders.items():  # every receiver heard from exactly its senders
        assert set(raw["records"]["latency"][dev][0]["in"]) == srcs


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
