"""Several machines on one Linux host: a network namespace per device, each at its own IPv4 address, joined by veth
pairs to one bridge, every link shaped by the kernel (root and iproute2 needed).

    lab = netlab.create(["ue", "sbs", "cloud"], {("ue", "sbs"): 8.0, ("sbs", "cloud"): 16.0})
    proc = netlab.spawn(lab, "sbs", [sys.executable, "-m", "jmsnas.deploy.daemon", "--listen", f"{ip}:7000"])
    ...
    netlab.destroy(lab)                      # ends what spawn started, deletes the namespaces and the bridge

The process that calls ``create`` stays in its own namespace and reaches every device at ``lab.addresses[d]``
through the bridge (a coordinator's control connections, unshaped). A link src -> dst is shaped on src's veth:
an htb root classifies by destination address (``u32 match ip dst``), the link's class holds a ``tbf`` at the
link's rate (Mbit/s; bytes on the wire, Ethernet header included; burst 3000 bytes, so TSO/GSO super-packets are
cut to segments and the rate holds on a millisecond scale) and, for a latency, a ``netem delay`` below it;
everything else (control traffic, ACKs) goes through an unlimited class. TCP's slow start after idle is off in
every namespace, so a link that rests between images starts again at its rate. ``available()`` says why a lab
cannot be made here (None if it can).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from typing import NamedTuple

BURST_BYTES = 3000  # tbf bucket: two full Ethernet frames


class Lab(NamedTuple):
    """A made lab: namespace and address per device, the bridge and its address, the veth inside each namespace,
    the shaped links {(src, dst): [Mbit/s, latency ms, tc class id]} and the processes ``spawn`` started."""

    tag: str
    namespaces: dict
    addresses: dict
    bridge: str
    bridge_address: str
    interfaces: dict
    links: dict
    procs: list


def _run(*cmd, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {(out.stderr or out.stdout).strip()}")
    return out


def available() -> str | None:
    """None if namespaces, veth pairs, a bridge and tc can be used here; otherwise the reason."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command (iproute2) is not installed"
    name = f"jmsnas-probe-{os.getpid()}"
    out = _run("ip", "netns", "add", name, check=False)
    if out.returncode != 0:
        return f"ip netns add failed: {out.stderr.strip()}"
    _run("ip", "netns", "del", name, check=False)
    return None


def _free_subnet() -> str:
    """'10.29.K' for a /24 no interface of this host uses (K from the process id, then the next free one)."""
    used = _run("ip", "-o", "-4", "addr", "show").stdout
    for k in range(250):
        prefix = f"10.29.{(os.getpid() + k) % 250}"
        if f" {prefix}." not in used:
            return prefix
    raise RuntimeError("no free 10.29.K.0/24 subnet for the lab")


def _free_tag() -> str:
    """A tag no interface or namespace of this host uses: the process id, then the next free number. A lab this
    process destroyed a moment ago may still hold its names (the kernel frees a deleted namespace's veths later)."""
    links = _run("ip", "-o", "link", "show").stdout
    spaces = set(_run("ip", "netns", "list").stdout.split())
    for k in range(100000):
        tag = f"{(os.getpid() + k) % 100000}"
        if f" j{tag}" not in links and not any(s.startswith(f"jmsnas-{tag}-") for s in spaces):
            return tag
    raise RuntimeError("no free interface tag for the lab")


def _names(tag: str, i: int) -> tuple:
    """Device ``i``'s namespace, its veth inside the namespace and the veth's peer on the bridge, in lab ``tag``."""
    return f"jmsnas-{tag}-{i}", f"j{tag}d{i}", f"j{tag}p{i}"


