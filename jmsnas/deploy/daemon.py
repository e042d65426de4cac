"""``jmsnas worker --listen HOST:PORT``: the long-running process on a machine that plays a device of a pipeline.

It imports only the standard library and ``links``. It listens on HOST:PORT; every connection a coordinator makes
(``jmsnas pipeline --hosts FILE``, or anything speaking the control protocol of ``jmsnas.deploy.worker``) becomes one
session: a child process ``python -m jmsnas.deploy.worker --fd N`` that receives the accepted socket, the part's
files over it and plays that device until the coordinator stops it or goes away. A session starts only once the
coordinator has sent its first bytes: a connection that closes before (a coordinator that could not reach another
device's worker and gave up) starts nothing. Sessions end with their control connection and die with this process
(PR_SET_PDEATHSIG); SIGTERM/SIGINT end this process after its sessions.
"""
from __future__ import annotations

import errno
import os
import select
import signal
import socket
import subprocess
import sys
import threading

from jmsnas.deploy import links as L


def parse_address(text: str, what: str = "address") -> tuple:
    """(host, port) from 'HOST:PORT' (port 0-65535); ValueError naming the text otherwise."""
    host, sep, port = str(text).strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{what} must be HOST:PORT with a port 0-65535, got {text!r}")
    return host.strip("[]"), int(port)


def serve(host: str, port: int, *, announce=print, sessions: int | None = None) -> int:
    """Accepts coordinators on host:port and starts a session per connection; returns an exit code (2: cannot
    listen). ``sessions``: stop after that many (None: run until signalled)."""
    try:
        server = L.listen(port, host)
    except OSError as e:
        why = "the port is in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        print(f"jmsnas worker: error: cannot listen on {host}:{port}: {why}", file=sys.stderr)
        return 2
    children: list = []
    lock = threading.Lock()

    def start_session(conn) -> None:
        """Waits for the coordinator's first bytes (at most an hour), then hands the connection to a session."""
        try:
            ready, _, _ = select.select([conn], [], [], 3600.0)
            if not ready or not conn.recv(1, socket.MSG_PEEK):
                return  # closed (or silent) before a word: no session
            with lock:
                cmd = [sys.executable, "-m", "jmsnas.deploy.worker", "--fd", str(conn.fileno())]
                children.append(subprocess.Popen(cmd, pass_fds=(conn.fileno(),), stdin=subprocess.DEVNULL))
        except OSError:
            pass
        finally:
            conn.close()

    def stop(signum, _frame):
        for c in list(children):
            if c.poll() is None:
                c.terminate()
        for c in list(children):
            try:
                c.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                c.kill()
        server.close()
        os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    announce(f"jmsnas worker listening on {host}:{server.getsockname()[1]} (pid {os.getpid()})")
    started = 0
    server.settimeout(0.2)  # wake up to reap ended sessions, so none lingers as a zombie
    waiting = []
    while sessions is None or started < sessions:
        with lock:
            children[:] = [c for c in children if c.poll() is None]
        try:
            conn = L.accept(server)
        except TimeoutError:
            continue
        conn.setblocking(True)  # the session reads it blocking
        waiting.append(threading.Thread(target=start_session, args=(conn,), daemon=True))
        waiting[-1].start()
        started += 1
    for t in waiting:
        t.join()
    for c in list(children):
        c.wait()
    server.close()
    return 0


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="jmsnas worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", required=True, help="HOST:PORT to accept coordinators on")
    args = p.parse_args(argv)
    try:
        host, port = parse_address(args.listen, "--listen")
    except ValueError as e:
        print(f"jmsnas worker: error: {e}", file=sys.stderr)
        return 2
    return serve(host, port, announce=lambda s: print(s, flush=True))


if __name__ == "__main__":
    sys.exit(main())
