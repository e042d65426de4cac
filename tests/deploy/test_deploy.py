"""jmsnas.deploy: exported parts, the multi-process pipeline over paced TCP links, eq. (1)/(2) oracle, faults.

The runs are tiny (one layer per device, 8 channels) with random weights and non-trivial batch-norm statistics,
written by the main job's own ``pipeline.write_parts``; the images are the digits' real test images.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import pytest

from jmsnas import cli, ops as O, pipeline as main_job
from jmsnas import space as S
from jmsnas.topology import presets
from jmsnas.cost.latency import arch_latency, breakdown_dict
from jmsnas.cost.tables import analytic_table
from jmsnas.deploy import links as L
from jmsnas.deploy import predict, reference
from jmsnas.deploy.export import export_run
from jmsnas.deploy.analysis import analyze
from jmsnas.deploy.pipeline import run_pipeline
from jmsnas.deploy.runtime import DeployError, load_manifest, load_part
from jmsnas.space import OP_NAMES, OPS, build_space

from paths import REPO
SHAPES = {"chain": ((8, 8, 8, 8), (1, 2, 1, 2)), "mesh": ((8, 8, 8, 8, 8, 8), (1, 2, 1, 1, 1, 2))}


def make_run(workdir, kind: str, seed: int = 0, assignment=None, topo=None, shapes=None) -> dict:
    """A finished tiny run: parts/ by ``pipeline.write_parts`` and a result.json with eq. (1)/(2)'s breakdown
    (``topo``, ``shapes`` (channels, strides per device): another topology of that kind than the preset)."""
    topo = presets.topology(kind, (1,) * (4 if kind == "chain" else 6)) if topo is None else topo
    ch, st = SHAPES[kind] if shapes is None else shapes
    space = build_space(topo, image_size=8, in_channels=1, num_classes=10, device_channels=ch, device_strides=st,
                        stem_channels=8, head_channels=16)
    rng = np.random.default_rng(seed)
    mask = space.mask()
    ops = [int(rng.choice(np.flatnonzero(mask[n]))) for n in range(len(mask))]
    key = jax.random.PRNGKey(seed)  # shapes from the initialisers (eval_shape: nothing compiles), values drawn here
    layers = [jax.eval_shape(lambda i=i, s=s: O.op_init(key, OPS[i], s.in_ch, s.out_ch))
              for i, s in zip(ops, space.layers)]
    stem = jax.eval_shape(lambda: O.conv_bn_init(key, 3, 1, 8))
    head = jax.eval_shape(lambda: O.head_init(key, space.layers[-1].out_ch, 16, 10))
    draw = lambda path, a: {"var": np.abs(rng.normal(1.0, 0.3, a.shape)) + 0.1, "scale": rng.normal(1.0, 0.2, a.shape)
                            }.get(str(getattr(path[-1], "key", "")), rng.normal(0.0, 0.3, a.shape)).astype(np.float32)
    fill = lambda t: jax.tree_util.tree_map_with_path(draw, t)
    cp = fill({"stem": stem[0], "head": head[0], "layers": tuple(p for p, _ in layers)})  # as supernet.extract
    cs = fill({"stem": stem[1], "head": head[1], "layers": tuple(st for _, st in layers)})
    os.makedirs(workdir, exist_ok=True)
    main_job.write_parts(space, cp, cs, ops, workdir, assignment)
    table = analytic_table(space)
    devices = space.layer_devices() if assignment is None else assignment
    result = {"topology": kind if topo.name == kind else topo.name, "dataset": "digits", "seed": 0,
              "space": S.to_dict(space),
              "architecture": [{"layer": s.index, "device": topo.device_names[d], "op": OP_NAMES[i]}
                               for s, i, d in zip(space.layers, ops, devices)],
              "latency_ms": breakdown_dict(space, arch_latency(space, table, np.asarray(ops), assignment))}
    with open(os.path.join(workdir, "result.json"), "w") as f:
        json.dump(result, f)
    return {"space": space, "ops": ops, "table": table, "result": result}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for kind in ("chain", "mesh"):
        d = str(tmp_path_factory.mktemp(kind))
        info = make_run(d, kind)
        export_run(d, platforms=("cpu", "cuda") if kind == "chain" else ("cpu",))
        out[kind] = {"dir": d, "export": os.path.join(d, "export"), **info}
    return out


def _workers_of(export_dir: str) -> list:
    """Live worker processes of ``export_dir`` (the local pipeline marks them with JMSNAS_DEPLOY_EXPORT), as
    (pid, state)."""
    found, mark = [], f"JMSNAS_DEPLOY_EXPORT={os.path.abspath(export_dir)}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if mark in env and "jmsnas.deploy.worker" in cmd and state != "Z":
            found.append((int(pid), state))
    return found


def _no_process_left(export_dir, pids):
    assert _workers_of(export_dir) == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ----------------------------------------------------------------------------------- prediction (oracle)

@pytest.mark.parametrize("kind", ["chain", "mesh"])
@pytest.mark.parametrize("scale", [1.0, 0.1])
def test_prediction_is_the_cost_model_eq_1_2(runs, kind, scale):
    """predict() over the exported parts equals jmsnas.cost.latency on the run's table at any bandwidth scale."""
    r = runs[kind]
    m = load_manifest(r["export"])
    table = r["table"]._replace(bandwidth_mbps=r["table"].bandwidth_mbps * scale)
    want = breakdown_dict(r["space"], arch_latency(r["space"], table, np.asarray(r["ops"])))
    got = predict.predict(m, want["per_device"], scale)
    assert got["total"] == pytest.approx(want["total"], rel=1e-5)
    assert got["per_link"] == pytest.approx(want["per_link"], rel=1e-5)


