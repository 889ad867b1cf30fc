"""A tiny test file in JAX's style for `benchmarks/jax_suite.py --smoke`: each
test passes its function to a transformation the plugin wraps in amp."""

import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import grad, jit


def f(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


W = np.linspace(-1, 1, 256, dtype=np.float32).reshape(16, 16) / 4
X = np.linspace(0, 1, 32, dtype=np.float32).reshape(2, 16)


def test_jit():
    np.testing.assert_allclose(jit(f)(W, X), f(W, X), rtol=2e-2)


def test_jit_static_decorator():
    @partial(jax.jit, static_argnums=1)
    def g(x, n):
        return x * n

    np.testing.assert_allclose(g(X, 3), X * 3)


def test_grad_and_vmap():
    g = grad(f)(W, X)
    assert g.shape == W.shape and g.dtype == W.dtype
    v = jax.vmap(f, in_axes=(None, 0))(W, X[:, None])
    assert v.shape == (2,)


def test_jvp_vjp():
    y, t = jax.jvp(lambda w: f(w, X), (W,), (jnp.ones_like(W),))
    y2, pullback = jax.vjp(lambda w: f(w, X), W)
    (g,) = pullback(jnp.ones_like(y2))
    np.testing.assert_allclose(t, jnp.sum(g), rtol=5e-2)


def test_the_program_is_amps():
    # what the plugin's counter cannot tell: the jitted program is amp's
    # (its dot rule wraps dots in a custom_jvp named amp_dot)
    text = str(jax.make_jaxpr(jit(f))(W, X))
    mode = os.environ.get("AMP_JAX_SUITE_MODE", "off")
    assert ("amp_dot" in text) == (mode in ("float32", "bfloat16")), (mode, text)
