"""Eq. (4): CE + lambda1 ||theta||^2 + lambda2 (E[T] - T_const)^2, and the one-sided variant (issue 2, item 6)."""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas import objectives as Obj
from jmsnas.topology import presets
from jmsnas.cost.latency import expected_latency
from jmsnas.cost.tables import analytic_table
from jmsnas.space import NUM_OPS, build_space

LOGITS = jnp.array([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
LABELS = jnp.array([0, 2])
PARAMS = {"a": jnp.array([1.0, 2.0]), "b": {"c": jnp.array([[3.0]])}}  # ||theta||^2 = 1 + 4 + 9 = 14


def hand_ce():
    row0 = math.log(math.e ** 2 + math.e + 1) - 2.0
    row1 = math.log(2 + math.e ** 3) - 3.0
    return (row0 + row1) / 2


def test_eq4_by_hand_two_sided():
    loss, parts = Obj.jmsnas_loss(LOGITS, LABELS, PARAMS, 12.0, 10.0, 0.01, 0.5)
    assert float(parts["ce"]) == pytest.approx(hand_ce(), rel=1e-6)
    assert float(parts["l2"]) == pytest.approx(14.0)
    assert float(parts["latency_penalty"]) == pytest.approx(4.0)
    assert float(loss) == pytest.approx(hand_ce() + 0.01 * 14 + 0.5 * 4.0, rel=1e-6)
    # two-sided: being 2 ms under the budget costs as much as being 2 ms over it
    below, _ = Obj.jmsnas_loss(LOGITS, LABELS, PARAMS, 8.0, 10.0, 0.01, 0.5)
    assert float(below) == pytest.approx(float(loss), rel=1e-6)


def test_one_sided_is_zero_below_the_budget():
    for t in (0.0, 5.0, 9.999, 10.0):
        assert float(Obj.latency_penalty(t, 10.0, "one_sided")) == 0.0
        _, parts = Obj.jmsnas_loss(LOGITS, LABELS, PARAMS, t, 10.0, 0.01, 0.5, penalty="one_sided")
        assert float(parts["latency_penalty"]) == 0.0
    assert float(Obj.latency_penalty(13.0, 10.0, "one_sided")) == pytest.approx(9.0)
    loss, _ = Obj.jmsnas_loss(LOGITS, LABELS, PARAMS, 13.0, 10.0, 0.01, 0.5, penalty="one_sided")
    assert float(loss) == pytest.approx(hand_ce() + 0.14 + 0.5 * 9.0, rel=1e-6)


def test_penalty_gradients():
    g1 = jax.grad(lambda t: Obj.latency_penalty(t, 10.0, "one_sided"))
    g2 = jax.grad(lambda t: Obj.latency_penalty(t, 10.0, "two_sided"))
    assert float(g1(7.0)) == 0.0 and float(g1(12.5)) == pytest.approx(5.0)
    assert float(g2(7.0)) == pytest.approx(-6.0) and float(g2(12.5)) == pytest.approx(5.0)


def test_l2_and_ce_gradients():
    g = jax.grad(Obj.l2_norm_sq)(PARAMS)
    np.testing.assert_allclose(np.asarray(g["a"]), [2.0, 4.0])
    np.testing.assert_allclose(np.asarray(g["b"]["c"]), [[6.0]])
    # d CE / d logits = (softmax - onehot) / batch
    g = np.asarray(jax.grad(Obj.cross_entropy)(LOGITS, LABELS))
    sm = np.asarray(jax.nn.softmax(LOGITS))
    np.testing.assert_allclose(g, (sm - np.eye(3)[[0, 2]]) / 2, rtol=1e-5, atol=1e-7)


def test_unknown_penalty_is_rejected():
    with pytest.raises(ValueError, match=re.escape("unknown latency penalty 'hinge'")):
        Obj.latency_penalty(1.0, 2.0, "hinge")
    with pytest.raises(ValueError, match=re.escape("'hinge'")):
        Obj.jmsnas_loss(LOGITS, LABELS, PARAMS, 1.0, 2.0, 0.0, 1.0, penalty="hinge")


def test_latency_term_drives_alpha_only_above_the_budget():
    sp = build_space(presets.topology("chain", [1, 1, 1, 1]), image_size=8, in_channels=3, num_classes=3,
                     device_channels=[4] * 4, device_strides=[1] * 4, stem_channels=4, head_channels=4)
    table = analytic_table(sp)
    alpha = jnp.asarray(np.random.default_rng(0).normal(0, 1, (4, NUM_OPS)), jnp.float32)
    t = float(expected_latency(sp, table, alpha).total)

    def grad_alpha(t_const, penalty):
        f = lambda a: Obj.jmsnas_loss(LOGITS, LABELS, PARAMS, expected_latency(sp, table, a).total, t_const,
                                      0.0, 1.0, penalty)[0]
        return np.asarray(jax.grad(f)(alpha))

    assert np.all(grad_alpha(t * 2, "one_sided") == 0)
    over = grad_alpha(t / 2, "one_sided")
    assert np.abs(over).max() > 0
    # above the budget the two variants agree; below it the two-sided one pushes latency up (opposite sign)
    np.testing.assert_allclose(over, grad_alpha(t / 2, "two_sided"), rtol=1e-6)
    under = grad_alpha(t * 2, "two_sided")
    assert np.sum(under * over) < 0