def test_table_prediction_charges_the_per_call_cost_on_every_part(runs, tmp_path):
    """The honest prediction by hand: a part's ops' table entries, the stem (with the table's per-call cost) on the
    first device, the head on the last, and the per-call cost (call + network offset) again on every other part,
    each being a call of its own program."""
    from jmsnas.cost import profile as P
    from jmsnas.space import IDENTITY
    r = runs["chain"]
    space, rng = r["space"], np.random.default_rng(5)
    slots = tuple({"index": s.index, "shape": P.slot_shape(s),
                   "ops": {OP_NAMES[i]: P.Timing(float(rng.uniform(0.01, 0.1)), 0.001, 5)
                           for i in np.flatnonzero(space.mask()[s.index]) if i != IDENTITY}} for s in space.layers)
    t = P.MeasuredTable({"backend": "cpu"}, {"reps": 5}, P.space_summary(space), slots, P.Timing(0.05, 0.0, 5), 0.0,
                        P.Timing(0.02, 0.0, 5), P.Timing(0.03, 0.0, 5),
                        {"method": "in-network", "networks": 3, "offset_ms": 0.25})
    P.write_table(t, tmp_path / "t.yaml")
    got, handoff, _ = predict.table_prediction(r["dir"], str(tmp_path / "t.yaml"))
    assert handoff == {}  # no hand-off terms: eps alone
    names = space.topology.device_names
    order = [names[m] for m in space.topology.path_order()]
    want = {d: 0.05 + 0.25 for d in order}  # every part is one call
    want[order[0]] += 0.02  # stem
    want[order[-1]] += 0.03  # head
    for s, i in zip(space.layers, r["ops"]):
        if i != IDENTITY:
            want[names[s.device]] += t.slots[s.index]["ops"][OP_NAMES[i]].median_ms
    assert got == pytest.approx(want, rel=1e-5)
    assert predict.per_call_ms(t) == pytest.approx(0.30)
    # a table of jmsnas' CPU depthwise kernels does not time what the exported parts run: refused, one line
    P.write_table(t._replace(settings={"reps": 5, "dw_impl": "auto"}), tmp_path / "auto.yaml")
    with pytest.raises(DeployError, match="timed the native or shifted depthwise.*--dw-impl xla"):
        predict.table_prediction(r["dir"], str(tmp_path / "auto.yaml"))
    P.write_table(t._replace(settings={"reps": 5, "dw_impl": "xla"}), tmp_path / "xla.yaml")
    assert predict.table_prediction(r["dir"], str(tmp_path / "xla.yaml")).compute_ms == pytest.approx(want, rel=1e-5)



@pytest.mark.parametrize("kind", ["chain", "mesh"])
def test_table_prediction_with_deployed_terms_is_the_cost_models(runs, tmp_path, kind):
    """A table with deployed terms: every part is charged its entries times the part scale plus the part call cost
    (the stem without the one-call terms), every link its hand-off a + b * bytes, exactly what eq. (1)/(2) charge in the
    search (cost.latency on the table built from the file); a table without them predicts links by eps alone."""
    from jmsnas.cost import profile as P
    from jmsnas.cost.build import build_table
    from jmsnas.space import IDENTITY
    r = runs[kind]
    space, rng = r["space"], np.random.default_rng(6)
    slots = tuple({"index": s.index, "shape": P.slot_shape(s),
                   "ops": {OP_NAMES[i]: P.Timing(float(rng.uniform(0.01, 0.1)), 0.001, 5)
                           for i in np.flatnonzero(space.mask()[s.index]) if i != IDENTITY}} for s in space.layers)
    dep = {"part_call": P.Timing(0.4, 0.0, 5), "part_scale": 1.5,
           "handoff": {"fixed_ms": 0.08, "ms_per_byte": 1e-5, "bytes": [0, 1024], "median_ms": [0.08, 0.09]}}
    t = P.MeasuredTable({"backend": "cpu"}, {"reps": 5}, P.space_summary(space), slots, P.Timing(0.05, 0.0, 5), 0.0,
                        P.Timing(0.02, 0.0, 5), P.Timing(0.03, 0.0, 5),
                        {"method": "in-network", "networks": 3, "offset_ms": 0.25}, dep)
    path = str(tmp_path / "t.yaml")
    P.write_table(t, path)
    names = space.topology.device_names
    order = [names[m] for m in space.topology.path_order()]
    want = {d: 0.0 for d in order}  # every part: 1.5 x its entries + its call cost, no call + offset
    want[order[0]] += 0.02
    want[order[-1]] += 0.03
    for s, i in zip(space.layers, r["ops"]):
        if i != IDENTITY:
            want[names[s.device]] += t.slots[s.index]["ops"][OP_NAMES[i]].median_ms
    want = {d: 0.4 + 1.5 * v for d, v in want.items()}
    got, handoff, _ = predict.table_prediction(r["dir"], path)
    assert got == pytest.approx(want, rel=1e-5)
    assert predict.table_prediction(r["dir"], path, one_host=True).compute_ms == pytest.approx(want, rel=1e-5)
    assert handoff == {**{f"{l.src}->{l.dst}": pytest.approx((0.08, 1e-5)) for l in space.topology.links},
                       "camera": pytest.approx((0.08, 1e-5)), "result": pytest.approx((0.08, 1e-5))}
    m = load_manifest(r["export"])
    pred = predict.predict(m, got, 1.0, handoff)
    cost = arch_latency(space, build_table(space, {d: {"kind": "measured", "path": path} for d in names}),
                        np.asarray(r["ops"]))
    # the coordinator's own hand-offs: the image in (8 x 8 x 1 float32), the logits out (10 float32)
    assert pred["ends"] == pytest.approx({"camera": 0.08 + 1e-5 * 256, "result": 0.08 + 1e-5 * 40}, rel=1e-6)
    assert pred["total"] == pytest.approx(float(cost.total) + sum(pred["ends"].values()), rel=1e-5)
    bare = predict.predicted_links(m, 1.0)
    for l in m["links"]:
        k = f"{l['src']}->{l['dst']}"
        assert pred["per_link"][k] == pytest.approx(bare[k] + 0.08 + 1e-5 * l["bytes"], rel=1e-6)
    unscaled = dict(dep, part_scale=1.0)
    P.write_table(t._replace(deployed=unscaled), tmp_path / "s1.yaml")
    got1 = predict.table_prediction(r["dir"], str(tmp_path / "s1.yaml")).compute_ms
    assert all(got[d] > got1[d] for d in order)  # the scale > 1 grows every compute term, and only them
    assert predict.predict(m, got1, 1.0, handoff)["per_link"] == pred["per_link"]
    P.write_table(t._replace(deployed=None), tmp_path / "one.yaml")
    assert predict.table_prediction(r["dir"], str(tmp_path / "one.yaml")).handoff == {}
    assert predict.predict(m, got, 1.0, {})["per_link"] == bare
    assert "ends" not in predict.predict(m, got, 1.0, {})
    # a table that measured how many cores a part keeps busy: on one host a mesh's branches share them
    P.write_table(t._replace(deployed=dict(dep, host_cores=2, cores_busy=1.5)), tmp_path / "busy.yaml")
    shared = predict.table_prediction(r["dir"], str(tmp_path / "busy.yaml"), one_host=True).compute_ms
    apart = predict.table_prediction(r["dir"], str(tmp_path / "busy.yaml")).compute_ms
    assert apart == pytest.approx(want, rel=1e-5)
    if kind == "chain":  # one image at a time: no part runs beside another
        assert shared == pytest.approx(want, rel=1e-5)
    else:
        branches = [names[b] for b in space.topology.branches]
        assert shared == pytest.approx({**want, **predict.shared_cores({b: want[b] for b in branches}, 1.5, 2)},
                                       rel=1e-5)
        assert all(shared[b] > want[b] for b in branches)


def test_shared_cores_by_hand_and_its_bounds():
    """Processor sharing on one host, hand-computed: parts of 1, 2 and 3 ms each keeping one core busy on 2 cores
    share them 2/3 each until the first ends (1.5 ms), then one core each (2.5 ms), then the last alone (3.5 ms).
    A part alone, or parts that fit in the cores together, end at their own times; the last end is at least the
    total CPU time over the cores."""
    assert predict.shared_cores({"a": 1.0, "b": 2.0, "c": 3.0}, 1.0, 2) == pytest.approx(
        {"a": 1.5, "b": 2.5, "c": 3.5})
    assert predict.shared_cores({"a": 2.0}, 1.7, 2) == pytest.approx({"a": 2.0})
    assert predict.shared_cores({"a": 2.0, "b": 0.5}, 1.0, 2) == pytest.approx({"a": 2.0, "b": 0.5})
    assert predict.shared_cores({"a": 0.0, "b": 1.0}, 2.0, 2) == pytest.approx({"a": 0.0, "b": 1.0})
    rng = np.random.default_rng(0)
    for _ in range(50):
        work = {k: float(rng.uniform(0.1, 5.0)) for k in range(int(rng.integers(1, 6)))}
        busy, cores = float(rng.uniform(0.5, 4.0)), int(rng.integers(1, 5))
        end = predict.shared_cores(work, busy, cores)
        assert all(end[k] >= work[k] * (1 - 1e-9) for k in work)
        assert max(end.values()) >= sum(work.values()) * min(busy, cores) / cores * (1 - 1e-9)
        order = sorted(work, key=work.get)
        assert [end[k] for k in order] == sorted(end.values())  # shorter parts end first
    with pytest.raises(ValueError, match="busy and cores must be > 0"):
        predict.shared_cores({"a": 1.0}, 0.0, 2)

