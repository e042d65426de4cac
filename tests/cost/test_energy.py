"""Energy per device and link (cost.energy): a hand count, and the expectation against enumeration."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas.topology import presets
from jmsnas.cost.energy import energy, known
from jmsnas.cost.latency import arch_latency
from jmsnas.cost.tables import analytic_table
from jmsnas.gates import probabilities
from jmsnas.space import build_space
from jmsnas.topology import DeviceProfile, LinkProfile, make_topology


def _space():
    devs = [DeviceProfile("ue", 5.0, 1e9, active_power_w=2.0), DeviceProfile("cloud", 100.0, 1e9, active_power_w=50.0)]
    topo = make_topology("c", devs, [LinkProfile("ue", "cloud", 10.0, 3.0, True, 4.0, 0.5)], (2, 1))
    return build_space(topo, image_size=8, in_channels=1, num_classes=10, device_channels=(8, 12),
                       device_strides=(1, 2), stem_channels=4, head_channels=16)


def test_hand_count():
    space = _space()
    table = analytic_table(space)
    ops = np.array([0, 12, 3], np.int32)
    lat = arch_latency(space, table, ops)
    e = energy(space, table, jax.nn.one_hot(ops, 13))
    air_ms = 8 * 8 * 8 * 4 * 8 / (10.0 * 1e3)  # the 8x8x8 float32 tensor at 10 Mbit/s; the 3 ms latency is no airtime
    np.testing.assert_allclose(float(e.per_link[0]), (4.0 + 0.5) * air_ms, rtol=1e-6)
    np.testing.assert_allclose(float(e.per_device[0]), 2.0 * float(lat.per_device[0]) + 4.0 * air_ms, rtol=1e-6)
    np.testing.assert_allclose(float(e.per_device[1]), 50.0 * float(lat.per_device[1]) + 0.5 * air_ms, rtol=1e-6)
    np.testing.assert_allclose(float(e.total), float(e.per_device.sum()), rtol=1e-6)


@pytest.mark.slow
def test_expected_energy_equals_enumeration():
    space = _space()
    table = analytic_table(space)
    mask = space.mask()
    probs = probabilities(jax.random.normal(jax.random.PRNGKey(0), mask.shape), jnp.asarray(mask))
    archs = np.array(list(itertools.product(*[np.flatnonzero(mask[n]) for n in range(space.num_layers)])), np.int32)
    w = np.prod(np.asarray(probs, np.float64)[np.arange(space.num_layers), archs], axis=1)
    per = np.asarray(jax.vmap(lambda o: energy(space, table, jax.nn.one_hot(o, 13)).per_device)(jnp.asarray(archs)))
    np.testing.assert_allclose(np.asarray(energy(space, table, probs).per_device), w @ per, rtol=1e-5)


def test_presets_describe_every_device_and_link():
    for topo in (presets.chain_preset(), presets.mesh_preset()):
        k = known(topo)
        assert all(k["devices"].values()) and all(k["links"].values())
