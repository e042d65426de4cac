"""The shifted-sum and native depthwise convolutions equal XLA's grouped convolution in values and gradients."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jmsnas import dwconv, native
from jmsnas.dwconv import depthwise_conv, pointwise_conv

TOL = dict(rtol=1e-5, atol=1e-5)


def _uniform(rng, shape):
    return jnp.asarray(rng.uniform(-1, 1, shape), jnp.float32)


def _value_and_vjp(impl, x, w, stride, seed):
    """(y, dx, dw) for a random cotangent drawn from seed (the same for every impl), jitted as one program."""
    oh, ow = -(-x.shape[1] // stride), -(-x.shape[2] // stride)
    g = _uniform(np.random.default_rng(seed), (x.shape[0], oh, ow, x.shape[3]))

    @jax.jit
    def run(a, b, g):
        y, pull = jax.vjp(lambda a, b: depthwise_conv(a, b, stride, impl), a, b)
        return (y, *pull(g))

    return run(x, w, g)


def _numpy_depthwise(x, w, stride):
    """Brute-force oracle: explicit SAME padding (low = total // 2) and a loop over outputs and taps."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    b, h, wd, c = x.shape
    k = w.shape[0]
    oh, ow = -(-h // stride), -(-wd // stride)
    ph = max((oh - 1) * stride + k - h, 0)
    pw = max((ow - 1) * stride + k - wd, 0)
    xp = np.zeros((b, h + ph, wd + pw, c))
    xp[:, ph // 2:ph // 2 + h, pw // 2:pw // 2 + wd] = x
    out = np.zeros((b, oh, ow, c))
    for r, s, i, j in itertools.product(range(oh), range(ow), range(k), range(k)):
        out[:, r, s] += xp[:, stride * r + i, stride * s + j] * w[i, j]
    return out


@pytest.mark.parametrize("impl", ["shifted", "native"])
@pytest.mark.parametrize("k", [3, 5, 7])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("hw", [(7, 8), (8, 7)])
def test_fast_impls_match_xla_values_and_gradients(impl, k, stride, hw):
    rng = np.random.default_rng([k, stride, *hw])
    x, w = _uniform(rng, (2, *hw, 3)), _uniform(rng, (k, k, 3))
    ref = _value_and_vjp("xla", x, w, stride, seed=k + stride)
    got = _value_and_vjp(impl, x, w, stride, seed=k + stride)
    assert got[0].shape == (2, -(-hw[0] // stride), -(-hw[1] // stride), 3)
    for name, a, b in zip(("y", "dx", "dw"), got, ref):
        np.testing.assert_allclose(a, b, **TOL, err_msg=name)


@pytest.mark.parametrize("k", [3, 5, 7])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("hw, c", [((16, 16), 48), ((13, 12), 45), ((9, 10), 16), ((5, 4), 40)])
def test_native_tiles_and_channel_tails_match_xla(k, stride, hw, c):
    """Wide rows and many channels: the native kernels' register tiles (4 columns x 16 channels forward, 32 or 16
    channels x k taps weight gradient), their 8-channel and single-channel tails, and the border columns."""
    rng = np.random.default_rng([k, stride, c])
    x, w = _uniform(rng, (3, *hw, c)), _uniform(rng, (k, k, c))
    ref = _value_and_vjp("xla", x, w, stride, seed=c)
    got = _value_and_vjp("native", x, w, stride, seed=c)
    for name, a, b in zip(("y", "dx", "dw"), got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=3e-5, err_msg=name)


def test_native_weight_gradient_is_bitwise_repeatable():
    """The weight gradient sums rows in fixed blocks added in order, so repeated runs (threads scheduled
    differently each time) give the same bits; per-thread partial sums would not (the main job then drifted)."""
    rng = np.random.default_rng(11)
    x, w = _uniform(rng, (16, 24, 24, 48)), _uniform(rng, (5, 5, 48))
    runs = [np.asarray(_value_and_vjp("native", x, w, 1, seed=3)[2]) for _ in range(6)]
    for dw in runs[1:]:
        np.testing.assert_array_equal(dw, runs[0])


def test_native_under_vmap_and_other_dtypes():
    """vmap over per-example kernels runs the kernel once per element; bfloat16 inputs compute in float32."""
    rng = np.random.default_rng(0)
    x, w = _uniform(rng, (4, 2, 6, 6, 16)), _uniform(rng, (4, 3, 3, 16))
    got = jax.jit(jax.vmap(lambda a, b: depthwise_conv(a, b, 2, "native")))(x, w)
    ref = jax.vmap(lambda a, b: depthwise_conv(a, b, 2, "xla"))(x, w)
    np.testing.assert_allclose(got, ref, **TOL)
    xb = x[0].astype(jnp.bfloat16)
    yb = depthwise_conv(xb, w[0], 1, "native")
    assert yb.dtype == jnp.bfloat16
    np.testing.assert_allclose(yb.astype(jnp.float32), depthwise_conv(xb.astype(jnp.float32), w[0], 1, "xla"),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("impl", ["shifted", "native"])
@pytest.mark.parametrize("k, stride, h", [(3, 1, 35), (5, 2, 67)])
def test_tall_images_take_the_blocked_weight_gradient(impl, k, stride, h):
    """More than 32 output rows: the weight gradient loops over row blocks (zero-padded last block)."""
    assert -(-h // stride) > dwconv._ROWS_PER_STEP
    rng = np.random.default_rng(h)
    x, w = _uniform(rng, (2, h, 5, 3)), _uniform(rng, (k, k, 3))
    ref = _value_and_vjp("xla", x, w, stride, seed=h)
    got = _value_and_vjp(impl, x, w, stride, seed=h)
    for name, a, b in zip(("y", "dx", "dw"), got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("impl", ["xla", "shifted", "native"])
@pytest.mark.parametrize("k, stride, hw", [(3, 2, (6, 5)), (5, 1, (4, 5)), (5, 2, (2, 3)), (7, 2, (11, 12))])
def test_matches_brute_force_same_padding(impl, k, stride, hw):
    """Every impl equals a loop over taps with explicit TF-style SAME padding (asymmetric for stride 2)."""
    rng = np.random.default_rng(7)
    x, w = _uniform(rng, (2, *hw, 20)), _uniform(rng, (k, k, 20))
    got = jax.jit(depthwise_conv, static_argnums=(2, 3))(x, w, stride, impl)
    np.testing.assert_allclose(got, _numpy_depthwise(x, w, stride), **TOL)


@pytest.mark.parametrize("impl", ["shifted", "native"])
@pytest.mark.parametrize("stride", [1, 2])
def test_jitted_grad_of_scalar_loss(impl, stride):
    rng = np.random.default_rng(stride)
    x, w = _uniform(rng, (3, 9, 8, 5)), _uniform(rng, (5, 5, 5))
    t = _uniform(rng, (3, -(-9 // stride), -(-8 // stride), 5))

    def loss(impl):
        return lambda a, b: jnp.sum((depthwise_conv(jnp.tanh(a), b, stride, impl) - t) ** 2)

    got = jax.jit(jax.grad(loss(impl), argnums=(0, 1)))(x, w)
    ref = jax.jit(jax.grad(loss("xla"), argnums=(0, 1)))(x, w)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
    assert float(jnp.max(jnp.abs(got[1]))) > 1e-2  # the gradient is not trivially zero


def test_auto_picks_native_on_cpu_and_xla_elsewhere(monkeypatch):
    assert jax.default_backend() == "cpu"
    assert native.load(), native.error()  # CI machines have g++: the native kernels must build there
    assert dwconv.resolve_impl("auto") == "native"
    x, w = jnp.ones((1, 4, 4, 2)), jnp.ones((3, 3, 2))
    jaxpr = str(jax.make_jaxpr(lambda a, b: depthwise_conv(a, b))(x, w))
    assert "jmsnas_depthwise_forward" in jaxpr and "conv_general_dilated" not in jaxpr
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert dwconv.resolve_impl("auto") == "xla"
    assert "conv_general_dilated" in str(jax.make_jaxpr(lambda a, b: depthwise_conv(a, b))(x, w))


def test_auto_falls_back_to_shifted_with_a_warning_when_native_cannot_build(monkeypatch):
    monkeypatch.setattr(native, "load", lambda: False)
    monkeypatch.setattr(native, "error", lambda: "no C++ compiler found")
    monkeypatch.setattr(dwconv, "_warned", [])
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler found"):
        assert dwconv.resolve_impl("auto") == "shifted"
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler found"):
        dwconv.resolve_impl("native")


@pytest.mark.slow
def test_native_build_writes_a_loadable_library_and_reports_compiler_errors(tmp_path):
    import ctypes

    cxx = native.compiler()
    assert cxx is not None
    out = tmp_path / "lib.so"
    native._build(cxx, out)
    lib = ctypes.CDLL(str(out))
    for symbol in native.TARGETS.values():
        assert getattr(lib, symbol) is not None
    bad = tmp_path / "bad.cc"
    bad.write_text("this is not C++\n")
    with pytest.raises(RuntimeError, match="failed"):
        native._build(cxx, tmp_path / "bad.so", sources=(bad,))
    assert not (tmp_path / "bad.so").exists() and list(tmp_path.glob("tmp*")) == []


@pytest.mark.parametrize("x_shape, w_shape, stride, impl, needle", [
    ((1, 5, 5, 3), (4, 4, 3), 1, "auto", "4x4"),
    ((1, 5, 5, 3), (3, 5, 3), 1, "auto", "3x5"),
    ((5, 5, 3), (3, 3, 3), 1, "auto", "(5, 5, 3)"),
    ((1, 5, 5, 3), (3, 3), 1, "auto", "(3, 3)"),
    ((1, 5, 5, 3), (3, 3, 4), 1, "auto", "4 channels"),
    ((1, 5, 5, 3), (3, 3, 3), 1, "fast", "'fast'"),
    ((1, 5, 5, 3), (3, 3, 3), 3, "shifted", "got 3"),
    ((1, 5, 5, 3), (3, 3, 3), 2.0, "native", "got 2.0"),
    ((1, 5, 5, 3), (4, 4, 3), 1, "native", "4x4"),
])
def test_bad_input_raises_naming_the_value(x_shape, w_shape, stride, impl, needle):
    with pytest.raises(ValueError) as err:
        depthwise_conv(jnp.zeros(x_shape), jnp.zeros(w_shape), stride, impl)
    assert needle in str(err.value)


def test_pointwise_matches_1x1_conv_values_and_gradients():
    rng = np.random.default_rng(11)
    x, w = _uniform(rng, (2, 5, 6, 7)), _uniform(rng, (7, 4))

    def conv(a, b):
        return lax.conv_general_dilated(a, b[None, None], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def value_and_vjp(f):
        return jax.jit(lambda a, b, g: (lambda y, pull: (y, *pull(g)))(*jax.vjp(f, a, b)))

    g = _uniform(rng, (2, 5, 6, 4))
    got = value_and_vjp(pointwise_conv)(x, w, g)
    assert got[0].shape == (2, 5, 6, 4)
    for a, b in zip(got, value_and_vjp(conv)(x, w, g)):
        np.testing.assert_allclose(a, b, **TOL)


@pytest.mark.parametrize("x_shape, w_shape, needle", [
    ((5, 5, 3), (3, 4), "(5, 5, 3)"),
    ((1, 5, 5, 3), (3, 4, 1), "(3, 4, 1)"),
    ((1, 5, 5, 3), (2, 4), "2 input channels"),
])
def test_pointwise_bad_input(x_shape, w_shape, needle):
    with pytest.raises(ValueError) as err:
        pointwise_conv(jnp.zeros(x_shape), jnp.zeros(w_shape))
    assert needle in str(err.value)
