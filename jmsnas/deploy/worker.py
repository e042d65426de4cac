"""One device of the pipeline as its own OS process (a session): ``python -m jmsnas.deploy.worker --fd N``, started
with its control connection as file descriptor N: one end of a socket pair (the local pipeline, ``pipeline``) or the
connection ``jmsnas worker --listen HOST:PORT`` (``daemon``) accepted from the coordinator, which has proved the
shared secret already. Imports only the standard library, numpy, jax and the modules ``runtime``, ``links`` and
``auth``. Its credentials come in its environment (``auth.to_env``: the secret, the TLS files): with TLS it runs TLS
on the control connection (the handshake again inside it; not on a local socket pair, ``--plain-control``); every
data link it makes or accepts proves the secret (``auth.secure_client`` / ``secure_server``; a connection that
does not is closed with one line on stderr and takes no input's place). A malformed frame or message ends the
session with one line on stderr; SIGTERM (also sent when its parent dies) removes its part files first.

The control protocol (frames of ``links``; JSON unless said; the worker's times are its own CLOCK_MONOTONIC, s):

1. coordinator: ``{"part": device, "manifest": export manifest}``, then two ARRAY uint8 frames, the bytes of the
   part's ``program`` and ``weights`` files. The worker stores them in a private temporary directory, loads and checks
   them (``runtime.load_part``: SHA-256, signature, versions, platform), listens for data on ``--host`` (default:
   the address the control connection reached it at), compiles the part and answers ``{"hello": device, "host",
   "port", "pid", "versions": runtime.versions()}``.
2. any number, in any order: ``{"clock": t1}`` -> ``{"clock": [t1, t2, t3]}`` (t2 receipt, t3 answer; the four-
   timestamp exchange of ``clock``); ``{"calibrate": n[, "warmup": w]}`` -> ``{"calib_ms": median, "times_ms": [n
   call times]}`` (host time of the part on zeros, after 1 + w untimed calls; this is how a remote machine times an
   exported program: ``jmsnas.deploy.timer``); another ``{"part": ...}`` with its two files, which replaces the part
   and is answered with a new hello (a client timing several programs in one session); ``{"echo": true}`` + an
   ARRAY frame -> ``{"echo": its bytes}`` and ``{"run": true}`` + an ARRAY frame (the part's first input) ->
   ``{"run_ms": ms from the frame's arrival to the end of the part's call}`` (``jmsnas profile --remote``: the
   deployed terms on this machine, ``_probe``); ``{"end": true}`` -> the worker exits 0 (a session that only
   timed parts).
3. ``{"peers": {device: [host, port]}, "to": [...], "stretch": S, "out": {dst: [Mbit/s or null, latency ms]},
   "in": {src: [latency ms, receiver - sender clock s]}}``: the worker connects to the devices its output goes to
   (sending ``{"from": device, "framing": [MSS, header bytes]}``), accepts one connection per input and answers
   ``{"ready": true, "framing": {src: [MSS, header bytes]}}``; a null bandwidth means the network shapes the link (no
   user-space pacing).
4. for every image (one thread reads all inputs through a selector): waits until every input is released (the
   link's latency after the sender's end of transmission, on this clock), runs the part, sleeps ``(stretch - 1) x``
   the call time when it is to play a slower device, starts the transmission on every idle outgoing link (``_Link``)
   or sends the output to the coordinator (ARRAY frame, unthrottled) on the last device, and reports ``{"done":
   image, "c0", "c1", "host_ms", "in": {src: [tx_start (sender's clock), tx_end (sender's), arrival, release,
   payload Mbit/s seen by this receiver, payload bytes]}}``;
   A staged part (``runtime.Stages``, a separable network's group; any other part is one stage) runs its stages in
   order for every image (``_StageRunner``): stage k waits for the frames its remote inputs send it, sends F(y) to
   its ``send`` destinations and keeps y for the next stage; one record per image.
5. on STOP from every input: forwards STOP, waits for its senders, sends ``{"bye": true}`` and exits 0 (a staged
   part forwards STOP once its first stage's source stopped and no image is left: its links form cycles).

Errors are sent as ``{"error": one line, "cause": "own" | "upstream"}`` and end the process with exit code 2.
The process dies with its parent (PR_SET_PDEATHSIG) and exits when the control connection closes.
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import os
import queue
import selectors
import shutil
import signal
import socket
import ssl
import statistics
import sys
import tempfile
import threading

import numpy as np

from jmsnas.deploy import auth, links as L
from jmsnas.deploy.runtime import DeployError, load_stages, part_files, versions

_TMP: list = []  # the temporary directory holding this session's part files (removed on every way out)


def _cleanup() -> None:
    for d in _TMP:
        shutil.rmtree(d, ignore_errors=True)

class _Control:
    """The control connection; sends are serialised by a lock (the main and sender threads share it)."""

    def __init__(self, sock):
        self.sock, self.lock = sock, threading.Lock()

    def send(self, kind, image=-1, value=None):
        with self.lock:
            L.send_frame(self.sock, kind, image, value)


def _on_sigterm(signum, _frame) -> None:
    """A session ended by a signal (its worker stopping, or its parent gone) leaves no part file behind."""
    _cleanup()
    os._exit(128 + signum)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: _on_sigterm cleans up
    except (OSError, AttributeError):
        pass


def _calibrate(part, calls: int, warmup: int = 0) -> list:
    """Host times of ``calls`` calls of the part on zeros (ms), after a first call that compiles it and ``warmup``
    more untimed ones."""
    if not 0 <= calls <= 100000 or not 0 <= warmup <= 100000:
        raise ValueError(f"calibrate takes 0-100000 calls and 0-100000 warmup calls, got {calls}, {warmup}")
    parts = [p for p, _ in part.stages]  # every stage
    xs = [[np.zeros(i["shape"], i["dtype"]) for i in p.inputs] for p in parts]
    for _ in range(1 + warmup):
        for p, x in zip(parts, xs):
            p(*x)
    times = []
    for _ in range(calls):
        t0 = L.now()
        for p, x in zip(parts, xs):
            p(*x)
        times.append((L.now() - t0) * 1e3)
    return times


def _probe(part, msg: dict, fr) -> dict:
    """The answer to a probe (step 2): ``{"echo": true}`` + an ARRAY frame -> ``{"echo": its payload bytes}`` at
    once (the client times the round trip: the hand-off of a frame there and back); ``{"run": true}`` + an ARRAY
    frame, the part's first input -> ``{"run_ms": ms}`` from the moment the frame was whole to the end of the
    part's call on it (its other inputs zeros): the part called right after a receive, as in a pipeline."""
    if fr.kind != L.ARRAY:
        raise DeployError(f"a {'run' if 'run' in msg else 'echo'} probe must be followed by an ARRAY frame, got "
                          f"frame kind {fr.kind!r}")
    x = np.asarray(fr.value)
    if "echo" in msg:
        return {"echo": int(x.nbytes)}
    p = part.stages[0][0]
    want = p.inputs[0]
    if list(x.shape) != list(want["shape"]) or str(x.dtype) != str(want["dtype"]):
        raise DeployError(f"a run probe's input is {x.dtype}{list(x.shape)}, the part takes "
                          f"{want['dtype']}{list(want['shape'])}")
    p(x, *[np.zeros(i["shape"], i["dtype"]) for i in p.inputs[1:]])
    return {"run_ms": (L.now() - fr.arrival) * 1e3}


