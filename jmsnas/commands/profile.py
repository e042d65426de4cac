"""``jmsnas profile``: measure a latency table of a search space on the current JAX backend.

    jmsnas profile --space default --out ue.yaml [--method in-network|standalone] [--reps 50] [--batch 1]
                   [--warmup 3] [--quantile 0.5] [--calibrate 8] [--seed 0] [--dw-impl auto] [--no-deployed]
                   [--deployed-reps 10] [--part-idle-ms 30] [--part-design 3]
    jmsnas profile --space default --remote HOST:PORT --table THERE.yaml --out OUT.yaml [--reps 30]
                   [--secret-file FILE] [--tls-ca CA.pem] [--timeout 60]

``--space`` is ``default`` (the main job's chain space on the embedded digits: 8x8x1 input, 10 classes),
``mesh`` (its mesh variant), a JSON/YAML file {"topology": "chain"|"mesh"|a topology file, "layers_per_device": [...],
"image_size", "in_channels", "num_classes", "device_channels": [...], "device_strides": [...],
["stem_channels", "stem_stride", "head_channels"]} or a Python config file with ``get_config()`` (as under
experiments/configs/; its dataset gives the input size). ``--method`` is explained in jmsnas/cost/profile.py.
The table (YAML, format and latency model in jmsnas/cost/measured.py) feeds
``jmsnas.cost.build.build_table`` as {"kind": "measured", "path": ...}. Unless ``--no-deployed``, the table also
holds what a deployed part pays (``jmsnas.deploy.partcost``: the part call cost, every op's time in a part of its
own (``--part-design``) and the hand-off of a frame as a function of its bytes, each timed after the wait for its
input a deployed part has (``--part-idle-ms``), ``--deployed-reps`` rounds), which eq. (1)/(2) then charge every
device and link. ``--remote`` measures those terms on the machine of a ``jmsnas worker`` (authenticated as every
connection to one: ``--secret-file`` or $JMSNAS_SECRET, ``--tls-ca``) for ``--table``, a table profiled on that
machine with ``--dw-impl xla``, and writes it with them to ``--out``. Errors print one
``jmsnas profile: error: ...`` line to stderr and exit with 2; nothing is written then.
"""
from __future__ import annotations

import os

from jmsnas import runcheck, safeio, topology
from jmsnas.runcheck import number_flag, path_flag
from jmsnas.space import adapt_schedule, build_space
from jmsnas.commands import fail

_FIELDS = ("topology", "layers_per_device", "image_size", "in_channels", "num_classes", "device_channels",
           "device_strides", "stem_channels", "stem_stride", "head_channels")
