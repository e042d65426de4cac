"""``jmsnas latency``: a network's latency from a ProxylessNAS/OFA lookup table.

    jmsnas latency --table mobile_trim.yaml --arch proxyless_mobile.config [--json] [--resolution 224]

The arch file is a ProxylessNAS/OFA ``net.config`` JSON or an OFA arch JSON {"ks": [...], "e": [...], "d": [...],
"r": 224}. Without ``--json`` it prints one line per layer and the total in ms; with ``--json`` an object
{"latency_ms": total, "per_layer": {name: ms}, "keys": {name: table key}}. Errors (unreadable files, malformed
table, keys missing from the table) print one ``jmsnas latency: error: ...`` line to stderr and exit with 2.
"""
from __future__ import annotations

import json

from jmsnas.cost import lut
from jmsnas.runcheck import number_flag
from jmsnas.commands import fail


def add_parser(sub) -> None:
    p = sub.add_parser("latency", help="network latency from a ProxylessNAS/OFA latency lookup table",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--table", required=True, help="latency table YAML (ProxylessNAS or OFA format)")
    p.add_argument("--arch", required=True, help="net.config JSON or OFA arch JSON (ks, e, d, r)")
    p.add_argument("--resolution", type=number_flag(int, 1, 8192), default=None,
                   help="input image size; overrides the arch's 'r' (default: the arch's, else 224)")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of a table")


def run(args) -> int:
    try:
        with open(args.arch, "r", encoding="utf-8") as f:
            arch = json.load(f)
    except OSError as e:
        return fail("latency", f"cannot read arch file {args.arch!r}: {e.strerror}")
    except json.JSONDecodeError as e:
        return fail("latency", f"arch file {args.arch!r} is not valid JSON: {e}")
    try:
        table = lut.load_lut(args.table)
        result = lut.network_latency(table, lut.arch_layers(arch, args.resolution))
    except lut.MissingKeysError as e:
        return fail("latency", f"{len(e.missing)} layer key(s) missing from {table.source}: "
                     + "; ".join(f"{n}: {k}" for n, k in e.missing))
    except lut.LUTError as e:
        return fail("latency", str(e))
    if args.json:
        print(json.dumps({"latency_ms": result.total_ms, "per_layer": result.per_layer, "keys": result.keys},
                         indent=2))
        return 0
    width = max(len(n) for n in result.per_layer)
    for name, ms in result.per_layer.items():
        print(f"{name:<{width}}  {ms:9.4f} ms  {result.keys[name]}")
    print(f"{'total':<{width}}  {result.total_ms:9.4f} ms  ({table.source}, {table.flavor} table)")
    return 0
