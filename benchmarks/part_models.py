"""How well the deployed-terms models price a run's own parts: one part scale of the table's entries, every op's
part entry, and the part entries shrunk toward the one scale, all fitted on other networks' parts, checked on the
run's architecture's parts.

    python benchmarks/part_models.py --run RUN --table TABLE [--repeats 3] [--reps 10] [--idle-ms 30]
    python benchmarks/part_models.py --run RUN --table TABLE --waits 0 1 3 10 30 100 [--reps 20] [--exported]

TABLE is a ``jmsnas profile --dw-impl xla`` table of RUN's space made on this machine (its own deployed terms are
not used). The parts of a balanced design (``partcost.balanced_archs``, every valid op of every slot in at least
``--repeats`` networks), one relay and the run's own parts are timed as ``jmsnas profile`` times them (each right
after its input arrives over loopback, after ``--idle-ms`` of waiting, in shuffled rounds). The models are fitted
on the design's parts and the relay only (``partcost.fit_part``, ``partcost.fit_part_entries``); the run's parts
are the check, which none was fitted on. Prints per device: measured, each model's prediction and its error
(the third model: the part entries shrunk toward the one scale, ``partcost.fit_part_entries`` with a prior, as
``jmsnas profile`` fits them), and the part entries' RMS error over the design's networks held out in turn, plain and shrunk.

``--waits``: the wait curve instead: the run's own parts timed after each wait (ms) with the host idle, and after
``--idle-ms`` during which another thread keeps the host busy (the whole network run in a loop, stopped right
before the input is sent: the previous device computing, as in a pipeline at high bandwidth). Median ms per part.
With ``--exported`` the run's exported parts (RUN/export, made first where missing: the ``jax.export`` programs a
worker loads, called as ``runtime.Part`` calls them) are timed beside the profile's own parts of the same
architecture, in the same rounds: whether the program a worker runs costs what the profile timed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jmsnas.deploy import partcost as PC  # noqa: E402
from jmsnas.deploy.predict import _run_table  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--table", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--idle-ms", type=float, default=PC.IDLE_MS)
    ap.add_argument("--waits", type=float, nargs="+", default=None, help="time the wait curve (ms)")
    ap.add_argument("--exported", action="store_true", help="with --waits: also the run's exported parts")
    args = ap.parse_args(argv)
    space, _, measured, ops, _ = _run_table(args.run, args.table)
    if args.waits:
        return wait_curve(space, tuple(int(o) for o in ops), args.waits, args.idle_ms, args.reps,
                          args.run if args.exported else None)
    t0 = time.time()
    cut = [PC._parts(space, a, 1, "xla") for a in PC.balanced_archs(space, args.repeats, [0, 4])]
    design = [p for net in cut for p in net]
    groups = [g for g, net in enumerate(cut) for _ in net] + [None]  # the relay's: never held out
    design.append(PC._relay(space, design[0][1](*design[0][2]).shape))
    check = PC._parts(space, tuple(int(o) for o in ops), 1, "xla")
    parts = design + check
    print(f"{len(design)} design parts + {len(check)} of the run, compiled in {time.time() - t0:.0f} s")
    items = [(k, args.idle_ms) for k in range(len(parts))]
    ms = _timed(parts, items, lambda wait: time.sleep(wait / 1e3), args.reps, 1)
    med = [float(np.median(ms[item])) for item in items]
    nd = len(design)
    call, scale = PC.fit_part([PC._entries_ms(measured, p[3]) for p in design], med[:nd])
    fit = PC.fit_part_entries(space, [p[3] for p in design], med[:nd])
    shrunk = PC.fit_part_entries(space, [p[3] for p in design], med[:nd], prior=PC.prior_entries(measured, space),
                                 groups=groups)
    print(f"one scale: {call:.3f} ms + {scale:.3f} x entries; part entries: call {fit['call_ms']:.3f} ms, "
          f"RMS error over the design {fit['rms_error_pct']:.1f}%, over networks held out in turn "
          f"{shrunk['cv_rms_error_pct_unshrunk']:.1f}%; shrunk by {shrunk['shrink']:g}: held out "
          f"{shrunk['cv_rms_error_pct']:.1f}%  (load average {os.getloadavg()[0]:.1f})")
    print("| device | measured (ms) | one scale (ms) | error | part entries (ms) | error | shrunk (ms) | error |")
    print("|---|---|---|---|---|---|---|---|")
    price = lambda f, key: float(PC._part_features(space, key) @ np.concatenate(
        [[f["call_ms"], f["stem_ms"], f["head_ms"]], f["ops"].ravel()]))
    for k, (dev, _, _, key) in enumerate(check):
        m = med[nd + k]
        one = call + scale * PC._entries_ms(measured, key)
        cells = [f"{v:.3f} | {100 * (v / m - 1):+.0f}%" for v in (one, price(fit, key), price(shrunk, key))]
        print(f"| {dev} | {m:.3f} | " + " | ".join(cells) + " |")
    return 0


def _timed(parts, items, wait, reps: int, seed: int) -> dict:
    """{item: [ms, ...]}: every item (part index, what ``wait`` takes) once per round in a shuffled order, as
    ``jmsnas profile`` times a part: ``wait(what)``, then its input sent over loopback, the part called on arrival,
    timed from the arrival to its end. Round 0 warms up and is not kept."""
    pair = PC._Pair()
    sender = PC._Sender(pair)
    sender.start()
    ms = {item: [] for item in items}
    rng = np.random.default_rng(seed)
    try:
        for r in range(reps + 1):
            for j in rng.permutation(len(items)):
                k, what = items[j]
                _, call, xs, _ = parts[k]
                wait(what)
                sender.submit(xs[0])
                fr, a = pair.receive()
                call(fr.value, *xs[1:])
                if r:
                    ms[items[j]].append((PC.L.now() - a) * 1e3)
    finally:
        sender.submit(None)
        pair.close()
    return ms


def exported_parts(run: str) -> list:
    """[(device + " (exported)", runtime.Part, zero inputs, None)] of the run's exported parts, in execution order
    (``export_run`` first where RUN/export has none)."""
    from jmsnas.deploy import runtime
    from jmsnas.deploy.export import export_run
    directory = os.path.join(run, "export")
    if not os.path.isfile(os.path.join(directory, "manifest.json")):
        export_run(run)
    manifest = runtime.load_manifest(directory)
    out = []
    for dev in manifest["order"]:
        part = runtime.load_part(directory, dev, manifest)
        xs = tuple(np.zeros(i["shape"], i.get("dtype", "float32")) for i in part.inputs)
        part(*xs)  # compiles
        out.append((f"{dev} (exported)", part, xs, None))
    return out


def wait_curve(space, ops: tuple, waits, busy_ms: float, reps: int, exported_run: str | None = None) -> int:
    import threading

    import jax

    from jmsnas.cost.profile import arch_calls
    parts = PC._parts(space, ops, 1, "xla")
    if exported_run is not None:
        parts += exported_parts(exported_run)
    whole, args = arch_calls(space, [ops], 1, "xla")[0]

    def spin(stop):
        while not stop.is_set():
            jax.block_until_ready(whole(*args))

    def wait(mode):
        kind, ms_ = mode
        if kind == "busy":  # another thread keeps the host busy until the input is sent
            stop = threading.Event()
            th = threading.Thread(target=spin, args=(stop,))
            th.start()
            time.sleep(ms_ / 1e3)
            stop.set()
            th.join()
        else:
            time.sleep(ms_ / 1e3)
    modes = [("idle", w) for w in waits] + [("busy", busy_ms)]
    ms = _timed(parts, [(k, m) for m in modes for k in range(len(parts))], wait, reps, 2)
    head = [f"{w:g} ms idle" for w in waits] + [f"{busy_ms:g} ms busy"]
    print(f"median ms of the run's parts after each wait ({reps} rounds; load average {os.getloadavg()[0]:.1f})")
    print("| device | " + " | ".join(head) + " |")
    print("|---|" + "---|" * len(head))
    for k, p in enumerate(parts):
        print(f"| {p[0]} | " + " | ".join(f"{np.median(ms[(k, m)]):.3f}" for m in modes) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