_REQUIRED = ("image_size", "in_channels", "num_classes", "device_channels", "device_strides")
# (image size, channels, classes) of the datasets a Python config may name
_DATASETS = {"digits": (8, 1, 10), "cifar10": (32, 3, 10), "cifar100": (32, 3, 100), "imagenet2012": (224, 3, 1000)}


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure a latency table of a search space on this backend",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--space", default="default", help="default, mesh, a JSON/YAML space file or a Python config")
    p.add_argument("--out", required=True, type=path_flag, help="table file to write (YAML)")
    p.add_argument("--method", default="in-network", choices=("in-network", "standalone"),
                   help="ops timed inside networks (default) or on their own")
    p.add_argument("--reps", type=number_flag(int, 3, 100000), default=50, help="timing rounds (default 50)")
    p.add_argument("--batch", type=number_flag(int, 1, 4096), default=1, help="batch size (default 1)")
    p.add_argument("--warmup", type=number_flag(int, 0, 1000), default=3, help="untimed calls per item before the rounds (default 3)")
    p.add_argument("--quantile", type=number_flag(float, 0, 1, low_open=True), default=0.5,
                   help="statistic of the rounds: 0.5 = median (default); lower values resist load from "
                        "other processes")
    p.add_argument("--calibrate", type=number_flag(int, 0, 1000), default=8,
                   help="standalone method: random sub-networks measured for the network offset (default 8)")
    p.add_argument("--seed", type=number_flag(int, 0, 2**32 - 1), default=0, help="seed of the round order (and calibration networks)")
    p.add_argument("--dw-impl", default="auto", choices=("auto", "xla", "shifted", "native"),
                   help="depthwise-convolution kernels to time (default auto: the ones the search runs; xla: what "
                        "exported parts run, for jmsnas pipeline --predict-table)")
    p.add_argument("--no-deployed", action="store_true",
                   help="do not measure the deployed terms (part call cost, part scale, hand-off per link); the "
                        "table then models a network run as one call only")
    p.add_argument("--deployed-reps", type=number_flag(int, 3, 100000), default=None,
                   help="timing rounds of the deployed terms (default 10; with --remote: --reps)")
    p.add_argument("--part-idle-ms", type=number_flag(float, 0, 10000), default=None,
                   help="the wait before every part and hand-off frame is timed, as a deployed part waits for its "
                        "input (default 30; 0: back to back)")
    p.add_argument("--part-design", type=number_flag(int, 0, 100), default=None,
                   help="part entries: every valid op of every slot timed in at least this many parts (default 3; "
                        "0: no part entries, one part scale of the table's entries instead)")
    p.add_argument("--remote", default=None, metavar="HOST:PORT",
                   help="measure the deployed terms on the machine of the jmsnas worker there, for --table (a "
                        "table profiled on that machine with --dw-impl xla); writes --out")
    p.add_argument("--table", default=None, help="with --remote: the worker machine's latency table")
    from jmsnas.deploy.daemon import add_secret_arguments
    add_secret_arguments(p)
    p.add_argument("--timeout", type=number_flag(float, 0, 86400, low_open=True), default=60.0,
                   help="with --remote: seconds the worker may take for a reply (a part's compilation included; "
                        "default 60)")


class _SpaceError(ValueError):
    pass


def _from_python(path: str) -> dict:
    mod = safeio.import_file(path, "config file", "_jmsnas_profile_config")
    if not hasattr(mod, "get_config"):
        raise _SpaceError(f"config file {path!r} has no get_config()")
    cfg = safeio.call_user(mod.get_config, f"config file {path!r}: get_config()")
    if cfg.dataset not in _DATASETS:
        raise _SpaceError(f"config {path!r}: dataset {cfg.dataset!r} has no known input size; expected one of "
                          f"{list(_DATASETS)}")
    size, ch, classes = _DATASETS[cfg.dataset]
    s = cfg.space
    return {"topology": cfg.topology, "layers_per_device": cfg.get("layers_per_device"),
            "image_size": cfg.get("image_size") or size, "in_channels": ch, "num_classes": classes,
            "device_channels": list(s.device_channels), "device_strides": list(s.device_strides),
            "stem_channels": s.stem_channels, "stem_stride": s.stem_stride, "head_channels": s.head_channels}


def _from_file(path: str) -> dict:
    try:  # JSON is YAML: one capped parser for both
        d = safeio.load_yaml(safeio.read_bytes(path, "space file"), f"space file {path!r}")
    except ValueError as e:
        raise _SpaceError(str(e)) from None
    if not isinstance(d, dict):
        raise _SpaceError(f"space file {path!r} must hold a mapping with fields {list(_FIELDS)}")
    unknown = sorted(set(d) - set(_FIELDS))
    missing = [f for f in _REQUIRED if f not in d]
    if unknown or missing:
        raise _SpaceError(f"space file {path!r}: " + (f"unknown field(s) {unknown} " if unknown else "")
                          + (f"missing field(s) {missing}" if missing else "") + f"; fields are {list(_FIELDS)}")
    return d