class _Link:
    """An outgoing link: a sender thread finishes the transmissions. When the link is idle the device's main
    thread starts a transmission itself (header and first chunk, ``links.start_frame``) the moment the output is
    ready, so no thread wake-up lies between the compute end and the start of transmission; otherwise the output
    queues behind the one on the wire."""

    def __init__(self, sock, pace: L.Pace, errors: queue.Queue, dst: str):
        self.sock, self.pace, self.errors, self.dst = sock, pace, errors, dst
        self.q, self.lock, self.pending = queue.Queue(), threading.Lock(), 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def put(self, item) -> None:
        """Sends (image, y), or STOP for None, after everything put before."""
        with self.lock:
            idle = self.pending == 0
            self.pending += 1
        if idle and item is not None:  # the sender thread is waiting on an empty queue: the socket is ours
            image, y = item
            try:
                self.q.put(("rest",) + L.start_frame(self.sock, L.ARRAY, image, y, self.pace))
            except OSError as e:
                self.errors.put(("upstream", f"the link to {self.dst!r} failed: {e}"))
            return
        self.q.put(("whole", item))

    def _run(self) -> None:
        try:
            while True:
                job = self.q.get()
                if job[0] == "rest":
                    L.finish_frame(self.sock, *job[1:], self.pace)
                elif job[1] is None:
                    L.send_frame(self.sock, L.STOP)
                    return
                else:
                    L.send_frame(self.sock, L.ARRAY, job[1][0], job[1][1], self.pace)
                with self.lock:
                    self.pending -= 1
        except OSError as e:
            self.errors.put(("upstream", f"the link to {self.dst!r} failed: {e}"))


