"""Framed messages over TCP with user-space pacing of a link to its bandwidth (Mbit/s) and latency (ms).

Frame (little-endian): ``header | payload | trailer``.

* header: magic ``b"JMSN"``, kind (u8: ARRAY, JSON, STOP), image id (i64), dtype code (u8), ndim (u8), the shape
  (ndim x u32), payload length (u64);
* payload: the array's bytes (C order) or UTF-8 JSON;
* trailer: the sender's CLOCK_MONOTONIC times (f64 seconds) when it began and finished transmitting the payload.

Pacing (``send_frame`` with a ``Pace``): the payload goes out in chunks of about ``CHUNK_S`` of link time; after
each chunk the sender sleeps until ``t_start + bytes_sent * 8 / bandwidth``, an absolute target, so sleep overshoot
does not accumulate; the transmission of n bytes therefore takes n * 8 / bandwidth (the payload is paced; the
32-byte header and the trailer are framing). The link's fixed latency is applied by the receiver
(``release_time``): a message is released ``latency`` after the sender's recorded end of transmission (mapped
onto the receiver's clock with the two clocks' estimated offsets, ``jmsnas.deploy.clock``), so a latency does not
occupy the sender and back-to-back messages overlap on the link as on a real one. Without a ``Pace`` (kernel-shaped
links: ``tc`` does the pacing) the payload goes out at once and the network sets the rate.

The receiver measures every frame's rate by itself (``FrameBuffer``; no clock of the sender involved): the slope
of the payload bytes arrived over time (``payload_rate``, ``Frame.rx_mbps``, Mbit/s of payload). Bytes on the wire add every TCP segment's headers: ``wire_bytes`` with the
connection's MSS and header bytes (``framing``; Ethernet framing assumed), the unit a kernel shaper (tbf, htb) counts.
"""
from __future__ import annotations

import json
import math
import socket
import ssl
import struct
import time
from typing import NamedTuple

import numpy as np

from jmsnas.deploy.auth import SerialTLS

MAGIC = b"JMSN"
ARRAY, JSON, STOP = 0, 1, 2
_HEAD = struct.Struct("<4sBqBB")
_LEN = struct.Struct("<Q")
_TRAILER = struct.Struct("<dd")
DTYPES = ("float32", "float64", "int32", "uint8", "float16")
MAX_PAYLOAD = 1 << 31  # bytes a frame may declare (2 GiB: a part's weights); larger is refused unread
MAX_JSON = 64 << 20  # bytes of a JSON frame
MAX_NDIM = 16
_STEP = 1 << 22  # a frame's bytes are read in steps of at most 4 MiB: a declared size is not allocated up front
CHUNK_S = 0.0005  # link time per paced chunk (s)


def now() -> float:
    """Seconds on this host's CLOCK_MONOTONIC (another host's clock has another origin: ``jmsnas.deploy.clock``)."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


class LinkClosed(ConnectionError):
    """The peer closed the connection (or sent something that is not a frame)."""


class Pace(NamedTuple):
    """A link's throttle: bandwidth in Mbit/s (None: unthrottled) and latency in ms."""

    bandwidth_mbps: float | None = None
    latency_ms: float = 0.0


class Frame(NamedTuple):
    """A received message: kind, image id, value (array / JSON object / None), sender's transmission start
    and end (the sender's clock), the receiver's arrival time of the trailer (its clock; seconds), and the payload
    rate the receiver saw (``payload_rate``, Mbit/s; NaN when the payload arrived in fewer than three pieces)."""

    kind: int
    image: int
    value: object
    tx_start: float
    tx_end: float
    arrival: float
    rx_mbps: float = float("nan")


def sleep_until(t: float) -> None:
    while True:
        dt = t - now()
        if dt <= 0:
            return
        time.sleep(dt)


TLS_RECORD = 4096  # payload bytes per TLS record: a receiver sees a record whole, and measures its rate by them


def _sendall(sock, data) -> None:
    """sendall; over TLS in records of ``TLS_RECORD`` bytes (22 more each, 0.5%), so that the receiver's payload
    rate (``payload_rate``) gets a sample per record, not one per 16 KiB (the most a record holds)."""
    if isinstance(sock, (ssl.SSLSocket, SerialTLS)) and len(data) > TLS_RECORD:
        for i in range(0, len(data), TLS_RECORD):
            sock.sendall(data[i:i + TLS_RECORD])
    else:
        sock.sendall(data)


def _chunk(rate: float) -> int:
    return max(256, int(rate * CHUNK_S))


def _encode(kind: int, image: int, value) -> tuple:
    """(header bytes with the payload length, payload memoryview) of a frame."""
    if kind == ARRAY:
        arr = np.ascontiguousarray(value)
        if str(arr.dtype) not in DTYPES:
            raise TypeError(f"cannot send dtype {arr.dtype}; expected one of {DTYPES}")
        payload = memoryview(arr).cast("B") if arr.size else memoryview(b"")  # an empty frame: a trigger
        head = _HEAD.pack(MAGIC, kind, image, DTYPES.index(str(arr.dtype)), arr.ndim)
        head += struct.pack(f"<{arr.ndim}I", *arr.shape)
    else:
        payload = memoryview(json.dumps(value).encode() if kind == JSON else b"")
        head = _HEAD.pack(MAGIC, kind, image, 0, 0)
    return head + _LEN.pack(len(payload)), payload


