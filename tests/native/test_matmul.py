"""dwconv.matmul (the 1x1 convolutions' matrix product, with the native x^T g weight-gradient kernel on CPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmsnas import dwconv, native


def _value_and_grads(impl, x, w, cot):
    y, vjp = jax.vjp(lambda x, w: dwconv.matmul(x, w, impl), x, w)
    return (y, *vjp(cot))


# (rows, K, N): the kernel's row strips (8 or 6 by the instruction set, then 4, then single rows) over K, its two-
# and one-vector column tiles (16/32 or 8/16 columns) and the scalar corner over N, fewer rows than one chunk (256)
# and rows that do not divide into the 16 blocks.
@pytest.mark.parametrize("rows,k,n", [(4097, 27, 16), (3000, 13, 10), (300, 48, 288), (1030, 96, 50),
                                      (17, 8, 32), (2048, 5, 3)])
def test_native_equals_float64_matmul_in_values_and_gradients(rows, k, n):
    rng = np.random.default_rng(rows + k + n)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((rows, n)), jnp.float32)
    y, dx, dw = jax.jit(lambda x, w, c: _value_and_grads("native", x, w, c))(x, w, cot)
    x64, w64, c64 = (np.asarray(a, np.float64) for a in (x, w, cot))
    np.testing.assert_allclose(y, x64 @ w64, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dx, c64 @ w64.T, rtol=1e-4, atol=1e-4)
    # the weight gradient sums over every row: compare relative to its scale
    np.testing.assert_allclose(dw, x64.T @ c64, rtol=1e-5, atol=1e-5 * np.abs(x64.T @ c64).max())
    want = _value_and_grads("xla", x, w, cot)
    np.testing.assert_allclose(dw, want[2], rtol=1e-4, atol=1e-5 * np.abs(x64.T @ c64).max())


def test_native_weight_gradient_is_bitwise_repeatable_and_works_under_vmap():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 5000, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 24, 40)), jnp.float32)
    grad = jax.jit(jax.vmap(jax.grad(lambda x, w: jnp.sum(jnp.sin(dwconv.matmul(x, w, "native"))), argnums=1)))
    runs = [np.asarray(grad(x, w)) for _ in range(4)]
    for r in runs[1:]:
        np.testing.assert_array_equal(r, runs[0])
    want = jax.vmap(jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), argnums=1))(x, w)
    np.testing.assert_allclose(runs[0], want, rtol=1e-4, atol=1e-3)


def test_native_kernel_leaves_the_arch_gradient_alone():
    """Differentiating only with respect to x (an architecture step): XLA removes the unused weight gradient."""
    x = jnp.ones((2048, 16), jnp.float32)
    w = jnp.ones((16, 8), jnp.float32)
    hlo = jax.jit(jax.grad(lambda x: jnp.sum(dwconv.matmul(x, w, "native")))).lower(x).compile().as_text()
    assert "jmsnas_matmul_tn" not in hlo
    hlo_w = jax.jit(jax.grad(lambda w: jnp.sum(dwconv.matmul(x, w, "native")))).lower(w).compile().as_text()
    assert "jmsnas_matmul_tn" in hlo_w


def test_impl_choice_and_bad_name():
    on_cpu = jax.default_backend() == "cpu" and native.load()
    rows = dwconv.NATIVE_MATMUL_MIN_ROWS
    assert dwconv.resolve_matmul_impl("auto", rows) == ("native" if on_cpu else "xla")
    assert dwconv.resolve_matmul_impl("auto", rows - 1) == "xla"
    assert dwconv.resolve_matmul_impl("xla", 10 ** 6) == "xla"
    with pytest.raises(ValueError, match="matmul impl must be one of .* got 'blas'"):
        dwconv.resolve_matmul_impl("blas", 10)