def _watch_control(sock) -> None:
    """Ends the process when the coordinator goes away (its connection closes)."""
    try:
        while L.recv_frame(sock):
            pass
    except (OSError, L.LinkClosed):
        _cleanup()
        os._exit(3)


def _receive_part(ctl: _Control, msg: dict):
    """Step 1 (``msg``: the ``{"part", "manifest"}`` message): the part's files from the coordinator, stored and
    loaded (``runtime.load_stages``)."""
    device, manifest = msg["part"], msg["manifest"]
    entry = manifest["parts"][device]
    folder = tempfile.mkdtemp(prefix=f"jmsnas_part_{device}_")
    _TMP.append(folder)
    for stage, key in part_files(entry):
        blob = L.recv_frame(ctl.sock).value
        name = os.path.basename(str(stage[key]))
        with open(os.path.join(folder, name), "wb") as f:
            f.write(np.asarray(blob, np.uint8).tobytes())
        stage[key] = name
    return device, load_stages(folder, device, manifest)


def _log(line: str) -> None:
    """One line on stderr (the ``jmsnas worker``'s log, or the local pipeline's log of this device)."""
    print(f"jmsnas session {os.getpid()}: {' '.join(str(line).split())}", file=sys.stderr, flush=True)


def _accept_inputs(server, n: int, creds: auth.Credentials, failed=lambda: None) -> tuple:
    """({source: connection}, {source: framing}) of the ``n`` data links into this device; a connection that does
    not prove the secret (``auth``) is closed with one line in the log and takes no input's place. ``failed()``:
    an exception to raise instead of waiting on (this device's own outgoing links failed), checked twice a second."""
    ins, framing = {}, {}
    server.settimeout(0.5)
    while len(ins) < n:
        try:
            conn, addr = server.accept()
        except (socket.timeout, TimeoutError):
            if failed() is not None:
                raise failed()
            continue
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            conn = auth.secure_server(conn, creds)
            hello = L.recv_frame(conn).value
            src = hello["from"]
        except (auth.AuthError, ssl.SSLError, OSError, L.LinkClosed, TypeError, KeyError) as e:
            _log(f"refused a data link from {addr[0]}:{addr[1]}: {e}")
            conn.close()
            continue
        ins[src], framing[src] = conn, hello.get("framing")
    return ins, framing


