"""What a deployed part pays beyond a latency table's entries: the ``deployed`` terms of ``jmsnas profile``.

A latency table (``jmsnas.cost.measured``) times every op inside one whole-network call. Deployed, every device runs
its part as a program of its own, called once per image between a receive and a send (``jmsnas.deploy.worker``),
and every tensor between two parts is a frame over a socket (``jmsnas.deploy.links``). Two terms model that:

* the part call cost (ms, per part) and the part scale: parts of whole networks cut at the space's own split (D^m,
  every device's part as ``export.part_forward`` builds it, the weights passed as one flat tuple of NumPy arrays
  every call and the output brought to NumPy, as ``runtime.Part`` calls it: the weights' transfer is part of what
  it pays), and one relay part (no layer: what a device that takes none runs), are called right after their input
  arrives over a loopback TCP connection, the receiving thread idle until then (as a worker waits for its input);
  ``median ms of a part ~ part_call + part_scale x (the table's entries of what it runs: its ops, the stem on the
  first part and the head on the last)`` is fitted over the parts by non-negative least squares (``fit_part``),
  their times first divided by ``load_ratio``: the same networks timed whole (one call, back to back, as the
  table times them) in the same rounds, at the table's quantile, over the table's prediction of them, so the terms
  are on the table's footing however busy the machine is now.
  ``part_call`` is what being a program of its own between a receive and a send adds once per image (the relay's
  cost anchors it); ``part_scale`` how an op's time changes in a part of its own rather than inside the one
  whole-network call the table timed it in (the first op after a receive starts on cold caches, a part's ops
  cannot overlap a neighbour's, its weights cross the call boundary): measured on this machine 1.2 for XLA's
  kernels, 2.2-3.2 for the native CPU kernels (``docs/latency.md``);
* the hand-off (ms) of a frame of n payload bytes: from the moment the sender hands its output to its sending
  thread (which then wakes and sends it, unpaced, as a worker's link thread does) to the moment the receiver,
  waiting in a selector as a worker does, has parsed the whole frame (``links.FrameBuffer``), at several sizes,
  in interleaved rounds; ``fixed_ms + ms_per_byte * n`` is fitted by least squares (both >= 0). The link's
  bandwidth and latency are eps's own terms; the hand-off is what a frame costs on top of them (framing, the send
  and receive system calls, the threads' wake-ups).

* the part entries (``parts``): every op's time *in a part of its own*, per slot, with the part's stem and head and
  its call cost: the parts above are fitted directly, ``median ms of a part ~ call + stem? + head? + sum of its ops'
  part entries``, by non-negative least squares over the parts of a balanced design of whole networks (every valid
  op of every slot in at least ``design_repeats`` of them, the ops of different slots paired at random;
  ``balanced_archs``) plus the relay (``fit_part_entries``). Why a table of its own rather than one scale of the
  whole-network table: an op's cost in a part is not proportional to its cost inside one whole-network call (the
  first op after a receive starts cold, a root's or an aggregator's part sends or averages several tensors, and a
  whole mesh network runs its branches at once on the thread pool): fitted on the same parts and checked on the
  main job's own parts, one scale was off by -28% to +20% per device on its chain and -9% to +27% on its mesh, the
  part entries by -7% to +12% and -9% to +8% (``benchmarks/part_models.py``, ``benchmarks/README.md``). A
  part's entries are those of the space's own split: its layers' entries also carry what a part costs beyond its call at that place (they are not separable
  from it), so they price a split that moves a layer to another device less exactly than the split profiled.
  With them, ``jmsnas.cost.build`` charges every device its part entries and ``part_call`` (the fit's intercept),
  ``part_scale`` 1.

Every part and every hand-off frame is timed after the receiving thread has waited ``idle_ms`` for it (default
30 ms): deployed, a worker waits for its input between images (about T minus its own compute with one image in
flight, 50-250 ms at 5-1% of Table I's bandwidth), and a part called after such a wait pays more than one called
back to back (measured on this machine: +0.2-0.3 ms per part, growing from no wait to about 30 ms and flat after,
``benchmarks/part_models.py --waits``). ``idle_ms`` 0 times them back to back.

The wait curve (``waits``): the parts of the ``archs`` whole networks and every hand-off size are also timed after
each of the ``short_waits`` (0, 3 and 10 ms), in the same rounds; ``part_ratio`` is the median over those parts of
their time after the wait over their time after ``idle_ms``, ``handoff_fixed_ms`` the hand-off fit's fixed ms after
it. On one host the parts of a pipeline wait in turns: while one part computes, the host is not idle, and the next
part or frame comes after a short wait; only a paced link's transmission (a sleep) leaves the host idle for long.
Measured on this host: a hand-off's fixed cost 0.15 ms back to back, 0.18 after 3 ms, 0.23 after 10 ms, 0.39 after
30 ms, and in ``jmsnas pipeline`` at Table I's bandwidth the camera's and the result's hand-offs took 0.13-0.17 ms
(0.25-0.36 ms at 5-1% of it). ``predict.predict`` uses the curve for a chain's parts on one host
(``predict.wait_gaps``); the search does not (its devices are machines of their own, each idle between images).

Every timed part call also gives the CPU time it took (``time.process_time``: every thread of this process) over
its wall time; the median, ``cores_busy``, is how many of the host's ``host_cores`` a part keeps busy. They are for
a deployment that puts several parts on this one host at once (a mesh's branches in ``jmsnas pipeline`` on one
machine): ``predict.shared_cores`` shares the cores among them. A search's devices are machines of their own, so
eq. (1)/(2) never use them.

All are measured in the same rounds (``reps``; every round times every item once, in a shuffled order) and all
times are CLOCK_MONOTONIC of this host. Measured on this host they describe this host; ``jmsnas.cost.build`` turns
them into ``CostTable.call_ms`` (every device), the device's U times ``part_scale`` and ``handoff_ms`` /
``handoff_ms_per_byte`` (every link, the mean of its two ends' tables).
"""
from __future__ import annotations

