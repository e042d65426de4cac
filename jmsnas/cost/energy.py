"""Energy of one inference on every device and link (JMSNAS section III-C: devices with limited power).

Units: power in W, time in ms, so energy in mJ (1 W x 1 ms = 1 mJ).

* Compute: device m draws ``active_power_w`` while it computes, for its busy time (the compute latency of its
  layers, the stem on the first device and the head on the last: ``Latency.per_device``):
  E_m^comp = P_m * T_m^comp.
* Transmission: a link carrying b bytes is busy for its airtime b * 8 / bandwidth (ms; the fixed per-transfer
  latency is propagation and protocol waiting, not airtime); the sender's interface draws ``tx_power_w`` and the
  receiver's ``rx_power_w`` during it: E_l = (P_tx + P_rx) * airtime, of which P_tx * airtime is charged to the
  sender and P_rx * airtime to the receiver.
* A device's energy is its compute energy plus what its links charge it; the total is the sum over devices
  (= compute energy + every link's energy).

Every term is linear in the per-layer latencies, so for probabilities p the expectation E[E_m] is the same formula
with E[tau] (exact, differentiable in p). A power that is not given (None) counts as 0 W and the device or link is
reported as unknown (``known``).
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from jmsnas.cost.latency import latency, link_bytes


class Energy(NamedTuple):
    """mJ per inference: per_device float32[M] (compute + charged link energy), per_link float32[L], total."""

    total: jnp.ndarray
    per_device: jnp.ndarray
    per_link: jnp.ndarray


def powers(topology) -> tuple:
    """(active W float64[M], tx W float64[L], rx W float64[L]) with None read as 0."""
    z = lambda v: 0.0 if v is None else float(v)
    return (np.array([z(d.active_power_w) for d in topology.devices]),
            np.array([z(l.tx_power_w) for l in topology.links]), np.array([z(l.rx_power_w) for l in topology.links]))


def known(topology) -> dict:
    """{"devices": {name: bool}, "links": {"a->b": bool}}: whose energy the topology describes (every power of a
    device's own links given too, for a device)."""
    link_ok = {n: l.tx_power_w is not None and l.rx_power_w is not None
               for n, l in zip(topology.link_names, topology.links)}
    dev_ok = {d.name: d.active_power_w is not None and all(
        ok for l, ok in zip(topology.links, link_ok.values()) if d.name in (l.src, l.dst)) for d in topology.devices}
    return {"devices": dev_ok, "links": link_ok}


def energy(space, table, probs, assignment=None) -> Energy:
    """Energy in mJ of probabilities ``probs`` float[N, R] (one-hot: one architecture) under the split
    ``assignment`` (D^m by default)."""
    topo = space.topology
    active, tx, rx = (jnp.asarray(a, jnp.float32) for a in powers(topo))
    lat = latency(space, table, probs, assignment)
    air_ms = link_bytes(space, table, assignment) * 8.0 / (table.bandwidth_mbps * 1e3)
    per_device = active * lat.per_device
    src = np.array([topo.device_names.index(l.src) for l in topo.links], np.int32)
    dst = np.array([topo.device_names.index(l.dst) for l in topo.links], np.int32)
    if len(topo.links):
        per_device = per_device.at[src].add(tx * air_ms).at[dst].add(rx * air_ms)
    per_link = (tx + rx) * air_ms
    return Energy(jnp.sum(per_device), per_device, per_link)


def energy_budgets(topology) -> np.ndarray:
    """float64[M]: every device's ``energy_budget_mj`` (inf where none is given)."""
    return np.array([np.inf if d.energy_budget_mj is None else float(d.energy_budget_mj) for d in topology.devices])