def connect_link(addr, creds: auth.Credentials, what: str):
    """A data link to ``addr`` (host, port), authenticated (and encrypted) with ``creds``; DeployError naming
    ``what`` when the peer does not prove the secret."""
    s = L.connect(tuple(addr))
    try:
        return auth.secure_client(s, creds, str(addr[0]))
    except (auth.AuthError, ssl.SSLError, OSError) as e:
        s.close()
        raise DeployError(f"{what} at {addr[0]}:{addr[1]} did not authenticate: {e}") from None


def _read_available(sock):
    """The bytes a readable socket holds (b"": closed; None: nothing whole yet, a partial TLS record)."""
    try:
        data = sock.recv(1 << 20)
    except ssl.SSLWantReadError:
        return None
    if isinstance(sock, (ssl.SSLSocket, auth.SerialTLS)):
        while data and sock.pending():
            data += sock.recv(sock.pending())
    return data


def _setup(args, ctl: _Control, creds: auth.Credentials = auth.NONE):
    device, part = _receive_part(ctl, L.recv_frame(ctl.sock).value)
    host = args.host or ctl.sock.getsockname()[0]
    try:
        server = L.listen(args.port, host)
    except OSError as e:
        raise DeployError(f"device {device!r} cannot listen on {host}:{args.port}: "
                          f"{'the port is in use' if e.errno == errno.EADDRINUSE else e.strerror}") from None
    hello = lambda: {"hello": device, "host": host, "port": server.getsockname()[1], "pid": os.getpid(),
                     "versions": versions()}
    _calibrate(part, 0)  # compile before reporting
    ctl.send(L.JSON, value=hello())
    while True:
        fr = L.recv_frame(ctl.sock)
        t2, msg = fr.arrival, fr.value
        if "clock" in msg:
            ctl.send(L.JSON, value={"clock": [msg["clock"], t2, L.now()]})
        elif "calibrate" in msg:  # one device at a time, while the others wait: the host time in isolation
            times = _calibrate(part, int(msg["calibrate"]), int(msg.get("warmup", 0)))
            ctl.send(L.JSON, value={"calib_ms": statistics.median(times) if times else None, "times_ms": times})
        elif "part" in msg:  # another part replaces this one (a client timing several programs)
            device, part = _receive_part(ctl, msg)
            _calibrate(part, 0)
            ctl.send(L.JSON, value=hello())
        elif "echo" in msg or "run" in msg:  # a probe of the deployed terms (jmsnas profile --remote)
            ctl.send(L.JSON, value=_probe(part, msg, L.recv_frame(ctl.sock)))
        elif msg.get("end"):
            raise SystemExit(0)
        else:
            break
    outs, errors = {}, []

    def connect_out(dst):  # concurrently with the accepts: a cycle of links (a separable network) waits on both
        try:
            s = connect_link(msg["peers"][dst], creds, f"device {device!r}: the data link to {dst!r}")
            L.send_frame(s, L.JSON, value={"from": device, "framing": L.framing(s)})
            bw, lat = msg["out"][dst]
            outs[dst] = (s, L.Pace(bw, lat))
        except Exception as e:  # noqa: BLE001 - re-raised by the main thread
            errors.append(e)
    threads = [threading.Thread(target=connect_out, args=(d,), daemon=True) for d in msg["to"] if d != "result"]
    for t in threads:
        t.start()
    ins, framing = _accept_inputs(server, len(part.inputs), creds, lambda: errors[0] if errors else None)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    outs = {d: outs[d] for d in msg["to"] if d in outs}  # in the manifest's order
    server.close()
    return device, part, msg, outs, ins, framing