import os
import selectors
import threading
import time
import warnings

import jax
import numpy as np

from jmsnas import supernet
from jmsnas.cost.measured import MeasuredTable, Timing
from jmsnas.deploy import links as L
from jmsnas.deploy.export import device_graph, part_forward
from jmsnas.run import directory
from jmsnas.space import IDENTITY, OP_NAMES, SearchSpace

HANDOFF_BYTES = (0, 4096, 32768, 131072, 524288)  # payload sizes timed for the hand-off fit (bytes)
IDLE_MS = 30.0  # a deployed part's wait for its input before it is timed (module docstring)
SHORT_WAITS = (0.0, 3.0, 10.0)  # the shorter waits the wait curve is also measured at (module docstring)
DESIGN_REPEATS = 3  # every valid op of every slot is in at least this many networks of the part entries' design
DEPLOYED_REPS = 10  # timing rounds of the deployed terms measured here (jmsnas profile --deployed-reps)
_WEIGHTS_KEY = 0
_WAIT_S = 30.0  # a loopback frame that has not come by then never will


class _Pair:
    """A loopback TCP connection: ``send`` (the sender's end, used by a helper thread) and ``recv`` (this thread's
    end, read through a selector and a FrameBuffer as a worker reads its inputs)."""

    def __init__(self):
        server = L.listen(0)
        self.send = L.connect(server.getsockname()[1])
        self.recv = L.accept(server)
        server.close()
        self.recv.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.recv, selectors.EVENT_READ)
        self.buf = L.FrameBuffer()

    def receive(self) -> tuple:
        """(Frame, the time it was complete) of the next frame; waits in the selector until it is (TimeoutError
        after ``_WAIT_S`` without a byte: the sender thread is gone)."""
        while True:
            if not self.sel.select(timeout=_WAIT_S):
                raise TimeoutError(f"no frame over the loopback connection within {_WAIT_S:g} s")
            data = self.recv.recv(1 << 20)
            if not data:
                raise L.LinkClosed("the loopback sender closed")
            frames = self.buf.feed(data)
            if frames:
                return frames[0], L.now()

    def close(self) -> None:
        self.sel.close()
        for s in (self.send, self.recv):
            s.close()


class _Sender(threading.Thread):
    """Sends each array it is given on ``pair.send`` (unpaced) from its own thread, as a worker's link thread
    (``worker._Link``) finishes a transmission: ``submit`` records the moment the output is handed over (the
    sender's compute end), so the thread's wake-up is part of the hand-off."""

    def __init__(self, pair: _Pair):
        super().__init__(daemon=True)
        self.pair, self.jobs, self.started = pair, [], []
        self.go = threading.Semaphore(0)

    def submit(self, value) -> None:
        if value is not None:
            self.started.append(L.now())
        self.jobs.append(value)
        self.go.release()

    def run(self) -> None:
        while True:
            self.go.acquire()
            value = self.jobs.pop(0)
            if value is None:
                return
            L.send_frame(self.pair.send, L.ARRAY, len(self.started), value)


def _part_specs(space: SearchSpace, ops: tuple, batch: int, dw_impl: str) -> list:
    """[(device, fwd(params, state, *xs), {"params", "bn"} weights, input arrays, entry key)] of the parts of
    architecture ``ops`` at the space's split, in execution order; entry key = (layers, ops, stem?, head?) for
    ``_entries_ms``."""
    params, state = supernet.init(jax.random.PRNGKey(_WEIGHTS_KEY), space)
    cp, cs = supernet.extract(space, params, state, ops)
    pp, bp = supernet.device_parts(space, cp, ops), supernet.device_parts(space, cs, ops)
    order, srcs, _ = device_graph(space.topology)
    shapes = {"image": (batch, space.image_size, space.image_size, space.in_channels)}
    out = []
    for dev in order:
        layers = pp[dev]["layers"]
        lops = [OP_NAMES.index(o) for o in pp[dev]["ops"]]
        stem, head = dev == order[0], dev == order[-1]
        fwd = part_forward(space, layers, lops, stem=stem, head=head, dw_impl=dw_impl)
        weights = {"params": pp[dev]["params"], "bn": bp[dev]["params"]}
        xs = tuple(np.zeros(shapes[s], np.float32) for s in srcs[dev])
        shapes[dev] = jax.eval_shape(fwd, weights["params"], weights["bn"], *xs).shape
        out.append((dev, fwd, weights, xs, (layers, lops, stem, head)))
    return out


