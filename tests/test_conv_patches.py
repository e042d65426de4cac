"""ops.conv_patches (the stem's k x k convolution as one matmul) against XLA's convolution."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jmsnas import ops


def _xla(x, w, stride):
    return lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


@pytest.mark.parametrize("k,stride,size", [(3, 1, 8), (3, 2, 8), (3, 2, 7), (5, 1, 7), (5, 2, 9), (1, 1, 6),
                                           (1, 2, 5)])
def test_values_and_gradients_equal_xla(k, stride, size):
    rng = np.random.default_rng(k * 100 + stride * 10 + size)
    x = jnp.asarray(rng.standard_normal((2, size, size + 1, 3)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, k, 3, 5)), jnp.float32)
    got, want = ops.conv_patches(x, w, stride), _xla(x, w, stride)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    cot = jnp.asarray(rng.standard_normal(want.shape), jnp.float32)
    g_got = jax.grad(lambda x, w: jnp.sum(ops.conv_patches(x, w, stride) * cot), argnums=(0, 1))(x, w)
    g_want = jax.grad(lambda x, w: jnp.sum(_xla(x, w, stride) * cot), argnums=(0, 1))(x, w)
    for a, b in zip(g_got, g_want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_impl_choice():
    assert ops.resolve_conv_impl("auto") == ("patches" if jax.default_backend() == "cpu" else "xla")
    with pytest.raises(ValueError, match="conv impl must be one of .* got 'fft'"):
        ops.resolve_conv_impl("fft")
