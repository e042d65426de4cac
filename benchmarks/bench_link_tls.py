"""What authentication and TLS cost a deployment link: per connection (the handshake) and per frame.

    python benchmarks/bench_link_tls.py [--sizes 1024 32768 1048576] [--frames 200] [--reps 5]

Over 127.0.0.1 (one process: a receiver thread, the sender in the main thread), for every frame size: a
connection per mode (``plain``: no secret; ``secret``: the HMAC handshake, then the same plain frames; ``tls``:
the handshake, TLS and the handshake again, ``jmsnas.deploy.auth``), then ``--frames`` ARRAY frames of that many
bytes sent back to back (``links.send_frame``, unpaced) and parsed by the receiver (``links.recv_frame``). The
time per frame is the receiver's time from the first frame's arrival to the last's, over frames - 1; the modes run
in turn, ``--reps`` times (interleaved), and the table gives medians, each mode's ratio to ``plain``, and the
median time to connect and authenticate (20 connections per mode). A certificate for 127.0.0.1 is made with
``openssl``. Prints the load average: the machine may be shared.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "deploy"))

import numpy as np  # noqa: E402

from jmsnas.deploy import auth, links as L  # noqa: E402


def _pair(server, creds: auth.Credentials) -> tuple:
    """(client socket, server socket), both through ``auth``'s handshake (and TLS) for ``creds``."""
    got = {}

    def accept():
        conn = L.accept(server)
        got["conn"] = auth.secure_server(conn, creds)
    t = threading.Thread(target=accept)
    t.start()
    client = auth.secure_client(L.connect(server.getsockname()[1]), creds, "127.0.0.1")
    t.join()
    return client, got["conn"]


def per_frame_s(server, creds, size: int, frames: int) -> float:
    client, conn = _pair(server, creds)
    times = []

    def receive():
        for _ in range(frames):
            times.append(L.recv_frame(conn).arrival)
    t = threading.Thread(target=receive)
    t.start()
    x = np.zeros(size, np.uint8)
    for i in range(frames):
        L.send_frame(client, L.ARRAY, i, x)
    t.join()
    client.close(), conn.close()
    return (times[-1] - times[0]) / (frames - 1)


def connect_s(server, creds, n: int = 20) -> float:
    out = []
    for _ in range(n):
        t0 = L.now()
        client, conn = _pair(server, creds)
        out.append(L.now() - t0)
        client.close(), conn.close()
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 32768, 1048576])
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    from certs import make_tls
    tls = make_tls(tempfile.mkdtemp(prefix="bench_tls_"))
    secret = auth.generated().secret
    modes = {"plain": auth.NONE, "secret": auth.Credentials(secret),
             "tls": auth.Credentials(secret, tls["cert"], tls["key"], tls["ca"])}
    server = L.listen(0)
    load0 = os.getloadavg()[0]
    res = {(m, s): [] for m in modes for s in args.sizes}
    for _ in range(args.reps):
        for s in args.sizes:
            for m, creds in modes.items():
                res[(m, s)].append(per_frame_s(server, creds, s, args.frames))
    conn = {m: connect_s(server, creds) for m, creds in modes.items()}
    server.close()
    print(f"load average {load0:.1f} -> {os.getloadavg()[0]:.1f}; {args.frames} frames x {args.reps} reps, medians")
    print("| frame payload | mode | per frame (us) | / plain | MB/s | connect + handshake (ms) |")
    print("|---|---|---|---|---|---|")
    for s in args.sizes:
        base = statistics.median(res[("plain", s)])
        for m in modes:
            t = statistics.median(res[(m, s)])
            print(f"| {s} B | {m} | {t * 1e6:.1f} | {t / base:.2f} | {s / t / 1e6:.0f} | {conn[m] * 1e3:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
