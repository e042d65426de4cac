"""Timing exported programs on another machine: ``python -m jmsnas.deploy.timer --listen HOST:PORT`` there, and
``time_programs("HOST:PORT", programs)`` here (``jmsnas measure --remote``).

The server imports only the standard library, numpy, jax and ``links``. Per connection it answers requests until
the client sends STOP or goes away. A request is a JSON frame ``{"time": {"reps": R, "warmup": W}}`` followed by
an ARRAY frame (uint8) holding a serialised ``jax.export`` program; the server deserialises it, calls it once on
zeros of its input shapes (compiling it), W more times untimed, then R timed calls, each after an untimed one
(warm caches, as in repeated inference), and replies ``{"ms": [R host times in ms]}`` or ``{"error": one line}``.
"""
from __future__ import annotations

import argparse
import socket
import sys
import time

import numpy as np

from jmsnas.deploy import links as L


def parse_address(text: str) -> tuple:
    """(host, port) from 'HOST:PORT'; ValueError naming the text otherwise."""
    host, sep, port = str(text).strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"remote address must be HOST:PORT with a port 0-65535, got {text!r}")
    return host.strip("[]"), int(port)


def _time(blob: bytes, reps: int, warmup: int) -> list:
    import jax
    from jax import export
    prog = export.deserialize(bytearray(blob))
    args = [np.zeros(a.shape, a.dtype) for a in prog.in_avals]
    call = jax.jit(prog.call)
    for _ in range(warmup + 1):
        jax.block_until_ready(call(*args))
    out = []
    for _ in range(reps):
        jax.block_until_ready(call(*args))
        t0 = time.perf_counter()
        jax.block_until_ready(call(*args))
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _session(conn: socket.socket) -> None:
    while True:
        try:
            f = L.recv_frame(conn)
        except (L.LinkClosed, ConnectionError, OSError):
            return
        if f.kind == L.STOP:
            return
        req = f.value.get("time") if f.kind == L.JSON and isinstance(f.value, dict) else None
        if not isinstance(req, dict):
            L.send_frame(conn, L.JSON, -1, {"error": f"expected a {{'time': ...}} request, got kind {f.kind}"})
            return
        blob = L.recv_frame(conn)
        try:
            reps, warmup = int(req.get("reps", 20)), int(req.get("warmup", 2))
            if not 1 <= reps <= 10000 or not 0 <= warmup <= 1000:
                raise ValueError(f"reps must be 1-10000 and warmup 0-1000, got {reps}, {warmup}")
            L.send_frame(conn, L.JSON, -1, {"ms": _time(bytes(np.asarray(blob.value, np.uint8)), reps, warmup)})
        except Exception as e:  # noqa: BLE001 - any failure of the program is the client's one-line answer
            L.send_frame(conn, L.JSON, -1, {"error": " ".join(f"{type(e).__name__}: {e}".split())[:500]})


def serve(host: str, port: int, *, announce=print, sessions: int | None = None) -> int:
    try:
        server = socket.create_server((host, port))
    except OSError as e:
        print(f"jmsnas timer: error: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return 2
    announce(f"jmsnas timer listening on {host}:{server.getsockname()[1]}", flush=True)
    done = 0
    while sessions is None or done < sessions:
        conn, _ = server.accept()
        with conn:
            _session(conn)
        done += 1
    server.close()
    return 0


def time_programs(address: str, programs, *, reps: int = 20, warmup: int = 2, timeout_s: float = 600.0) -> list:
    """Median ms of each serialised program (bytes) on the timer at ``address``; ValueError (one line) when the
    timer cannot be reached or reports an error."""
    host, port = parse_address(address)
    try:
        conn = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as e:
        raise ValueError(f"cannot reach the timer at {address}: {e.strerror or e}") from None
    out = []
    with conn:
        for blob in programs:
            L.send_frame(conn, L.JSON, -1, {"time": {"reps": reps, "warmup": warmup}})
            L.send_frame(conn, L.ARRAY, -1, np.frombuffer(blob, np.uint8))
            reply = L.recv_frame(conn).value
            if "error" in reply:
                raise ValueError(f"the timer at {address} failed: {reply['error']}")
            out.append(float(np.median(reply["ms"])))
        L.send_frame(conn, L.STOP)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jmsnas.deploy.timer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", required=True, help="HOST:PORT to accept clients on")
    args = ap.parse_args(argv)
    try:
        host, port = parse_address(args.listen)
    except ValueError as e:
        print(f"jmsnas timer: error: {e}", file=sys.stderr)
        return 2
    return serve(host, port)


if __name__ == "__main__":
    sys.exit(main())