def send_frame(sock: socket.socket, kind: int, image: int = -1, value=None, pace: Pace = Pace()) -> tuple:
    """Sends one frame, the payload paced to ``pace.bandwidth_mbps``; returns (tx_start, tx_end)."""
    return finish_frame(sock, *start_frame(sock, kind, image, value, pace), pace if kind == ARRAY else Pace())


def start_frame(sock: socket.socket, kind: int, image: int = -1, value=None, pace: Pace = Pace()) -> tuple:
    """Sends a frame's header and the first paced chunk of its payload; returns (payload, t0, bytes sent) for
    ``finish_frame``, which another thread may call (a device starts a transmission the moment its output is
    ready and leaves the rest of the link time to its sender thread)."""
    head, payload = _encode(kind, image, value)
    sock.sendall(head)
    t0 = now()
    bw = pace.bandwidth_mbps if kind == ARRAY else None
    first = min(len(payload), _chunk(bw * 1e6 / 8.0)) if bw else 0
    if first:
        _sendall(sock, payload[:first])
    return payload, t0, first


def finish_frame(sock: socket.socket, payload, t0: float, sent: int, pace: Pace = Pace()) -> tuple:
    """Sends the rest of a frame begun by ``start_frame`` and the trailer; (tx_start, tx_end). Paced: byte k goes
    out at t0 + k * 8 / bandwidth, an absolute schedule; unpaced (no bandwidth): at once."""
    if not pace.bandwidth_mbps:
        _sendall(sock, payload[sent:])
    else:
        rate = pace.bandwidth_mbps * 1e6 / 8.0  # bytes per second
        while True:
            sleep_until(t0 + sent / rate)
            if sent >= len(payload):
                break
            part = payload[sent:sent + _chunk(rate)]
            _sendall(sock, part)
            sent += len(part)
    t1 = now()
    sock.sendall(_TRAILER.pack(t0, t1))
    return t0, t1


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    """n bytes, the buffer grown as they arrive (a peer that declares much and sends little costs little)."""
    buf = bytearray(min(n, _STEP))
    got = 0
    while got < n:
        if got == len(buf):
            buf.extend(bytes(min(n - got, len(buf))))  # at most doubles what has arrived
        k = sock.recv_into(memoryview(buf)[got:], len(buf) - got)
        if k == 0:
            raise LinkClosed("connection closed by the peer")
        got += k
    return buf


def _parse(b, rate=None):
    """(Frame, its length) of the frame at the start of buffer ``b``, or the number of bytes it needs to be
    complete (an int); ``rate(start, length)`` gives the payload rate. LinkClosed for bytes that are no frame."""
    if len(b) < _HEAD.size:
        return _HEAD.size
    magic, kind, image, code, ndim = _HEAD.unpack_from(b, 0)
    if magic != MAGIC or kind not in (ARRAY, JSON, STOP) or code >= len(DTYPES):
        raise LinkClosed("received bytes that are not a jmsnas frame")
    at = _HEAD.size + 4 * ndim
    if len(b) < at + _LEN.size:
        return at + _LEN.size
    if ndim > MAX_NDIM:
        raise LinkClosed(f"received a frame of {ndim} dimensions (at most {MAX_NDIM})")
    shape = struct.unpack_from(f"<{ndim}I", b, _HEAD.size) if ndim else ()
    (length,) = _LEN.unpack_from(b, at)
    at += _LEN.size
    _check_length(kind, code, shape, length)
    end = at + length + _TRAILER.size
    if len(b) < end:
        return end
    t0, t1 = _TRAILER.unpack_from(b, at + length)
    try:
        value = _decode(kind, code, shape, bytes(b[at:at + length]))
    except ValueError as e:  # JSON or UTF-8 that does not parse
        raise LinkClosed(f"received a frame whose payload does not parse ({' '.join(str(e).split())[:120]})"
                         ) from None
    return Frame(kind, image, value, t0, t1, now(), float("nan") if rate is None else rate(at, length)), end


def _check_length(kind: int, code: int, shape: tuple, length: int) -> None:
    """LinkClosed for a declared payload length over the caps or not what the array's shape and dtype make."""
    cap = MAX_JSON if kind == JSON else MAX_PAYLOAD if kind == ARRAY else 0
    if length > cap:
        raise LinkClosed(f"received a frame declaring {length} payload bytes (at most {cap} for its kind)")
    if kind == ARRAY:
        want = math.prod(shape) * np.dtype(DTYPES[code]).itemsize
        if want != length:
            raise LinkClosed(f"received an array frame of shape {list(shape)} {DTYPES[code]} declaring "
                             f"{length} payload bytes, not {want}")