def _check_fields(d: dict, where: str) -> None:
    """Every field of a space description of the right type and range (_SpaceError naming it)."""
    try:
        for k in ("image_size", "in_channels", "num_classes"):
            runcheck.number(d, k, low=1, high=8192, integer=True)
        for k in ("stem_channels", "stem_stride", "head_channels"):
            if k in d:
                runcheck.number(d, k, low=1, high=65536, integer=True, optional=True)
        for k in ("device_channels", "device_strides"):
            runcheck.int_list(d[k], k)
        if d.get("layers_per_device") is not None:
            runcheck.int_list(d["layers_per_device"], "layers_per_device")
        if not isinstance(d.get("topology", "chain"), str):
            raise runcheck.ConfigError(f"topology must be a preset name or a topology file, got "
                                       f"{safeio.short(d['topology'])}")
    except runcheck.ConfigError as e:
        raise _SpaceError(f"space {where!r}: {e}") from None


def space_from_arg(arg: str):
    """The SearchSpace named by ``--space``."""
    if arg in ("default", "mesh"):
        from jmsnas.configs import default_config, mesh_config
        cfg = default_config() if arg == "default" else mesh_config()
        size, ch, classes = _DATASETS[cfg.dataset]
        s = cfg.space
        d = {"topology": cfg.topology, "layers_per_device": cfg.layers_per_device, "image_size": size,
             "in_channels": ch, "num_classes": classes, "device_channels": s.device_channels,
             "device_strides": s.device_strides, "stem_channels": s.stem_channels, "stem_stride": s.stem_stride,
             "head_channels": s.head_channels}
    elif not os.path.isfile(arg):
        raise _SpaceError(f"--space {arg!r} is neither 'default', 'mesh' nor an existing file")
    elif arg.endswith(".py"):
        d = _from_python(arg)
    else:
        d = _from_file(arg)
    _check_fields(d, arg)
    lpd = d.get("layers_per_device")
    t = d.get("topology", "chain")
    topo = topology.resolve(t, lpd)  # a topology file's own layers_per_device wins; the schedule adapts to its devices
    kw = {k: d[k] for k in ("stem_channels", "stem_stride", "head_channels") if d.get(k) is not None}
    channels, strides = adapt_schedule(topo, tuple(d["device_channels"]), tuple(d["device_strides"]))
    return build_space(topo, image_size=d["image_size"], in_channels=d["in_channels"], num_classes=d["num_classes"],
                       device_channels=channels, device_strides=strides, **kw)


def _remote_args(args):
    """The credentials of --remote (None without it), after checking the flags that go with it (one line)."""
    from jmsnas.deploy.daemon import client_credentials
    from jmsnas.deploy.timer import parse_address
    if not args.remote:
        if args.table or args.secret_file or args.tls_ca:
            raise ValueError("--table, --secret-file and --tls-ca are for --remote HOST:PORT")
        if args.no_deployed and (args.deployed_reps, args.part_idle_ms, args.part_design) != (None, None, None):
            raise ValueError("--deployed-reps, --part-idle-ms and --part-design set how the deployed terms are "
                             "measured; --no-deployed skips them")
        return None
    parse_address(args.remote)
    if args.table is None:
        raise ValueError(f"--remote {args.remote} needs --table TABLE: a latency table profiled on that machine "
                         "(jmsnas profile --dw-impl xla there), whose deployed terms it measures")
    if args.no_deployed:
        raise ValueError("--remote measures the deployed terms; --no-deployed would measure nothing")
    if args.part_idle_ms is not None or args.part_design is not None:
        raise ValueError("--part-idle-ms and --part-design are for the deployed terms measured here; --remote times "
                         "the parts back to back with one part scale")
    return client_credentials(args)


def _remote(args, space, creds) -> int:
    """--remote: the deployed terms of --table measured through the worker, written with the table to --out."""
    from jmsnas.cost import profile as P
    from jmsnas.deploy import partcost
    try:
        table = P.load_table(args.table, space)
        table = partcost.with_deployed(space, table, args.remote, reps=args.deployed_reps or args.reps, seed=args.seed,
                                       credentials=creds, timeout_s=args.timeout)
        P.write_table(table, args.out)
    except (ValueError, OSError) as e:
        return fail("profile", f"--remote {args.remote}: {' '.join(str(e).split())}")
    _print_deployed(table, f"on the worker at {args.remote}")
    print(f"wrote {args.out}: {args.table} with its deployed terms")
    return 0