def _serve(ctl: _Control, device, part, msg, outs, ins, framing) -> None:
    """The stream loop: one thread reads every input (a selector, frames parsed as their bytes arrive), computes
    and hands outputs to the senders; a frame is used once released (the link's latency after its end of
    transmission)."""
    errors = queue.Queue()
    senders = [_Link(sock, pace, errors, dst) for dst, (sock, pace) in outs.items()]
    sel = selectors.DefaultSelector()
    for src, conn in ins.items():
        conn.setblocking(False)
        sel.register(conn, selectors.EVENT_READ, (src, L.FrameBuffer()))
    threading.Thread(target=_watch_control, args=(ctl.sock,), daemon=True).start()
    ctl.send(L.JSON, value={"ready": True, "framing": framing})
    order = [i["from"] for i in part.inputs]
    stopped = set()
    staged = _StageRunner(ctl, part, senders, float(msg["stretch"]))
    forwarded = False
    while len(stopped) < len(order):
        if not forwarded and staged.finished(stopped):
            for link in senders:  # a staged part's exchanges form cycles: stop the links once no image is left,
                link.put(None)   # not on STOP from every input (which would wait on each other)
            forwarded = True
        if not errors.empty():
            raise RuntimeError(errors.get()[1])
        for key, _ in sel.select(timeout=1.0):
            src, buf = key.data
            try:
                data = _read_available(key.fileobj)
                if data is None:
                    continue
                if not data:
                    raise L.LinkClosed("connection closed by the peer")
                frames = buf.feed(data)
            except (OSError, L.LinkClosed) as e:
                ctl.send(L.JSON, value={"error": f"device {device!r}: the input link from {src!r} closed "
                                                 f"({e})", "cause": "upstream"})
                sys.exit(2)
            for fr in frames:
                if fr.kind == L.STOP:
                    stopped.add(src)
                    sel.unregister(key.fileobj)
                    break
                staged.feed(src, fr, L.release_time(fr, *msg["in"].get(src, (0.0, 0.0))))
    for link in senders if not forwarded else []:
        link.put(None)
    for link in senders:
        link.thread.join()
    if not errors.empty():
        raise RuntimeError(errors.get()[1])
    ctl.send(L.JSON, value={"bye": True})


def _payload(f) -> int:
    """The payload bytes of a received frame (an array's; 0 for others)."""
    return int(f.value.nbytes) if isinstance(f.value, np.ndarray) else 0


def _outgoing(y, s: dict):
    """What a ``send`` entry sends of the output y: all of it, its first ``channels`` channels in ``dtype``, or the
    ``slice`` [start, stop) of a flat output (a composed part's wire format per link)."""
    if s.get("slice") is not None:
        return np.ascontiguousarray(y[s["slice"][0]:s["slice"][1]])
    if s["channels"] is None:
        return y
    return np.ascontiguousarray(y[..., :s["channels"]].astype(s["dtype"]))