def recv_frame(sock: socket.socket) -> Frame:
    """Reads one frame (blocking); LinkClosed on EOF or a malformed frame."""
    buf = bytearray()
    got = _HEAD.size
    while isinstance(got, int):
        buf += _recv_exact(sock, got - len(buf))
        got = _parse(buf)
    return got[0]


class FrameBuffer:
    """Incremental frame parsing for a non-blocking reader: ``feed(bytes)`` returns the frames it completes (their
    arrival time is when their last byte was fed). Lets one thread serve several connections without blocking on
    a frame that is still being paced over the link."""

    def __init__(self):
        self.buf = bytearray()
        self.samples = []  # (arrival time, bytes of the buffer then) since the current frame began

    def feed(self, data: bytes) -> list:
        self.buf += data
        self.samples.append((now(), len(self.buf)))
        frames = []
        while True:
            got = _parse(self.buf, lambda at, n: payload_rate(self.samples, at, n))
            if isinstance(got, int):
                return frames
            fr, end = got
            del self.buf[:end]
            self.samples = [(t, n - end) for t, n in self.samples if n > end]
            frames.append(fr)


def payload_rate(samples, start: int, length: int) -> float:
    """Mbit/s of a payload at stream offsets [start, start + length) from (time, bytes arrived by then) samples:
    the least-squares slope of bytes over time through the samples that hold payload (a shaper's initial burst is
    one sample among many, and one late wake-up of the receiver moves the slope little); NaN with fewer than
    three such samples."""
    pts = [(t, min(n, start + length)) for t, n in samples if n > start]
    pts = pts[:next((i + 1 for i, p in enumerate(pts) if p[1] >= start + length), len(pts))]
    if len(pts) < 3:
        return float("nan")
    t = np.array([p[0] for p in pts]) - pts[0][0]
    n = np.array([p[1] for p in pts], dtype=float)
    var = float(np.sum((t - t.mean()) ** 2))
    if var <= 0:
        return float("nan")
    return float(np.sum((t - t.mean()) * (n - n.mean())) / var) * 8.0 / 1e6


def framing(sock: socket.socket) -> tuple:
    """(MSS, header bytes) of a connected TCP socket: payload bytes per full segment (TCP_MAXSEG) and the IP + TCP
    header bytes each segment adds (20 or 40 for IPv4 / IPv6, 20 TCP, 12 more when the connection uses TCP
    timestamps, TCP_INFO's options)."""
    mss = int(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG))
    info = sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_INFO", 11), 8)
    timestamps = bool(info[5] & 1)  # struct tcp_info: u8 state, ca_state, retransmits, probes, backoff, options
    ip = 40 if sock.family == socket.AF_INET6 else 20
    return mss, ip + 20 + (12 if timestamps else 0)


ETHERNET_HEADER = 14  # bytes a kernel shaper on an Ethernet (veth) device counts per packet beyond the IP packet


def wire_bytes(payload: int, mss: int, header: int) -> int:
    """Bytes on the wire for ``payload`` bytes of a TCP stream in full segments of ``mss``: every segment adds its
    IP and TCP headers (``header``, from ``framing``) and the Ethernet header."""
    segments = -(-int(payload) // int(mss))
    return int(payload) + segments * (int(header) + ETHERNET_HEADER)


def _decode(kind: int, code: int, shape: tuple, payload):
    if kind == ARRAY:
        return np.frombuffer(payload, dtype=DTYPES[code]).reshape(shape)
    if kind == JSON:
        return json.loads(bytes(payload).decode())
    return None


def release_time(frame: Frame, latency_ms: float, shift_s: float = 0.0) -> float:
    """When a message becomes available at the receiver (its clock): the sender's end of transmission, moved onto
    the receiver's clock by ``shift_s`` (receiver clock - sender clock), plus the latency; never before it arrived."""
    return max(frame.arrival, frame.tx_end + shift_s + latency_ms / 1e3)


def connect(addr, timeout_s: float = 10.0, retry: bool = True) -> socket.socket:
    """A TCP connection to ``addr`` (a port on 127.0.0.1 or (host, port)); with ``retry`` a refused connection is
    tried again until ``timeout_s`` (the peer may still be starting), else the first refusal raises."""
    host, port = ("127.0.0.1", int(addr)) if isinstance(addr, int) else (str(addr[0]), int(addr[1]))
    deadline = now() + timeout_s
    while True:
        try:
            s = socket.create_connection((host, port), timeout=timeout_s)
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s
        except OSError:
            if not retry or now() > deadline:
                raise
            time.sleep(0.02)


def listen(port: int = 0, host: str = "127.0.0.1") -> socket.socket:
    """A listening socket on host:port (0: any free port); OSError (EADDRINUSE) if the port is taken."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free; a listener is not
    s.bind((host, port))
    s.listen(16)
    return s


def accept(server: socket.socket) -> socket.socket:
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn
