"""compose.objective.step_costs: with every mechanism off, train.step_latency and the limits hinge of today's
search; with them on, every group of logits receives a gradient."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas import limits as L
from jmsnas import train
from jmsnas.compose import choices as C
from jmsnas.compose.objective import step_costs
from spaces import chain_space, mesh_space, setup

pytestmark = pytest.mark.usefixtures("fast_compiles")  # tiny programs: compile time dominates


def _logits(space, ch, seed=0):
    rng = np.random.default_rng(seed)
    return C.ChoiceProbs(*(jnp.asarray(rng.normal(size=s), jnp.float32) for s in C.logits_shapes(space, ch)))


@pytest.mark.parametrize("make,split", [(chain_space, "searched"), (mesh_space, "fixed")])
def test_all_off_is_todays_step(make, split):
    space = make()
    table, ch, terms, mem = setup(space, modules=(), weight_bits=(), act_bits=())
    logits = _logits(space, ch)
    lim = L.DeviceLimits(np.array([20000.0] + [np.inf] * (space.topology.num_devices - 1)),
                         np.full(space.topology.num_devices, 0.05), mem)
    got = step_costs(space, table, terms, ch, logits, split, lim)
    np.testing.assert_allclose(float(got.latency_ms), float(train.step_latency(space, table, logits.ops, split)),
                               rtol=1e-6)
    a = None if split == "fixed" else got.assignment
    want = L.expected_penalty(space, table, lim, logits.ops, a)
    assert float(want) > 0  # the limits bind here
    np.testing.assert_allclose(float(got.limits_penalty), float(want), rtol=1e-5)


def test_every_group_receives_a_gradient_and_bad_split_is_refused():
    space = chain_space()
    table, ch, terms, mem = setup(space)
    lim = L.DeviceLimits(np.array([20000.0, np.inf]), np.full(2, np.inf), mem)
    f = lambda lg: (lambda c: c.latency_ms + c.limits_penalty)(step_costs(space, table, terms, ch, lg, "searched",
                                                                          lim))
    grads = jax.jit(jax.grad(f))(_logits(space, ch, 1))
    assert all(float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(g), g, 0.0)))) > 0 for g in grads)
    with pytest.raises(ValueError, match="'both'"):
        step_costs(space, table, terms, ch, _logits(space, ch), "both")
