"""SplitNets multi-view deployed (jmsnas.deploy.splitnets): V = 4 sensor processes on the shared bus, one aggregator;
the outputs equal the training code's own forward pass of the whole network."""
import json
import os

import jax
import numpy as np
import pytest

from jmsnas import safeio
from jmsnas.deploy import predict
from jmsnas.deploy.pipeline import run_pipeline
from jmsnas.deploy.runtime import load_manifest
from jmsnas.deploy import splitnets as DS
from jmsnas.deploy.splitnets import export_splitnets, whole_network
from jmsnas.splitnets import net as N
from jmsnas.splitnets.search import write_parts
from jmsnas.splitnets.space import SplitArch, SplitSpace

BUS_MBPS = 40.0
from paths import REPO


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny V = 4 network written as ``jmsnas evolve`` writes it (random weights and BN statistics), split in
    phase 1 after its first block: blocks on both sides, a 3 x 3 x 3 reduced feature per sensor."""
    d = str(tmp_path_factory.mktemp("splitnets"))
    space = SplitSpace(image_size=6, in_channels=1, num_classes=10, views=4, stem_channels=4, phase_channels=(8, 12),
                       phase_strides=(1, 2), max_depth=2, kernels=(3, 5), expands=(3,), reductions=(2, 4),
                       head_channels=16)
    rng = np.random.default_rng(0)  # shapes from the initialiser (eval_shape: nothing runs), values drawn here
    draw = lambda path, a: {"var": np.abs(rng.normal(1.0, 0.3, a.shape)) + 0.1, "scale": rng.normal(1.0, 0.2, a.shape)
                            }.get(str(getattr(path[-1], "key", "")), rng.normal(0.0, 0.3, a.shape)).astype(np.float32)
    params, bn = jax.tree_util.tree_map_with_path(draw, jax.eval_shape(lambda: N.init(jax.random.PRNGKey(0), space)))
    genes = space.encode(SplitArch(ops=((1, 0), (0, 1)), depth=(2, 2), split=(1, 1), d=3))  # k5 cut from the k5 slot
    write_parts(space, params, bn, genes, d, bus_mbps=BUS_MBPS)
    result = {"flow": "splitnets", "latency_ms": {"total": 3.0, "per_device": {"sensor": 1.0, "aggregator": 1.5},
                                                  "per_link": {"sensor->aggregator": 0.5}}}
    with open(os.path.join(d, "result.json"), "w") as f:
        json.dump(result, f)
    cfg = safeio.import_file(os.path.join(REPO, "experiments", "configs", "splitnets_multiview.py"), "config",
                             "_splitnets_multiview").get_config("tiny")
    cfg.splitnets.view_size, cfg.image_size = 6, 8  # the digits as they are: 4 corner views of 6 x 6
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write(cfg.to_json_best_effort())
    x = rng.normal(0.0, 1.0, (6, 4, 6, 6, 1)).astype(np.float32)
    whole = jax.jit(lambda p, b, x: N.apply_fixed(space, p, b, genes, x, train=False, pos=(1, 1))[0])
    want = np.asarray(whole(params, bn, x))
    return d, space, x, want


@pytest.mark.slow
def test_multiview_parts_through_the_pipeline_equal_the_whole_network(run):
    """Four sensor processes (one view each) and the aggregator, the bus shared as the cost model shares it:
    outputs == the training code's forward (``net.apply_fixed``) within 1e-5; so does the in-process composition."""
    d, space, x, want = run
    m = export_splitnets(d)
    assert m["order"] == ["sensor0", "sensor1", "sensor2", "sensor3", "aggregator"] and m["kind"] == "bus"
    assert [i["view"] for s in m["order"][:4] for i in m["parts"][s]["inputs"]] == [0, 1, 2, 3]
    assert [i["from"] for i in m["parts"]["aggregator"]["inputs"]] == m["order"][:4]
    for link in m["links"]:  # each sender's share of the bus; d = 3 channels of 3 x 3, float32
        assert link["bandwidth_mbps"] == BUS_MBPS / 4 and link["bytes"] == 3 * 3 * 3 * 4
    assert np.max(np.abs(whole_network(d)(x) - want)) <= 1e-5
    given = {s: 1.0 + k for k, s in enumerate(m["order"])}  # a latency table's prediction: the honest mode
    raw = run_pipeline(os.path.join(d, "export"), x, phase="latency", bandwidth_scale=1.0, predicted_compute_ms=given)
    assert np.max(np.abs(raw["outputs"] - want)) <= 1e-5
    assert raw["stretch"] == {s: 1.0 for s in m["order"]}  # every part at host speed, nothing slowed to it
    assert raw["predicted_compute_ms"] == given
    for s in m["order"][:4]:  # every sensor got its own view: the records show one input from the camera each
        assert set(raw["records"]["latency"][s][0]["in"]) == {"image"}
    assert set(raw["records"]["latency"]["aggregator"][0]["in"]) == set(m["order"][:4])


def test_bus_equation_by_hand():
    """T = max_v (sensor_v + its share of the bus) + aggregator; a link at bus/V carries its bytes in V times the
    time the whole bus would."""
    m = {"kind": "bus", "order": ["s0", "s1", "agg"],
         "links": [{"src": "s0", "dst": "agg", "bandwidth_mbps": 5.0, "latency_ms": 0.0, "bytes": 1000},
                   {"src": "s1", "dst": "agg", "bandwidth_mbps": 5.0, "latency_ms": 0.0, "bytes": 1000}]}
    links = predict.predicted_links(m)
    assert links == {"s0->agg": pytest.approx(1.6), "s1->agg": pytest.approx(1.6)}  # 8000 bits / 5 Mbit/s
    assert predict.total_ms(m, {"s0": 1.0, "s1": 2.0, "agg": 0.5}, links) == pytest.approx(2.0 + 1.6 + 0.5)


def test_the_pipelines_images_are_the_runs_multiview_test_split(run):
    """``jmsnas pipeline --workdir RUN`` streams the run's own views: its config's digits test split, cut into the
    4 corner views of 6 x 6 (``splitnets.views``)."""
    from jmsnas import data
    from jmsnas.splitnets import views as VW
    x, y = DS.test_images(run[0], 5)
    ds = data.load("digits", seed=0, val_fraction=0.15, image_size=8, max_train=128)  # the tiny config's
    assert x.shape == (5, 4, 6, 6, 1)
    assert np.array_equal(x, VW.make_views(ds.test.images[:5], VW.view_origins(8, 6, 4), 6))
    assert np.array_equal(y, ds.test.labels[:5])
