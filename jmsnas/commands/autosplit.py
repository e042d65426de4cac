"""``jmsnas autosplit``: Auto-Split's split and mixed-precision bit widths of the edge part, with baselines.

    jmsnas autosplit --model resnet50|RUN_DIR|pkg.module:factory [--data FILE.npz] --topology autosplit|chain|mesh|splitnets|FILE --memory-mb 8
                     --max-accuracy-drop 0.01 [--bits 2,4,6,8,16] [--bandwidth MBPS ...] [--json]
                     [--write-parts DIR]

``--model``: a model reference ``pkg.module:factory`` or ``file.py:factory`` (your own JAX model,
docs/your_model.md; ``--data FILE.npz`` (images, labels) or ``--data tfds:NAME[:SPLIT] --data-dir DIR`` holds
the evaluation data, its first half checks A, its second half reports), a zoo network (no trained weights: distortion from its shapes, see ``jmsnas.quant.autosplit``) or the
workdir of a ``jmsnas search`` run (accuracy measured before and after quantization). ``--topology``: a preset or a
topology file (docs/topology.md);
the edge is the first device of its chain, the cloud the last. ``--select-on val|test``: the split on which a
candidate's accuracy drop is checked against A (run directories; default val). ``--memory-mb``: the edge memory limit M in MiB.
``--max-accuracy-drop``: A as a fraction (0.01 = one point of accuracy). ``--write-parts DIR`` (run directories
only) writes the chosen edge part with its weights packed at their bit widths and the cloud part in float.
Bad arguments print one ``jmsnas autosplit: error: ...`` line to stderr and exit with 2.
"""
from __future__ import annotations

import json
import os

from jmsnas import runcheck, topology
from jmsnas.runcheck import path_flag
from jmsnas.topology import TopologyError
from jmsnas.commands import fail


def add_parser(sub) -> None:
    p = sub.add_parser("autosplit", help="Auto-Split: split + mixed-precision quantization of the edge part",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="zoo network name, a jmsnas search workdir or a model reference "
                   "pkg.module:factory (docs/your_model.md)")
    p.add_argument("--data", default=None, help="evaluation data of a model reference: FILE.npz (images, labels) or "
                   "tfds:NAME[:SPLIT]")
    p.add_argument("--data-dir", default=None, help="tfds data directory for --data tfds:NAME")
    p.add_argument("--topology", required=True, help="topology preset (autosplit, chain, mesh, splitnets) or topology file "
                                                               "(.yaml/.json, docs/topology.md)")
    p.add_argument("--memory-mb", type=float, required=True, help="edge memory limit M in MiB")
    p.add_argument("--max-accuracy-drop", type=float, required=True, help="A, a fraction (0.01 = 1 point)")
    p.add_argument("--bits", default="2,4,6,8,16", help="candidate bit widths B (default 2,4,6,8,16)")
    p.add_argument("--bandwidth", type=float, nargs="+", metavar="MBPS", help="link bandwidth(s) in Mbit/s")
    p.add_argument("--select-on", default="val", choices=("val", "test"),
                   help="split on which a candidate's accuracy drop is checked against A (default val)")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    p.add_argument("--write-parts", metavar="DIR", type=path_flag, help="write the chosen quantized parts (run directories only)")


def parse_bits(text: str) -> tuple:
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        return tuple(int(t) for t in items)
    except ValueError:
        raise ValueError(f"--bits must be comma-separated integers such as 2,4,6,8,16, got {text!r}") from None


def _fmt_bits(j: dict) -> str:
    return ", ".join(f"{b['layer']} w{b['weight'] if b['weight'] is not None else '-'}/a{b['activation']}"
                     for b in j["bits"])


def text(out: dict) -> str:
    links = ", ".join(f"{k} {v:g} Mbit/s" for k, v in out["links_mbps"].items())
    lines = [f"{out['model']} ({out['layers']} layers) on {out['topology']}: {out['edge_device']} -> "
             f"{out['cloud_device']} ({links}); edge memory limit {out['memory_limit_bytes'] / 2**20:.4g} MiB; "
             f"A = {out['max_accuracy_drop']:g}; B = {out['bits']}"]
    if "note" in out:
        lines.append(f"note: {out['note']}")
    if "float_accuracy" in out:
        fa = out["float_accuracy"]
        data = f" of {out['data']['source']}" if "data" in out else ""
        lines.append(f"float accuracy: val {fa['val']:.4f}, test {fa['test']:.4f}; A checked on the "
                     f"{out['selected_on']} split{data}")
    lines.append(f"potential splits P = {out['potential_splits']}; {out['candidates']} candidates, "
                 f"{out['candidates_checked']} checked for accuracy before one met A")
    for name, j in out["methods"].items():
        lat = j["latency_ms"]
        acc = ""
        if "accuracy" in j:
            acc = f", test accuracy {j['accuracy']['test']:.4f} (drop {j['accuracy_drop']['test']:+.4f})"
        elif "relative_distortion" in j:
            acc = f", relative distortion {j['relative_distortion']:.4g}"
        flag = "" if j["fits_memory"] else "  OVER the memory limit"
        lines.append(f"{name:<13} split {j['split']:>3}: total {lat['total']:.4f} ms (edge {lat['edge']:.4f}, "
                     f"transmit {lat['transmit']:.4f}, cloud {lat['cloud']:.4f}), sent {j['sent_bytes']} B, "
                     f"edge memory {j['edge_memory_bytes'] / 2**20:.4f} MiB{flag}{acc}")
        if name == "autosplit" and j["bits"]:
            lines.append(f"    bits: {_fmt_bits(j)}")
    return "\n".join(lines)


def run(args) -> int:
    from jmsnas.quant import autosplit as AS
    from jmsnas.quant import parts
    try:
        bits = parse_bits(args.bits)
        topo = topology.resolve(args.topology, bandwidths_mbps=args.bandwidth)
        if args.write_parts and not os.path.isdir(args.model):
            raise ValueError(f"--write-parts needs a run directory as --model, got {args.model!r}")
        if args.write_parts:
            runcheck.check_out_dir(args.write_parts, "--write-parts")
            if os.path.exists(args.write_parts) and (not os.path.isdir(args.write_parts)
                                                     or os.listdir(args.write_parts)):
                raise ValueError(f"--write-parts directory {args.write_parts!r} is not empty")
        out, (prob, chosen, ctx) = AS.autosplit(args.model, topo, args.memory_mb * 2**20, args.max_accuracy_drop,
                                                bits, select_on=args.select_on, data=args.data,
                                                data_dir=args.data_dir)
        if args.write_parts:
            parts.write_parts(ctx["run"].net, ctx["ranges"], chosen, args.write_parts, topo, source=args.model)
            out["parts"] = args.write_parts
    except (ValueError, TopologyError) as e:
        return fail("autosplit", str(e))
    print(json.dumps(out, indent=2) if args.json else text(out))
    return 0