class _StageRunner:
    """Runs a part (``runtime.Stages``: a plain part is one stage) image after image: stage k waits for what its
    remote inputs send (frames from one source are used in the order they arrive: a sender sends in stage order)
    and until they are released (the links' latency), runs, sleeps ``(stretch - 1) x`` its call time when the
    device is to play a slower one, sends F(y) of its output to every ``send`` destination (the first ``channels``
    channels, in the link's dtype; all of y for ``channels`` None), keeps y as the next stage's carry and, on the
    output device, sends the last stage's output to the coordinator. One timing record per image: c0 = its first
    stage's start, c1 = its last stage's end of compute, ``in`` = each source's last frame, ``frames`` = every frame
    of each source in arrival order (a staged part hears from one source several times per image)."""

    def __init__(self, ctl, part, senders, stretch: float):
        self.ctl, self.part, self.stretch = ctl, part, stretch
        self.links = {link.dst: link for link in senders}
        self.frames, self.image, self.k, self.carry, self.c0, self.host, self.seen = {}, None, 0, None, 0.0, 0.0, {}
        self.heard = {}

    def finished(self, stopped: set) -> bool:
        """No image left: the sources of the first stage (the camera or the stem's device; a plain part's inputs)
        stopped and every image they sent has run all stages."""
        first = [i["from"] for i in self.part.stages[0][1]["inputs"] if i["from"] != "carry"]
        return all(s in stopped for s in first) and self.image is None and not self.frames

    def feed(self, src, fr, release) -> None:
        self.frames.setdefault((fr.image, src), []).append((fr, release))
        while self._step():
            pass

    def _step(self) -> bool:
        if self.image is None:
            waiting = [i for i, _ in self.frames]
            if not waiting:
                return False
            self.image, self.k, self.host, self.seen, self.heard = min(waiting), 0, 0.0, {}, {}
        prog, st = self.part.stages[self.k]
        remote = [i["from"] for i in st["inputs"] if i["from"] != "carry"]
        if any(not self.frames.get((self.image, s)) for s in remote):
            return False
        got = {s: self.frames[(self.image, s)].pop(0) for s in remote}
        for s in remote:
            if not self.frames[(self.image, s)]:
                del self.frames[(self.image, s)]
        self.seen.update(got)
        for s, (f, r) in got.items():
            self.heard.setdefault(s, []).append([f.tx_start, f.tx_end, f.arrival, r, f.rx_mbps, _payload(f)])
        L.sleep_until(max([r for _, r in got.values()], default=0.0))  # every input released (the links' latency)
        xs = [self.carry if i["from"] == "carry" else got[i["from"]][0].value for i in st["inputs"]]
        t0 = L.now()
        if self.k == 0:
            self.c0 = t0
        y = prog(*xs)
        host = L.now() - t0
        self.host += host
        if self.stretch > 1.0:
            L.sleep_until(t0 + host * self.stretch)
        c1 = L.now()
        for s in st["send"]:
            self.links[s["to"]].put((self.image, _outgoing(y, s)))
        if st["result"]:
            self.ctl.send(L.ARRAY, self.image, y)
        self.carry = y if st["carry"] else None
        self.k += 1
        if self.k == len(self.part.stages):
            self.ctl.send(L.JSON, self.image, {
                "done": self.image, "c0": self.c0, "c1": c1, "host_ms": self.host * 1e3,
                "in": {s: [f.tx_start, f.tx_end, f.arrival, r, f.rx_mbps, _payload(f)]
                       for s, (f, r) in self.seen.items()},
                "frames": self.heard})
            self.image = None
        return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jmsnas.deploy.worker")
    p.add_argument("--fd", type=int, required=True, help="the control connection (a connected socket's descriptor)")
    p.add_argument("--port", type=int, default=0, help="data port (default 0: a free one)")
    p.add_argument("--host", default=None, help="data address (default: where the control connection arrived)")
    p.add_argument("--plain-control", action="store_true",
                   help="the control connection is a local socket pair: no TLS on it even with TLS credentials")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    _die_with_parent()
    creds = auth.from_env()
    try:
        sock = socket.socket(fileno=args.fd)
    except OSError as e:
        print(f"jmsnas.deploy.worker: --fd {args.fd} is no connected socket: {e}", file=sys.stderr)
        return 2
    if sock.family in (socket.AF_INET, socket.AF_INET6):  # a small answer leaves at once, not after a delayed ACK
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:  # the control connection was authenticated by the jmsnas worker (or is a local pipeline's socket pair)
        ctl = _Control(sock if args.plain_control else auth.secure_server(sock, creds, authenticated=True))
    except (auth.AuthError, ssl.SSLError, OSError) as e:
        _log(f"the coordinator's TLS handshake failed: {e}")
        return 2
    try:
        _serve(ctl, *_setup(args, ctl, creds))
    except SystemExit as e:
        return int(e.code or 0)
    except Exception as e:  # noqa: BLE001 - a malformed frame or message, a broken link: this session ends
        known = (DeployError, OSError, RuntimeError, L.LinkClosed, ValueError)
        _log(f"session ended: {e}" if isinstance(e, known) else f"session ended: {type(e).__name__}: {e}")
        try:
            ctl.send(L.JSON, value={"error": " ".join(str(e).split()), "cause": "own"})
        except OSError:
            pass
        return 2
    finally:
        _cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