def _parts(space: SearchSpace, ops: tuple, batch: int, dw_impl: str) -> list:
    """[(device, call(*xs) -> NumPy output, input arrays, entry key)] of ``_part_specs``, each called as
    ``runtime.Part`` calls a deployed part: its weights one flat tuple of NumPy arrays every call."""
    out = []
    for dev, fwd, weights, xs, key in _part_specs(space, ops, batch, dw_impl):
        flat = dict(directory.flat_arrays(weights["params"], "params"))
        flat.update(directory.flat_arrays(weights["bn"], "bn"))
        names = sorted(flat)
        w = tuple(np.asarray(flat[k]) for k in names)  # NumPy, as runtime.Part holds them

        def call_flat(w, *xs, names=names, fwd=fwd):
            t = directory.unflatten(dict(zip(names, w)))
            return fwd(t.get("params", {}), t.get("bn", {}), *xs)
        fn = jax.jit(call_flat)
        call = lambda *x, fn=fn, w=w: np.asarray(fn(w, *x))
        call(*xs)  # compiles
        out.append((dev, call, xs, key))
    return out


def _relay(space: SearchSpace, shape) -> tuple:
    """(device, call, input, entry key) of a part that runs no layer: it forwards its input (a relay device)."""
    fwd = jax.jit(part_forward(space, [], [], stem=False, head=False))
    x = np.zeros(shape, np.float32)
    call = lambda x, fwd=fwd: np.asarray(fwd({}, {}, x))
    call(x)  # compiles
    return ("relay", call, (x,), ((), (), False, False))


def _entries_ms(table: MeasuredTable, key: tuple) -> float:
    """The table's entries of what a part runs (ms): its ops, the stem and the head where it has them."""
    layers, ops, stem, head = key
    ms = sum(table.slots[n]["ops"][OP_NAMES[i]].median_ms for n, i in zip(layers, ops) if i != IDENTITY)
    return ms + (table.stem.median_ms if stem else 0.0) + (table.head.median_ms if head else 0.0)


def fit_handoff(nbytes, ms) -> tuple:
    """(fixed_ms, ms_per_byte) >= 0 of ``ms ~ fixed_ms + ms_per_byte * nbytes``: non-negative least squares."""
    from scipy.optimize import nnls
    x, y = np.asarray(nbytes, float), np.asarray(ms, float)
    if np.ptp(x) == 0:  # one size: nothing tells a slope
        return float(np.mean(y)), 0.0
    scale = float(np.max(np.abs(x)))  # bytes in units of the largest: columns of like size
    (a, b), _ = nnls(np.stack([np.ones_like(x), x / scale], 1), y)
    return float(a), float(b / scale)


def fit_part(entries_ms, ms) -> tuple:
    """(part_call ms, part_scale) of ``ms ~ part_call + part_scale * entries_ms`` over parts: non-negative least
    squares. Parts that all have the same entries (nothing tells a scale), or a fit whose scale is 0 (the parts'
    times do not grow with what they run: noise), give the scale 1 and the mean excess (>= 0) with a warning."""
    from scipy.optimize import nnls
    e, y = np.asarray(entries_ms, float), np.asarray(ms, float)
    if e.shape != y.shape or e.ndim != 1 or e.size == 0:
        raise ValueError(f"entries_ms and ms must be two equal 1-D lists of parts, got shapes {e.shape}, {y.shape}")
    if np.ptp(e) > 0:
        (call, scale), _ = nnls(np.stack([np.ones_like(e), e], 1), y)
        if scale > 0:
            return float(call), float(scale)
    warnings.warn("the parts' times do not grow with their entries: part scale 1, part call = their mean excess "
                  "(noisy timings); profile again on a quieter machine", RuntimeWarning, stacklevel=2)
    return max(float(np.mean(y - e)), 0.0), 1.0


def host_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _split_keys(space: SearchSpace, archs) -> list:
    """The entry keys of every device's part of every network at the space's own split, as ``_parts`` cuts them
    (``supernet.device_parts``: every device in execution order, the stem on the first, the head on the last), and
    of a relay."""
    order = space.topology.path_order()
    where = np.asarray(space.layer_devices())
    layers = [tuple(int(n) for n in np.flatnonzero(where == m)) for m in order]
    keys = [(ls, tuple(int(a[n]) for n in ls), j == 0, j == len(order) - 1) for a in archs
            for j, ls in enumerate(layers)]
    return keys + [((), (), False, False)]


