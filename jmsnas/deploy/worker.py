"""One device of the pipeline as its own OS process: ``python -m jmsnas.deploy.worker --export DIR --device NAME
--control PORT [--port P]``. Imports only the standard library, numpy, jax and the two jax+numpy modules
``runtime`` and ``links``.

Life of a worker (the coordinator is ``jmsnas.deploy.pipeline``):

1. connects to the coordinator's control port and names itself (``{"device": name}``); loads and checks its part
   (``runtime.load_part``); listens on its data port; compiles the part and sends ``{"hello": device, "port",
   "pid"}``; answers ``{"calibrate": n}`` with ``{"calib_ms"}``, the median host time of n calls on zeros (ms;
   the coordinator asks one device at a time, while the others wait);
2. receives ``{"peers": {device: port}, "stretch", "out": {dst: [Mbit/s, ms]}, "in": {src: ms}}``, connects to
   the devices its output goes to, accepts one connection per input and answers ``{"ready": true}``;
3. for every image (one thread reads all inputs through a selector): waits until the message of every input is
   released (the link's latency after the sender's end of transmission), runs the part, sleeps ``(stretch - 1)
   x`` the measured call time when the device is to play a slower one, starts the transmission on every idle
   outgoing link (a paced sender thread per link finishes it; ``_Link``), or sends the output back to the
   coordinator, unthrottled, on the last device, and reports ``{"done": image, "c0", "c1", "host_ms", "in":
   {src: [tx_start, tx_end, arrival, release]}}`` (CLOCK_MONOTONIC seconds);
4. on STOP from every input forwards STOP, waits for its senders, sends ``{"bye": true}`` and exits 0.

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
import signal
import statistics
import sys
import threading

import numpy as np

from jmsnas.deploy import links as L
from jmsnas.deploy.runtime import DeployError, load_part

class _Control:
    """The control connection; sends are serialised by a lock (the main and sender threads share it)."""

    def __init__(self, sock):
        self.sock, self.lock = sock, threading.Lock()

    def send(self, kind, image=-1, value=None):
        with self.lock:
            L.send_frame(self.sock, kind, image, value)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _calibrate(part, calls: int) -> float:
    """Median host time of one call of the part (ms), after a first call that compiles it."""
    xs = [np.zeros(i["shape"], i["dtype"]) for i in part.inputs]
    part(*xs)
    times = []
    for _ in range(calls):
        t0 = L.now()
        part(*xs)
        times.append(L.now() - t0)
    return statistics.median(times) * 1e3


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
        os._exit(3)


def _setup(args, ctl: _Control):
    part = load_part(args.export, args.device)
    try:
        server = L.listen(args.port)
    except OSError as e:
        raise DeployError(f"device {args.device!r} cannot listen on 127.0.0.1:{args.port}: "
                          f"{'the port is in use' if e.errno == errno.EADDRINUSE else e.strerror}") from None
    _calibrate(part, 1)  # compile before reporting
    ctl.send(L.JSON, value={"hello": args.device, "port": server.getsockname()[1], "pid": os.getpid()})
    msg = L.recv_frame(ctl.sock).value
    while "calibrate" in msg:  # one device at a time, while the others wait: the host time in isolation
        ctl.send(L.JSON, value={"calib_ms": _calibrate(part, int(msg["calibrate"]))})
        msg = L.recv_frame(ctl.sock).value
    outs = {}
    for dst in [d for d in msg["to"] if d != "result"]:
        s = L.connect(msg["peers"][dst])
        L.send_frame(s, L.JSON, value={"from": args.device})
        outs[dst] = (s, L.Pace(*msg["out"][dst]))
    ins = {}
    for _ in part.inputs:
        conn = L.accept(server)
        src = L.recv_frame(conn).value["from"]
        ins[src] = conn
    server.close()
    return part, msg, outs, ins


def _serve(args, ctl: _Control, part, msg, outs, ins) -> None:
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
    ctl.send(L.JSON, value={"ready": True})
    order = [i["from"] for i in part.inputs]
    pending, stopped = {}, set()
    while len(stopped) < len(order):
        if not errors.empty():
            raise RuntimeError(errors.get()[1])
        for key, _ in sel.select(timeout=1.0):
            src, buf = key.data
            try:
                data = key.fileobj.recv(1 << 20)
                if not data:
                    raise L.LinkClosed("connection closed by the peer")
                frames = buf.feed(data)
            except (OSError, L.LinkClosed) as e:
                ctl.send(L.JSON, value={"error": f"device {args.device!r}: the input link from {src!r} closed "
                                                 f"({e})", "cause": "upstream"})
                sys.exit(2)
            for fr in frames:
                if fr.kind == L.STOP:
                    stopped.add(src)
                    sel.unregister(key.fileobj)
                    break
                slot = pending.setdefault(fr.image, {})
                slot[src] = (fr, L.release_time(fr, msg["in"].get(src, 0.0)))
                if len(slot) == len(order):
                    del pending[fr.image]
                    _compute(ctl, part, order, slot, fr.image, float(msg["stretch"]), senders,
                             "result" in msg["to"])
    for link in senders:
        link.put(None)
    for link in senders:
        link.thread.join()
    if not errors.empty():
        raise RuntimeError(errors.get()[1])
    ctl.send(L.JSON, value={"bye": True})


def _compute(ctl: _Control, part, order, slot, image: int, stretch: float, senders, to_result: bool) -> None:
    """Runs the part on the released inputs of ``image``, stretched to ``stretch`` x its time, passes it on and
    reports the timing record."""
    L.sleep_until(max(r for _, r in slot.values()))  # every input released (the links' latency)
    xs = [slot[s][0].value for s in order]
    c0 = L.now()
    y = part(*xs)
    host = L.now() - c0
    if stretch > 1.0:
        L.sleep_until(c0 + host * stretch)
    c1 = L.now()
    for link in senders:
        link.put((image, y))
    if to_result:
        ctl.send(L.ARRAY, image, y)
    ctl.send(L.JSON, image, {"done": image, "c0": c0, "c1": c1, "host_ms": host * 1e3,
                             "in": {s: [f.tx_start, f.tx_end, f.arrival, r] for s, (f, r) in slot.items()}})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jmsnas.deploy.worker")
    p.add_argument("--export", required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--control", type=int, required=True)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    _die_with_parent()
    try:
        ctl = _Control(L.connect(args.control))
    except OSError as e:
        print(f"device {args.device!r}: cannot reach the coordinator on port {args.control}: {e}", file=sys.stderr)
        return 2
    try:
        ctl.send(L.JSON, value={"device": args.device})
        state = _setup(args, ctl)
        _serve(args, ctl, *state)
    except (DeployError, RuntimeError, OSError, L.LinkClosed) as e:
        try:
            ctl.send(L.JSON, value={"error": " ".join(str(e).split()), "cause": "own"})
        except OSError:
            pass
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