def create(devices, links: dict, latencies_ms: dict | None = None) -> Lab:
    """Namespaces for ``devices`` on a bridge, links {(src, dst): Mbit/s} shaped on src's egress (``latencies_ms``
    {(src, dst): ms} adds a netem delay). Everything made is removed again if a step fails."""
    reason = available()
    if reason:
        raise RuntimeError(reason)
    tag = _free_tag()
    prefix = _free_subnet()
    lab = Lab(tag, {}, {}, f"j{tag}br", f"{prefix}.254", {}, {}, [])
    try:
        _run("ip", "link", "add", lab.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{lab.bridge_address}/24", "dev", lab.bridge)
        _run("ip", "link", "set", lab.bridge, "up")
        for i, d in enumerate(devices):
            ns, inside, outside = _names(tag, i)
            _run("ip", "netns", "add", ns)
            lab.namespaces[d], lab.addresses[d], lab.interfaces[d] = ns, f"{prefix}.{i + 1}", inside
            _run("ip", "link", "add", inside, "type", "veth", "peer", "name", outside)
            _run("ip", "link", "set", outside, "master", lab.bridge)
            _run("ip", "link", "set", outside, "up")
            _run("ip", "link", "set", inside, "netns", ns)
            _run("ip", "-n", ns, "addr", "add", f"{lab.addresses[d]}/24", "dev", inside)
            _run("ip", "-n", ns, "link", "set", inside, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "netns", "exec", ns, "sh", "-c", "echo 0 > /proc/sys/net/ipv4/tcp_slow_start_after_idle")
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inside, "root", "handle", "1:", "htb",
                 "default", "1")
            _run("ip", "netns", "exec", ns, "tc", "class", "add", "dev", inside, "parent", "1:", "classid", "1:1",
                 "htb", "rate", "10gbit", "quantum", "60000")
        for k, ((src, dst), mbps) in enumerate(links.items()):
            cls = 10 + k
            ns, dev = lab.namespaces[src], lab.interfaces[src]
            tc = ("ip", "netns", "exec", ns, "tc")
            _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", f"1:{cls}", "htb", "rate", "10gbit",
                 "quantum", "60000")
            _run(*tc, "qdisc", "add", "dev", dev, "parent", f"1:{cls}", "handle", f"{cls}:", "tbf", "rate",
                 f"{float(mbps)}mbit", "burst", str(BURST_BYTES), "latency", "200ms")
            lat = float((latencies_ms or {}).get((src, dst), 0.0))
            if lat > 0:
                _run(*tc, "qdisc", "add", "dev", dev, "parent", f"{cls}:1", "handle", f"{cls + 100}:", "netem",
                     "delay", f"{lat}ms", "limit", "10000")
            _run(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match",
                 "ip", "dst", f"{lab.addresses[dst]}/32", "flowid", f"1:{cls}")
            lab.links[(src, dst)] = [float(mbps), lat, cls]
    except Exception:
        destroy(lab)
        raise
    return lab


def set_rate(lab: Lab, src: str, dst: str, mbps: float) -> None:
    """Changes the shaped rate of link src -> dst (Mbit/s)."""
    _, lat, cls = lab.links[(src, dst)]
    _run("ip", "netns", "exec", lab.namespaces[src], "tc", "qdisc", "change", "dev", lab.interfaces[src], "parent",
         f"1:{cls}", "handle", f"{cls}:", "tbf", "rate", f"{float(mbps)}mbit", "burst", str(BURST_BYTES), "latency",
         "200ms")
    lab.links[(src, dst)][0] = float(mbps)


def spawn(lab: Lab, device: str, argv, **popen) -> subprocess.Popen:
    """Starts ``argv`` inside ``device``'s namespace (ended by ``destroy``)."""
    proc = subprocess.Popen(["ip", "netns", "exec", lab.namespaces[device], *argv], **popen)
    lab.procs.append(proc)
    return proc


def _pids_in(ns: str) -> list:
    out = _run("ip", "netns", "pids", ns, check=False).stdout.split()
    return [int(p) for p in out if p.isdigit()]


def destroy(lab: Lab) -> None:
    """Ends the processes ``spawn`` started and anything still running in the lab's namespaces (SIGTERM, SIGKILL
    after 2 s), deletes the namespaces (their veths go with them) and the bridge. Safe to call twice."""
    for p in lab.procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.time() + 2.0
    for p in lab.procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for ns in lab.namespaces.values():
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = _pids_in(ns)
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            end = time.time() + 2.0
            while _pids_in(ns) and time.time() < end:
                time.sleep(0.05)
        _run("ip", "netns", "del", ns, check=False)
    for i in range(len(lab.namespaces)):  # the bridge-side peers, now: the kernel removes them with a namespace later
        _run("ip", "link", "del", _names(lab.tag, i)[2], check=False)
    _run("ip", "link", "del", lab.bridge, check=False)