def _rank(space: SearchSpace, archs) -> int:
    return int(np.linalg.matrix_rank(np.stack([_part_features(space, k) for k in _split_keys(space, archs)])))


def balanced_archs(space: SearchSpace, repeats: int, seed, tries: int = 20) -> list:
    """Whole networks in which every valid op of every slot appears in at least ``repeats`` of them: K = repeats x
    the most valid ops of a slot networks; slot n takes its valid ops in turn, each cycle in a random order (numpy
    seed), so the ops of different slots are paired at random. The parts' sums identify the part entries only as
    far as the pairings connect them (two ops that only ever meet each other can trade time): of up to ``tries``
    draws the first whose parts (at the space's split, with a relay) reach the rank of every pairing is kept, else
    the draw of the highest rank."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    rng = np.random.default_rng(seed)
    valid = [np.flatnonzero(row) for row in space.mask()]
    k = repeats * max(len(v) for v in valid)
    full = _rank(space, [tuple(int(rng.choice(v)) for v in valid) for _ in range(8 * k)])  # every pairing, likely
    best, best_rank = None, -1
    for _ in range(tries):
        cols = []
        for v in valid:
            cycles = -(-k // len(v))
            cols.append(np.concatenate([rng.permutation(v) for _ in range(cycles)])[:k])
        archs = [tuple(int(c[j]) for c in cols) for j in range(k)]
        r = _rank(space, archs)
        if r > best_rank:
            best, best_rank = archs, r
        if r >= full:
            break
    return best


def _part_features(space: SearchSpace, key: tuple) -> np.ndarray:
    """[1, stem?, head?, one-hot (slot, op) of every non-identity op]: the columns of ``fit_part_entries``."""
    layers, ops, stem, head = key
    f = np.zeros(3 + space.num_layers * len(OP_NAMES))
    f[:3] = 1.0, float(stem), float(head)
    for n, i in zip(layers, ops):
        if i != IDENTITY:
            f[3 + int(n) * len(OP_NAMES) + int(i)] = 1.0
    return f


def prior_entries(table: MeasuredTable, space: SearchSpace) -> np.ndarray:
    """The table's own entries in ``fit_part_entries``' columns: [0 (the call), stem, head, then every (slot, op)'s
    median ms inside one whole-network call (0 for identity and ops the slot lacks)]: the one-part-scale model's
    shape, which the part entries are shrunk toward."""
    w = np.zeros(3 + space.num_layers * len(OP_NAMES))
    w[1], w[2] = table.stem.median_ms, table.head.median_ms
    for n in range(space.num_layers):
        for name, t in table.slots[n]["ops"].items():
            if OP_NAMES.index(name) != IDENTITY:
                w[3 + n * len(OP_NAMES) + OP_NAMES.index(name)] = t.median_ms
    return w


def _ridge_nnls(x, y, lam: float, w0):
    """argmin ||x w - y||^2 + lam ||w - w0||^2 over w >= 0 (plain non-negative least squares for lam 0)."""
    from scipy.optimize import nnls
    if lam == 0:
        return nnls(x, y)[0]
    k = x.shape[1]
    return nnls(np.vstack([x, np.sqrt(lam) * np.eye(k)]), np.concatenate([y, np.sqrt(lam) * w0]))[0]


def _one_scale_prior(x, y, prior):
    """[call, scale x prior[1:]]: the one-part-scale model over the parts' entries under ``prior``, as ``fit_part``
    fits it but without its warned fallback (called in every cross-validation fold, where a scale of 0 only means
    no pull toward the table's shape)."""
    from scipy.optimize import nnls
    e = x[:, 1:] @ prior[1:]
    (call, scale), _ = nnls(np.stack([np.ones_like(e), e], 1), y)
    return np.concatenate([[call], scale * prior[1:]])


def _fit_columns(x, y, lam, prior, cols):
    w = np.zeros(x.shape[1])
    w0 = _one_scale_prior(x, y, prior) if prior is not None else np.zeros(x.shape[1])
    w[cols] = _ridge_nnls(x[:, cols], y, lam, w0[cols])
    return w


def _cv_rms(x, y, groups, lam, prior, cols, folds: int) -> float:
    """RMS relative error (%) of the fit at ``lam`` over whole networks held out in turn: network g (its rank
    among the distinct ``groups``, None never held out) is in fold rank mod ``folds``. A held-out part that runs an
    op no training part runs is left out of the score (no fit can price it; the full design has every op)."""
    names = sorted({g for g in groups if g is not None})
    fold = {g: r % folds for r, g in enumerate(names)}
    errs = []
    for f in range(folds):
        held = np.array([g is not None and fold[g] == f for g in groups])
        if not held.any() or held.all():
            continue
        tr = ~held
        w = _fit_columns(x[tr], y[tr], lam, prior, cols)
        unseen = ~x[tr].any(0)
        ok = held & ~(x[:, 3:] * unseen[3:] > 0).any(1)
        errs.append((x[ok] @ w) / np.maximum(y[ok], 1e-12) - 1.0)
    e = np.concatenate(errs) if errs else np.zeros(0)
    return float(np.sqrt(np.mean(e ** 2)) * 100.0) if e.size else float("nan")


SHRINKS = (0.0, 0.1, 0.3, 1.0, 3.0, 10.0)  # the pull toward the one-scale model that cross-validation chooses from
CV_FOLDS = 8  # whole networks held out in turn


def fit_part_entries(space: SearchSpace, keys, ms, prior=None, groups=None, shrinks=SHRINKS,
                     folds: int = CV_FOLDS) -> dict:
    """The part entries (module docstring) of parts with entry keys ``keys`` ((layers, ops, stem?, head?), as
    ``_parts`` gives them) and median times ``ms``: non-negative least squares of ``ms ~ call + stem? + head? + sum
    of the part's ops``. {"call_ms", "stem_ms", "head_ms", "ops": float[num_layers, len(OP_NAMES)] (0 for identity
    and invalid cells), "parts", "rms_error_pct" (the fit's RMS relative error over the parts)}. ValueError (one
    line) for a valid (slot, op) that no part runs, or no part with a stem or a head.

    With ``prior`` (``prior_entries``: the whole-network table's entries) and ``groups`` (the network each part was
    cut from, None for the relay), the entries are shrunk toward the one-part-scale model (``fit_part``'s call and
    scale times the table's entries): ``min ||parts - sums||^2 + shrink ||entries - prior model||^2``, entries >= 0,
    ``shrink`` the one of ``shrinks`` (0: no pull, the plain fit) with the lowest RMS relative error over networks
    held out in turn (``folds``); the result adds "shrink", "cv_rms_error_pct" (at it) and
    "cv_rms_error_pct_unshrunk" (at 0). Why: every entry rests on the few parts that run it (three networks per
    op in the design), so the plain fit follows their noise: on parts timed in 10 rounds it erred 9.7% (chain) and
    10.5% (mesh) RMS on networks held out, 8.7% and 9.0% shrunk (by 0.3 and 1); on the profile's own 15 rounds,
    6.0% and 6.6%, and no pull helped (0 chosen; ``benchmarks/README.md``)."""
    x = np.stack([_part_features(space, k) for k in keys])
    y = np.asarray(ms, float)
    if y.shape != (len(keys),) or not np.all(np.isfinite(y)) or np.any(y < 0):
        raise ValueError(f"ms must be one finite time >= 0 per part, got {y.tolist()!r}")
    need = np.zeros(x.shape[1], bool)
    need[:3] = True
    mask = space.mask()
    for n in range(space.num_layers):
        for i in np.flatnonzero(mask[n]):
            if i != IDENTITY:
                need[3 + n * len(OP_NAMES) + i] = True
    missing = np.flatnonzero(need & ~x.any(0))
    if missing.size:
        j = int(missing[0])
        what = ("the call", "a stem", "a head")[j] if j < 3 else \
            f"slot {(j - 3) // len(OP_NAMES)} op {OP_NAMES[(j - 3) % len(OP_NAMES)]}"
        raise ValueError(f"no part runs {what}: the parts cannot price it (time a balanced design, balanced_archs)")
    cols = np.flatnonzero(need)
    extra = {}
    if prior is None:
        w = _fit_columns(x, y, 0.0, None, cols)
    else:
        prior = np.asarray(prior, float)
        if prior.shape != (x.shape[1],) or not np.all(np.isfinite(prior)) or np.any(prior < 0):
            raise ValueError(f"prior must be {x.shape[1]} finite entries >= 0 (prior_entries), got shape "
                             f"{prior.shape}")
        groups = list(groups) if groups is not None else [None] * len(keys)
        if len(groups) != len(keys):
            raise ValueError(f"groups must name the network of every part: {len(groups)} for {len(keys)} parts")
        if not shrinks or any(not (float(v) >= 0) for v in shrinks):
            raise ValueError(f"shrinks must be numbers >= 0, got {shrinks!r}")
        scores = [(_cv_rms(x, y, groups, float(v), prior, cols, folds), float(v)) for v in shrinks]
        best_score, best = min(scores, key=lambda t: (np.nan_to_num(t[0], nan=np.inf), t[1]))
        w = _fit_columns(x, y, best, prior, cols)
        at = {v: score for score, v in scores}
        unshrunk = at[0.0] if 0.0 in at else _cv_rms(x, y, groups, 0.0, prior, cols, folds)
        extra = {"shrink": best, **{k: v for k, v in (("cv_rms_error_pct", best_score),
                                                       ("cv_rms_error_pct_unshrunk", unshrunk)) if np.isfinite(v)}}
    rms = float(np.sqrt(np.mean(((x @ w) / np.maximum(y, 1e-12) - 1.0) ** 2)) * 100.0)
    return {"call_ms": float(w[0]), "stem_ms": float(w[1]), "head_ms": float(w[2]),
            "ops": w[3:].reshape(space.num_layers, len(OP_NAMES)), "parts": int(len(keys)), "rms_error_pct": rms,
            **extra}


def measure_deployed(space: SearchSpace, table: MeasuredTable, *, reps: int = 30, archs: int = 4, seed: int = 0,
                     sizes=HANDOFF_BYTES, idle_ms: float = IDLE_MS,
                     design_repeats: int | None = DESIGN_REPEATS, short_waits=SHORT_WAITS) -> dict:
    """The ``deployed`` entry of ``table`` (measured for ``space`` on this host, module docstring): {"part_call":
    Timing (ms), "part_scale", "idle_ms", "handoff": {"fixed_ms", "ms_per_byte", "bytes", "median_ms"}, "parts":
    the part entries (``fit_part_entries``; absent with ``design_repeats`` None), "waits": the wait curve (module
    docstring; absent with no ``short_waits`` shorter than ``idle_ms``)}. ``archs`` whole networks are
    cut into parts: the table's base architecture (mbconv_k3_e3 everywhere by default) and random valid ones (numpy
    seed [seed, 2]), plus one relay part, and so are the networks of the balanced design (``balanced_archs`` with
    ``design_repeats``, numpy seed [seed, 4]). ``part_call`` and ``part_scale`` are fitted over all of them
    (``fit_part``), and so are the part entries; with the part entries, ``part_call`` is their fit's call and
    ``part_scale`` 1. The ``archs`` networks are also timed whole, as one call, in the same rounds (first in each
    round, back to back, as the table's rounds time them): ``load_ratio`` (returned, not stored) is the median over
    them of (their time at the table's quantile) / (the table's prediction of it), and the parts' times are divided
    by it before the fits, so a machine busier (or quieter) now than when the table was made moves neither the call
    cost nor the scale nor the part entries. Every part and every hand-off frame is timed after a wait of
    ``idle_ms`` (module docstring); with a wait (``idle_ms`` > 0) the ratio is returned but not applied: after
    waits this host ran even the whole networks 0.84-1.46 x the table's prediction made a minute before, from one
    profile to the next (``benchmarks/README.md``), so there it measures the host's state after a wait, which is
    the parts' cost to keep, not load. Measure the deployed terms on a quiet machine."""
    from jmsnas.cost.profile import arch_calls, sample_archs
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 3:
        raise ValueError(f"reps must be an integer >= 3, got {reps!r}")
    if isinstance(idle_ms, bool) or not isinstance(idle_ms, (int, float)) or not 0 <= idle_ms <= 10_000:
        raise ValueError(f"idle_ms must be a number of ms in [0, 10000], got {idle_ms!r}")
    if any(isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w for w in short_waits):
        raise ValueError(f"short_waits must be numbers of ms >= 0, got {short_waits!r}")
    waits = sorted({float(w) for w in short_waits if w < idle_ms})  # none when the parts are timed back to back
    if waits and waits[0] != 0:
        raise ValueError(f"short_waits must start at 0 (back to back), got {short_waits!r}")
    batch, dw_impl = int(table.settings.get("batch", 1)), str(table.settings.get("dw_impl", "auto"))
    base = tuple(int(i) for i in table.settings.get("base", [0] * space.num_layers))
    nets = [base] + sample_archs(space, max(archs - 1, 0), [seed, 2])
    design = [] if design_repeats is None else balanced_archs(space, design_repeats, [seed, 4])
    cut = [_parts(space, ops, batch, dw_impl) for ops in nets + design]
    parts = [p for net in cut for p in net]
    groups = [g for g, net in enumerate(cut) for _ in net] + [None]  # the network each part is cut from
    n_curve = sum(len(net) for net in cut[:len(nets)])  # the archs networks' parts, first: the wait curve's
    parts.append(_relay(space, parts[0][1](*parts[0][2]).shape))  # relays the first part's output
    wholes = arch_calls(space, nets, batch, dw_impl)
    sizes = [int(n) for n in sizes]
    items = ([("size", n, idle_ms) for n in sizes] + [("part", k, idle_ms) for k in range(len(parts))]
             + [(what, k, w) for w in waits for what, k in [("size", n) for n in sizes]
                + [("part", k) for k in range(n_curve)]])
    short_hand = {(n, w): [] for n in sizes for w in waits}
    short_part = {(k, w): [] for k in range(n_curve) for w in waits}
    net_ms = [[] for _ in nets]
    hand = {n: [] for n in sizes}
    part_ms = [[] for _ in parts]
    busy = []  # CPU seconds per second of every timed part call: how many cores a part keeps busy
    pair = _Pair()
    sender = _Sender(pair)
    sender.start()
    rng = np.random.default_rng([seed, 3])
    try:
        for r in range(reps + 1):  # round 0 warms every path up and is not kept
            # the whole networks first, as the table's rounds time them (each right after an untimed call)
            for k in rng.permutation(len(wholes)):
                fn, args = wholes[k]
                jax.block_until_ready(fn(*args))
                t0 = L.now()
                jax.block_until_ready(fn(*args))
                if r:
                    net_ms[k].append((L.now() - t0) * 1e3)
            for j in rng.permutation(len(items)):
                what, k, wait = items[j]
                if wait:
                    time.sleep(wait / 1e3)  # the receiver waits for its input, as a worker between images
                if what == "size":
                    sender.submit(np.zeros(k, np.uint8))
                    _, t1 = pair.receive()
                    if r:
                        (hand[k] if wait == idle_ms else short_hand[(k, wait)]).append((t1 - sender.started[-1]) * 1e3)
                else:
                    _, call, xs, _ = parts[k]
                    sender.submit(xs[0])
                    fr, t0 = pair.receive()
                    c0 = time.process_time()
                    y = call(fr.value, *xs[1:])
                    t1, c1 = L.now(), time.process_time()
                    if r and wait == idle_ms:
                        part_ms[k].append((t1 - t0) * 1e3)
                        busy.append((c1 - c0) / max(t1 - t0, 1e-9))
                    elif r:
                        short_part[(k, wait)].append((t1 - t0) * 1e3)
                    del y
    finally:
        sender.submit(None)
        sender.join(timeout=5.0)
        pair.close()
    medians = [float(np.median(hand[n])) for n in sizes]
    a, b = fit_handoff(sizes, medians)
    ratio = _load_ratio(table, nets, net_ms)
    norm = ratio if idle_ms == 0 else 1.0  # after waits the ratio is the host's state, not load: not applied
    times = [float(np.median(t)) / norm for t in part_ms]
    call, scale = fit_part([_entries_ms(table, p[3]) for p in parts], times)
    spread = float(np.mean([np.subtract(*np.percentile(t, [75, 25])) for t in part_ms])) / norm
    out = {"part_call": Timing(call, spread, reps), "part_scale": scale, "load_ratio": ratio, "idle_ms": float(idle_ms),
           "host_cores": host_cores(), "cores_busy": min(float(np.median(busy)), float(host_cores())),
           "handoff": {"fixed_ms": a, "ms_per_byte": b, "bytes": sizes, "median_ms": medians}}
    if waits:
        ratio_at = [float(np.median([np.median(short_part[(k, w)]) / np.median(part_ms[k]) for k in range(n_curve)]))
                    for w in waits]
        fixed_at = [fit_handoff(sizes, [float(np.median(short_hand[(n, w)])) for n in sizes])[0] for w in waits]
        out["waits"] = {"wait_ms": tuple(waits) + (float(idle_ms),), "part_ratio": tuple(ratio_at) + (1.0,),
                        "handoff_fixed_ms": tuple(fixed_at) + (float(a),)}
    if design:
        fit = fit_part_entries(space, [p[3] for p in parts], times, prior=prior_entries(table, space), groups=groups)
        ops = tuple(tuple(row) for row in fit.pop("ops").tolist())  # a table's fields compare by value
        out.update(part_call=Timing(fit.pop("call_ms"), spread, reps), part_scale=1.0, parts=dict(fit, ops=ops))
    return out


def measure_deployed_remote(space: SearchSpace, table: MeasuredTable, address: str, *, reps: int = 30,
                            archs: int = 4, seed: int = 0, sizes=HANDOFF_BYTES, credentials=None,
                            timeout_s: float = 60.0, platforms=("cpu",)) -> dict:
    """The ``deployed`` entry of ``table`` (a table measured on the machine of the ``jmsnas worker`` at
    ``address``) measured there (``jmsnas profile --remote``): the same parts and relay as ``measure_deployed``,
    exported with their weights as arguments (``export.program_with_weights``, for ``platforms``), each called by
    the worker right after its input frame arrives from here (``timer.probe_deployed``: the ``run`` probe, its time
    on the worker's clock), fitted by ``fit_part``; the hand-off from round trips of frames of each of ``sizes``
    bytes over the connection to the worker (its own network, TLS when the credentials have it): a round trip is
    the frame's hand-off there plus a near-empty answer's back, so ``fixed_ms`` is half the fitted round trip's
    intercept and ``ms_per_byte`` its slope (``median_ms``: each size's median round trip less that half). Over a
    real network the slope holds that network's own bytes / bandwidth too, which eps charges from the topology's
    link: profile over a connection much faster than the links the topology models. ValueError (one line naming
    the address) for a worker that cannot be reached, does not authenticate or fails. The same whole networks, sent
    too, are timed there by back-to-back calls (``calibrate``, as the table's rounds time them): ``load_ratio`` as in
    ``measure_deployed``."""
    from jmsnas.cost.profile import sample_archs
    from jmsnas.deploy import timer
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 3:
        raise ValueError(f"reps must be an integer >= 3, got {reps!r}")
    timer.parse_address(address)
    batch, dw_impl = int(table.settings.get("batch", 1)), str(table.settings.get("dw_impl", "auto"))
    if dw_impl not in ("xla", "shifted"):
        raise ValueError(f"the table timed the {dw_impl!r} depthwise convolution; a part sent to a worker holds no "
                         "custom call: profile the table there with --dw-impl xla (or shifted)")
    base = tuple(int(i) for i in table.settings.get("base", [0] * space.num_layers))
    nets = [base] + sample_archs(space, max(archs - 1, 0), [seed, 2])
    specs = [p for ops in nets for p in _part_specs(space, ops, batch, dw_impl)]
    first = specs[0]
    relay_in = jax.eval_shape(first[1], first[2]["params"], first[2]["bn"], *first[3])
    specs.append(("relay", part_forward(space, [], [], stem=False, head=False), {"params": {}, "bn": {}},
                  (np.zeros(relay_in.shape, np.float32),), ((), (), False, False)))
    program = lambda fwd, weights, xs: timer.program_part(*_exported(fwd, weights, xs, platforms))
    probes = [(program(fwd, weights, xs), xs[0]) for _, fwd, weights, xs, _ in specs]
    image = np.zeros((batch, space.image_size, space.image_size, space.in_channels), np.float32)
    wholes = [program(_whole_forward(space, ops, dw_impl), _whole_weights(space, ops), (image,)) for ops in nets]
    runs, rtt, net_ms = timer.probe_deployed(address, probes, sizes, reps=reps, seed=seed, timeout_s=timeout_s,
                                             credentials=credentials, wholes=wholes)
    ratio = _load_ratio(table, nets, net_ms)
    call, scale = fit_part([_entries_ms(table, p[4]) for p in specs], [float(np.median(t)) / ratio for t in runs])
    sizes = [int(n) for n in sizes]
    trips = [float(np.median(rtt[n])) for n in sizes]
    a2, b = fit_handoff(sizes, trips)
    medians = [max(t - a2 / 2, 0.0) for t in trips]
    spread = float(np.mean([np.subtract(*np.percentile(t, [75, 25])) for t in runs])) / ratio
    return {"part_call": Timing(call, spread, reps), "part_scale": scale, "load_ratio": ratio,
            "handoff": {"fixed_ms": a2 / 2, "ms_per_byte": b, "bytes": sizes, "median_ms": medians}}


def _exported(fwd, weights: dict, xs, platforms) -> tuple:
    """(serialised program, flat weights) of ``fwd(params, state, *xs)`` with its weights as arguments."""
    from jmsnas.deploy.export import program_with_weights
    exported, flat = program_with_weights(fwd, weights, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs],
                                          tuple(platforms))
    return bytes(exported.serialize()), flat