def test_the_wait_curve_prices_parts_and_frames_by_the_hosts_idle_gap_by_hand():
    """On one host a part or a frame costs what the table measured after the host's idle gap before it: a link's
    eps (its transmission and latency: the pacer sleeps), the part after it that link's eps, the first part and the
    coordinator's ends the last part's incoming link's (they follow its compute). Hand-computed on a chain a -> b
    -> c with a curve at 0, 10 and 30 ms (ratio 0.8, 0.9, 1; fixed 0.1, 0.2, 0.4 ms): link a->b 1000 bytes at
    1 Mbit/s + 2 ms = 10 ms, b->c 2500 bytes at 1 Mbit/s + 0 ms = 20 ms (ratio 0.95, fixed 0.3 ms); the aggregator of a mesh waits the link of the path that arrives
    last; without a curve, or on a mesh (its branches run at once: the curve is not applied), nothing changes."""
    m = {"kind": "chain", "order": ["a", "b", "c"],
         "links": [{"src": "a", "dst": "b", "bytes": 1000, "bandwidth_mbps": 1.0, "latency_ms": 2.0},
                   {"src": "b", "dst": "c", "bytes": 2500, "bandwidth_mbps": 1.0, "latency_ms": 0.0}],
         "parts": {"a": {"inputs": [{"from": "image", "shape": [1, 10], "dtype": "float32"}]},
                   "b": {"inputs": []}, "c": {"inputs": [], "output": {"shape": [1, 5], "dtype": "float32"}}}}
    compute = {"a": 1.0, "b": 2.0, "c": 4.0}
    handoff = {"a->b": (0.4, 1e-4), "b->c": (0.4, 1e-4), "camera": (0.4, 0.0), "result": (0.4, 0.0)}
    waits = {"wait_ms": [0.0, 10.0, 30.0], "part_ratio": [0.8, 0.9, 1.0], "handoff_fixed_ms": [0.1, 0.2, 0.4]}
    assert predict.wait_gaps(m, compute) == pytest.approx(
        {"a": 20.0, "b": 10.0, "c": 20.0, "a->b": 10.0, "b->c": 20.0, "camera": 20.0, "result": 20.0})
    got = predict.predict(m, compute, 1.0, handoff, waits=waits)
    assert got["per_device"] == pytest.approx({"a": 0.95, "b": 1.8, "c": 3.8})
    assert got["per_link"] == pytest.approx({"a->b": 10.0 + 0.2 + 0.1, "b->c": 20.0 + 0.3 + 0.25})
    assert got["ends"] == pytest.approx({"camera": 0.3, "result": 0.3})
    assert got["total"] == pytest.approx(0.95 + 1.8 + 3.8 + 10.3 + 20.55 + 0.6)
    one = {"kind": "chain", "order": ["a"], "links": [], "parts": {"a": {"inputs": []}}}
    assert predict.wait_gaps(one, {"a": 1.0}) == {"a": 0.0, "camera": 0.0, "result": 0.0}
    cold = predict.predict(m, compute, 1.0, handoff)
    assert cold["total"] == pytest.approx(7.0 + 10.5 + 20.65 + 0.8)
    assert predict.predict(m, compute, 1.0, handoff, waits={**waits, "wait_ms": [0.0, 10.0, 30.0],
                                                             "part_ratio": [1.0, 1.0, 1.0],
                                                             "handoff_fixed_ms": [0.4, 0.4, 0.4]}) == cold
    mesh = {"kind": "mesh", "order": ["r", "b1", "b2", "g"], "root": "r", "branches": ["b1", "b2"],
            "links": [{"src": s, "dst": d, "bytes": 0, "bandwidth_mbps": 1.0, "latency_ms": lat}
                      for s, d, lat in (("r", "b1", 1.0), ("r", "b2", 5.0), ("b1", "g", 2.0), ("b2", "g", 3.5))]}
    # b1's frame reaches g at 1 + 6 + 2 = 9 ms, b2's at 5 + 1 + 3.5 = 9.5 ms: g waits b2 -> g's 3.5 ms
    assert predict.wait_gaps(mesh, {"r": 1.0, "b1": 6.0, "b2": 1.0, "g": 1.0})["g"] == 3.5
    assert predict.wait_gaps(mesh, {"r": 1.0, "b1": 7.0, "b2": 1.0, "g": 1.0})["g"] == 2.0
    mc = {"r": 1.0, "b1": 6.0, "b2": 1.0, "g": 1.0}
    assert predict.predict(mesh, mc, 1.0, waits=waits) == predict.predict(mesh, mc, 1.0)


def test_mesh_equation_hand_computed():
    """Eq. (2) on Fig. 2(b)'s shape: chain part (ue, cloud, ue->sbs) + the slowest sbs -> mbs -> cloud path."""
    m = {"kind": "mesh", "order": ["ue", "sbs", "b1", "b2", "cloud"], "root": "sbs", "branches": ["b1", "b2"]}
    dev = {"ue": 1.0, "sbs": 2.0, "b1": 3.0, "b2": 5.0, "cloud": 0.5}
    link = {"ue->sbs": 10.0, "sbs->b1": 4.0, "sbs->b2": 1.0, "b1->cloud": 0.25, "b2->cloud": 0.5}
    # paths: 2 + 4 + 3 + 0.25 = 9.25 and 2 + 1 + 5 + 0.5 = 8.5
    assert predict.total_ms(m, dev, link) == pytest.approx(1.0 + 0.5 + 10.0 + 9.25)
    chain = {"kind": "chain", "order": ["a", "b"]}
    assert predict.total_ms(chain, {"a": 1.0, "b": 2.0}, {"a->b": 3.0}) == 6.0
    assert predict.link_ms(6144, 25.0) == pytest.approx(6144 * 8 / 25e3)