def _print_deployed(table, where: str) -> None:
    dep = table.deployed
    h, pe = dep["handoff"], dep.get("parts")
    held = (f"; on networks held out {pe['cv_rms_error_pct']:.1f}%, {pe['cv_rms_error_pct_unshrunk']:.1f}% "
            f"unshrunk; shrunk toward the table's entries x one scale by {pe['shrink']:g}") \
        if pe is not None and "cv_rms_error_pct_unshrunk" in pe else ""
    ops = (f"its ops' part entries (stem {pe['stem_ms']:.4f}, head {pe['head_ms']:.4f} ms; fitted on {pe['parts']} "
           f"parts, RMS error {pe['rms_error_pct']:.1f}%{held})") if pe is not None else \
        f"{dep['part_scale']:.3f} x its entries"
    idle = f", each timed after {dep['idle_ms']:g} ms idle" if dep.get("idle_ms") else ""
    print(f"deployed ({where}{idle}): per part call {dep['part_call'].median_ms:.4f} ms + {ops}; hand-off "
          f"{h['fixed_ms']:.4f} ms + {h['ms_per_byte'] * 1e6:.4f} ms per MB")
    if "load_ratio" in table.deployed:
        how = "not applied: the parts were timed after waits" if table.deployed.get("idle_ms") else \
            "the parts' times were divided by it"
        print(f"  (whole networks timed with the parts ran {table.deployed['load_ratio']:.3f} x the table's "
              f"prediction of them; {how})")


def run(args) -> int:
    from jmsnas.cost import profile as P

    try:
        P._check_settings(args.batch, args.reps, args.warmup, args.quantile, args.calibrate)
        space = space_from_arg(args.space)
        runcheck.check_memory(space, args.batch, 1, f"--space {args.space!r}")
        creds = _remote_args(args)
    except (ValueError, OSError) as e:
        return fail("profile", e)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        return fail("profile", f"cannot write --out {args.out!r}: directory {out_dir!r} does not exist or is not writable")
    if args.remote:
        return _remote(args, space, creds)
    table = P.measure_table(space, method=args.method, batch=args.batch, reps=args.reps, warmup=args.warmup,
                            quantile=args.quantile, calibrate=args.calibrate, seed=args.seed, dw_impl=args.dw_impl)
    if not args.no_deployed:
        from jmsnas.deploy import partcost
        design = partcost.DESIGN_REPEATS if args.part_design is None else args.part_design
        try:
            table = partcost.with_deployed(
                space, table, reps=args.deployed_reps or partcost.DEPLOYED_REPS, seed=args.seed,
                design_repeats=design or None,
                idle_ms=partcost.IDLE_MS if args.part_idle_ms is None else args.part_idle_ms)
        except OSError as e:  # the loopback connection (TimeoutError is one)
            return fail("profile", f"cannot measure the deployed terms over a loopback connection: {e}; "
                                   "profile with --no-deployed to skip them")
    try:
        P.write_table(table, args.out)
    except OSError as e:
        return fail("profile", f"cannot write {args.out!r}: {e.strerror}")
    n_ops = sum(len(s["ops"]) for s in table.slots)
    print(f"wrote {args.out}: {n_ops} op entries over {len(table.slots)} slots on {table.device['backend']} "
          f"({table.device['cpu']}), space {table.fingerprint}; per network: call {table.call.median_ms:.4f} ms + "
          f"stem {table.stem.median_ms:.4f} ms + head {table.head.median_ms:.4f} ms + offset "
          f"{table.network['offset_ms']:+.4f} ms ({table.network['method']})")
    if table.deployed is not None:
        _print_deployed(table, "here")
    return 0