def _whole_weights(space: SearchSpace, ops: tuple) -> dict:
    """{"params", "bn"}: the weights of architecture ``ops`` run whole (``supernet.extract``, the parts' weights)."""
    params, state = supernet.init(jax.random.PRNGKey(_WEIGHTS_KEY), space)
    cp, cs = supernet.extract(space, params, state, ops)
    return {"params": cp, "bn": cs}


def _whole_forward(space: SearchSpace, ops: tuple, dw_impl: str):
    """f(params, state, image) -> logits: architecture ``ops`` as one call (what the table's rounds time); its
    weights as ``export.program_with_weights`` rebuilds them (the layers' tuple as {"0": ...}, an empty one absent)."""
    def layers_tuple(tree):
        layers = tree.get("layers", {})
        if isinstance(layers, dict):
            layers = tuple(layers.get(str(n), {}) for n in range(space.num_layers))
        return dict(tree, layers=layers)
    return lambda p, s, x: supernet.compact_apply(space, tuple(ops), layers_tuple(p), layers_tuple(s), x,
                                                  train=False, dw_impl=dw_impl)[0]


def _load_ratio(table: MeasuredTable, nets, net_ms) -> float:
    """Median over whole networks of (their times at the table's quantile) / (the table's prediction of them)."""
    from jmsnas.cost.measured import predict_arch_ms
    q = float(table.settings.get("quantile", 0.5))
    ratio = float(np.median([np.quantile(t, q) / predict_arch_ms(table, ops) for t, ops in zip(net_ms, nets)]))
    if not np.isfinite(ratio) or ratio <= 0:
        raise ValueError(f"the table predicts whole networks of {predict_arch_ms(table, nets[0])!r} ms: no "
                         "reference for the parts' times")
    return ratio


def with_deployed(space: SearchSpace, table: MeasuredTable, remote: str | None = None, **kwargs) -> MeasuredTable:
    """``table`` with its ``deployed`` entry measured here (``measure_deployed``) or on the worker at ``remote``
    (``measure_deployed_remote``)."""
    if remote is not None:
        return table._replace(deployed=measure_deployed_remote(space, table, remote, **kwargs))
    return table._replace(deployed=measure_deployed(space, table, **kwargs))