@pytest.mark.slow
def test_a_searched_split_with_a_relay_device(tmp_path):
    """A chain split that leaves the mbs without layers: its part relays the tensor, the parts compose to the whole
    network, and the prediction over the parts is eq. (1) of that assignment."""
    run = str(tmp_path)
    info = make_run(run, "chain", seed=1, assignment=np.array([0, 1, 1, 3], np.int32))
    m = export_run(run, batch=5)
    assert m["parts"]["mbs"]["layers"] == [] and m["parts"]["mbs"]["weight_names"] == []
    x, _ = reference.test_images(run, 5)
    h = x
    for d in m["order"]:
        part = load_part(m["run"] + "/export", d)
        y = part(h)
        if d == "mbs":
            assert np.array_equal(y, h)
        h = y
    assert np.max(np.abs(h - reference.whole_network(run)(x))) <= 1e-5
    want = info["result"]["latency_ms"]
    got = predict.predict(export_run(run, str(tmp_path / "b1")), want["per_device"])  # per image: batch 1
    assert got["total"] == pytest.approx(want["total"], rel=1e-5)


# --------------------------------------------------------------------------------------------- export

@pytest.mark.slow
def test_a_part_loads_and_runs_with_only_jax_and_numpy(runs, tmp_path):
    """runtime.py copied alone: the part runs, no jmsnas module is imported, the program is multi-platform and
    has no custom calls (so it runs on any backend it was exported for)."""
    r = runs["chain"]
    shutil.copy(os.path.join(REPO, "jmsnas", "deploy", "runtime.py"), tmp_path / "runtime.py")
    code = textwrap.dedent(f"""
        import sys, numpy as np
        import runtime
        p = runtime.load_part({r['export']!r}, "sbs")
        x = np.ones(p.inputs[0]["shape"], np.float32)
        y = p(x)
        assert y.shape == tuple(p.output["shape"]), y.shape
        assert sorted(p.exported.platforms) == ["cpu", "cuda"], p.exported.platforms
        assert "custom_call" not in p.exported.mlir_module()
        assert not [m for m in sys.modules if m.startswith("jmsnas")]
        print(float(np.abs(y).sum()))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    part = load_part(r["export"], "sbs")
    assert float(out.stdout) == pytest.approx(float(np.abs(part(np.ones(part.inputs[0]["shape"],
                                                                           np.float32))).sum()), rel=1e-6)


def test_export_command(runs, tmp_path, capsys):
    r = runs["mesh"]
    out = tmp_path / "exp"
    assert cli.main(["export", "--workdir", r["dir"], "--out", str(out), "--platforms", "cpu,tpu"]) == 0
    text = capsys.readouterr().out
    assert "cloud" in text and "from ['mbs1', 'mbs2', 'mbs3']" in text
    m = load_manifest(str(out))
    assert m["platforms"] == ["cpu", "tpu"] and m["root"] == "sbs" and m["branches"] == ["mbs1", "mbs2", "mbs3"]
    assert m["parts"]["sbs"]["to"] == ["mbs1", "mbs2", "mbs3"] and m["parts"]["cloud"]["to"] == ["result"]
    assert cli.main(["export", "--workdir", r["dir"], "--out", str(tmp_path / "bad"), "--platforms", "gpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'gpu'" in err[0] and not (tmp_path / "bad").exists()


def test_manifest_that_does_not_match_the_parts(runs, tmp_path):
    r = runs["chain"]
    bad = tmp_path / "export"
    shutil.copytree(r["export"], bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["parts"]["mbs"]["inputs"][0]["shape"] = [1, 8, 8, 8]
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DeployError, match=r"part 'mbs'.*do not match the manifest"):
        load_part(str(bad), "mbs")
    run = tmp_path / "run"  # the run's parts/manifest.json names a layer the part file lacks
    shutil.copytree(r["dir"], run)
    pm = json.loads((run / "parts" / "manifest.json").read_text())
    pm["devices"]["sbs"]["layers"] = [0, 1]
    pm["devices"]["sbs"]["ops"] = ["mbconv_k3_e3", "mbconv_k3_e3"]
    (run / "parts" / "manifest.json").write_text(json.dumps(pm))
    with pytest.raises(DeployError, match=r"device 'sbs' does not match parts/manifest.json"):
        export_run(str(run))


def test_corrupt_part_is_one_line_and_exit_2(runs, tmp_path, capsys):
    r = runs["chain"]
    run = tmp_path / "run"
    shutil.copytree(r["dir"], run)
    prog = run / "export" / "sbs.jaxexport"
    blob = bytearray(prog.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    prog.write_bytes(bytes(blob))
    assert cli.main(["pipeline", "--workdir", str(run), "--images", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "part 'sbs'" in err[0] and "corrupt" in err[0], err
    with pytest.raises(DeployError, match="is corrupt"):
        load_part(str(run / "export"), "sbs")
    assert _workers_of(str(run / "export")) == []


def test_port_in_use_is_one_line(runs):
    r = runs["chain"]
    while True:  # a busy port whose predecessor is free (ue's port when sbs's is busy)
        busy = L.listen(0)
        port = busy.getsockname()[1]
        try:
            L.listen(port - 1).close()
            break
        except OSError:
            busy.close()
    try:  # the devices take consecutive ports from --base-port: ue the first, sbs the next
        for base, device in ((port, "ue"), (port - 1, "sbs")):
            with pytest.raises(DeployError, match=rf"port 127.0.0.1:{port} for device '{device}' is in use"):
                run_pipeline(r["export"], np.zeros((2, 8, 8, 1), np.float32), base_port=base)
    finally:
        busy.close()
    assert _workers_of(r["export"]) == []


# ------------------------------------------------------------------------------------------- links

def test_a_paced_link_runs_at_its_bandwidth():
    """Bytes over time at the receiver of a 16 Mbit/s link: the slope of a line fit is within 5 %."""
    server = L.listen(0)
    rate_mbps, nbytes = 16.0, 400_000  # 0.2 s of link time
    samples = []

    def receive():
        conn = L.accept(server)
        got = 0
        while True:
            b = conn.recv(65536)
            if not b:
                break
            got += len(b)
            samples.append((L.now(), got))
        conn.close()

    t = threading.Thread(target=receive)
    t.start()
    s = L.connect(server.getsockname()[1])
    t0, t1 = L.send_frame(s, L.ARRAY, 0, np.zeros(nbytes // 4, np.float32), L.Pace(rate_mbps))
    s.close()
    t.join(10)
    server.close()
    ts, bs = np.array(samples).T
    keep = (bs > 0.1 * nbytes) & (bs < 0.9 * nbytes)
    slope = np.polyfit(ts[keep], bs[keep], 1)[0]  # bytes / s
    assert slope * 8 / 1e6 == pytest.approx(rate_mbps, rel=0.05)
    assert nbytes * 8 / (t1 - t0) / 1e6 == pytest.approx(rate_mbps, rel=0.05)


def test_frames_round_trip_and_latency_release():
    a, b = socket.socketpair()
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    L.send_frame(a, L.ARRAY, 7, x)
    L.send_frame(a, L.JSON, value={"k": [1, 2]})
    L.send_frame(a, L.STOP)
    f1, f2, f3 = L.recv_frame(b), L.recv_frame(b), L.recv_frame(b)
    assert f1.image == 7 and np.array_equal(f1.value, x) and f1.tx_start <= f1.tx_end <= f1.arrival
    assert f2.value == {"k": [1, 2]} and f3.kind == L.STOP
    assert L.release_time(f1, 40.0) == pytest.approx(max(f1.arrival, f1.tx_end + 0.04))
    L.send_frame(a, L.ARRAY, 8, x)  # the same frame parsed incrementally, one byte at a time
    blob = b.recv(1 << 16)
    buf, got = L.FrameBuffer(), []
    for i in range(len(blob)):
        got += buf.feed(blob[i:i + 1])
        assert (len(got) == 1) == (i == len(blob) - 1)
    assert got[0].image == 8 and np.array_equal(got[0].value, x)
    a.sendall(b"garbage-not-a-frame-at-all-xxxxxxxxxxxxxx")
    with pytest.raises(L.LinkClosed, match="not a jmsnas frame"):
        L.recv_frame(b)
    a.close()
    b.close()


# --------------------------------------------------------------------------------------- the pipeline

@pytest.mark.slow
def test_chain_pipeline_equals_the_whole_network_on_100_test_images(runs, capsys):
    """The CLI end to end: 4 processes, outputs == the whole compact network (<= 1e-5), table and plot."""
    r = runs["chain"]
    assert cli.main(["pipeline", "--workdir", r["dir"], "--images", "100", "--bandwidth-scale", "40",
                     "--phase", "stream", "--check"]) == 0
    out = capsys.readouterr().out
    assert "max |pipeline - whole network|" in out and "Mbit/s ue->sbs" in out
    a = json.loads(open(os.path.join(r["dir"], "deploy", "pipeline.json")).read())[0]
    assert a["max_abs_diff"] <= 1e-5
    assert set(a["predicted"]["per_link"]) == {"ue->sbs", "sbs->mbs", "mbs->cloud"}
    assert a["measured"]["throughput_per_s"] > 0
    assert os.path.getsize(os.path.join(r["dir"], "deploy", "pipeline.png")) > 1000
    assert _workers_of(r["export"]) == []


@pytest.mark.slow
def test_mesh_pipeline_equals_the_whole_network_on_100_test_images(runs):
    """Root -> three branches -> aggregator as 6 processes: outputs == the whole network, every term measured."""
    r = runs["mesh"]
    images, _ = reference.test_images(r["dir"], 100)
    raw = run_pipeline(r["export"], images, bandwidth_scale=40.0, phase="both", compute={"mbs2": 2.0})
    want = reference.whole_network(r["dir"])(images)
    assert np.max(np.abs(raw["outputs"] - want)) <= 1e-5
    assert np.max(np.abs(raw["stream_outputs"] - want)) <= 1e-5
    m = load_manifest(r["export"])
    a = analyze(m, raw)
    assert set(a["measured"]["per_link"]) == {f"{l['src']}->{l['dst']}" for l in m["links"]}
    assert a["stretch"]["mbs2"] == 2.0 and a["predicted"]["per_device"]["mbs2"] == 2.0 * a["calib_ms"]["mbs2"]
    assert a["measured"]["total"] > 0 and np.isfinite(a["measured"]["eq_of_measured"])
    _no_process_left(r["export"], raw["pids"].values())


def _fault(export_dir, action, device, timeout_s):
    """Runs a slow stream (0.2 s per image) and applies ``action`` to ``device`` once it is flowing."""
    pids, hit = {}, []

    def fault():
        hit.append(time.time())
        os.kill(pids[device], action)

    def start(p):
        pids.update(p)
        threading.Timer(0.5, fault).start()

    images = np.zeros((200, 8, 8, 1), np.float32)  # 200 x 65 ms on the ue->sbs link: a 13 s stream
    with pytest.raises(DeployError) as e:
        run_pipeline(export_dir, images, bandwidth_scale=0.01, phase="stream", timeout_s=timeout_s,
                     on_start=start)
    return str(e.value), time.time() - hit[0], pids


@pytest.mark.slow
def test_kill_a_device_stops_the_pipeline_naming_it(runs):
    r = runs["chain"]
    msg, elapsed, pids = _fault(r["export"], signal.SIGKILL, "sbs", timeout_s=30.0)
    assert msg.startswith("device 'sbs'") and "killed by SIGKILL" in msg and "\n" not in msg, msg
    assert elapsed < 10.0  # detected from the exit itself, long before the 30 s progress timeout
    _no_process_left(r["export"], pids.values())


@pytest.mark.slow
def test_a_hung_device_stops_the_pipeline_within_the_timeout(runs):
    r = runs["chain"]
    msg, elapsed, pids = _fault(r["export"], signal.SIGSTOP, "mbs", timeout_s=2.0)
    assert msg.startswith("device 'mbs'") and "hung" in msg and "\n" not in msg, msg
    assert elapsed < 2.0 + 10.0
    _no_process_left(r["export"], pids.values())
