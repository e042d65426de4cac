"""``jmsnas split``: split a network over a topology with every baseline and solver, with latency breakdowns.

    jmsnas split --model mobilenet_v2 --topology splitnets --act-bits 8 --weight-bits 8 [--bandwidth 300] [--json]

``--model`` is a zoo name (``jmsnas.split.zoo.NAMES``), a search run's workdir ``RUN_DIR`` or its
``RUN_DIR/result.json`` (its derived network with its shapes; ``--topology`` then defaults to the run's own), your own
model as a reference ``pkg.module:factory`` or ``file.py:factory`` (docs/your_model.md) or a JSON network file {"name", "input_shape", "layers":
[{"name", "kind", "macs", "params", "out_shape", "inputs"}]}. ``--topology`` is chain, mesh, splitnets or a topology
file (.yaml/.yml/.json, docs/topology.md);
``--bandwidth`` gives one Mbit/s value for every link or one per link. Layer latencies come from the roofline
model of each device. Methods: see ``jmsnas.split.compare``. ``--json`` prints {"model", "topology",
"topology_spec" (the topology in the file format), "links_mbps", "methods":
{method: {"latency_ms": {"total", "per_device", "per_link"}, "assignment", "ranges", "bytes_per_link",
"peak_memory_bytes", "memory_limit_bytes", "memory_ok"} or {"error"}}}. Bad arguments print one
``jmsnas split: error: ...`` line to stderr and exit with 2.
"""
from __future__ import annotations

import json
import os

from jmsnas import topology
from jmsnas.run import directory
from jmsnas.runcheck import number_flag
from jmsnas.split import compare
from jmsnas.topology import TopologyError
from jmsnas.commands import fail


def add_parser(sub) -> None:
    p = sub.add_parser("split", help="split a network over devices: baselines, Neurosurgeon, optimal splits",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help="zoo network name, a search run's workdir (or its result.json), a model reference "
                        "pkg.module:factory or file.py:factory (docs/your_model.md), or a JSON network file")
    p.add_argument("--topology", default=None,
                   help=f"topology preset ({', '.join(sorted(topology.presets.TOPOLOGIES))}) or topology file (.yaml/.json); "
                        "default with a run as the model: the run's topology")
    p.add_argument("--bandwidth", type=float, nargs="+", metavar="MBPS",
                   help="link bandwidth(s) in Mbit/s: one for all links or one per link")
    p.add_argument("--act-bits", type=number_flag(int, 1, 64), default=32, help="activation bit width (default 32)")
    p.add_argument("--weight-bits", type=number_flag(int, 1, 64), default=32, help="weight bit width (default 32)")
    p.add_argument("--methods", nargs="+", default=list(compare.METHODS), choices=compare.METHODS,
                   help="methods to run (default: all)")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of text")


def _text(setup, results) -> str:
    topo, net = setup.topo, setup.net
    links = ", ".join(f"{l.src}->{l.dst} {l.bandwidth_mbps:g} Mbit/s" + (f" + {l.latency_ms:g} ms" if l.latency_ms else "")
                      for l in topo.links)
    lines = [f"{net.name} ({len(net.layers)} layers) on {topo.name}: {links}"]
    for method, r in results.items():
        if isinstance(r, str):
            lines.append(f"{method:<17} infeasible: {r}")
            continue
        lines.append(f"{method:<17} total {r.total_ms:10.3f} ms")
        for dev, a, b in compare.ranges(r, topo):
            m = topo.device_names.index(dev)
            pk = r.peak_bytes[dev]
            flag = "" if r.memory_ok[dev] else f"  OVER the {topo.devices[m].memory_bytes / 1e6:.2f} MB limit"
            lines.append(f"    {dev:<12} layers {a}-{b} ({net.layers[a].name} .. {net.layers[b].name}): "
                         f"compute {r.per_device_ms[dev]:.3f} ms, peak memory {pk / 1e6:.2f} MB{flag}")
        for ln, ms in r.per_link_ms.items():
            if r.per_link_bytes[ln]:
                lines.append(f"    {ln:<12} {r.per_link_bytes[ln]:.0f} bytes, {ms:.3f} ms")
    return "\n".join(lines)


def run(args) -> int:
    model = args.model
    if os.path.isdir(model):  # a run's workdir, as autosplit and modularize take it: its result.json
        model = os.path.join(model, "result.json")
    try:
        net = compare.load_net(model)
        name = args.topology
        if name is None:
            if not (os.path.isfile(model) and directory.is_result(directory.read_json(model, "result"))):
                raise ValueError("--topology is required (a preset or a topology file) unless --model is a search "
                                 "run's workdir or result.json")
            name = model  # the run's topology (its space.topology)
        topo = topology.resolve(name, bandwidths_mbps=args.bandwidth)
        setup = compare.make_setup(net, topo, act_bits=args.act_bits, weight_bits=args.weight_bits)
    except (ValueError, TopologyError) as e:
        return fail("split", str(e))
    results = compare.run_all(setup, args.methods)
    if args.json:
        print(json.dumps({"model": net.name, "topology": topo.name, "topology_spec": topology.to_dict(topo),
                          "links_mbps": {ln: l.bandwidth_mbps for ln, l in zip(topo.link_names, topo.links)},
                          "methods": {m: compare.result_json(r, setup) for m, r in results.items()}}, indent=2))
        return 0
    print(_text(setup, results))
    return 0
