"""A tiny test file in Equinox's style for `benchmarks/jax_suite.py --smoke`:
each test passes its function to an Equinox transformation the plugin wraps
in amp, and checks that it ran under amp (or not, in the baseline)."""

import os
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

AMP = os.environ.get("AMP_JAX_SUITE_MODE", "off") in ("float32", "bfloat16")
W = np.linspace(-1, 1, 256, dtype=np.float32).reshape(16, 16) / 4
X = np.linspace(0, 1, 32, dtype=np.float32).reshape(2, 16)
SEEN: list[str] = []


class Linear(eqx.Module):
    w: jax.Array
    act: Callable = jnp.tanh  # a non-array leaf: eqx's filters and amp take it as static

    def __call__(self, x):
        return self.act(x @ self.w)


def loss(m, x):
    # amp traces the function to a jaxpr: it sees jaxpr tracers where
    # filter_grad and filter_vmap alone pass JVP and batch tracers
    SEEN.append(type(x).__name__ if not isinstance(m.w, jax.core.Tracer) else type(m.w).__name__)
    return jnp.sum(m(x) ** 2)


def traced_by_amp() -> bool:
    return SEEN.pop() == "DynamicJaxprTracer"


def test_filter_jit_program_is_amps():
    m = Linear(W)
    np.testing.assert_allclose(eqx.filter_jit(loss)(m, X), loss(m, X), rtol=2e-2)
    jitted = eqx.filter_jit(lambda m, x: m(x))
    text = str(jax.make_jaxpr(lambda x: jitted(m, x))(X))
    assert ("amp_dot" in text) == AMP, text


def test_filter_grad():
    # (a function of its own: equal amp wrappers of one function share its trace, and
    # `loss` was traced by an earlier test)
    g = eqx.filter_grad(lambda m, x: loss(m, x))(Linear(W), X)
    assert g.w.shape == W.shape and g.w.dtype == W.dtype
    assert traced_by_amp() == AMP


def test_filter_value_and_grad_decorator():
    @eqx.filter_value_and_grad(has_aux=True)
    def f(m, x):
        return loss(m, x), None

    (v, _), g = f(Linear(W), X)
    assert v.shape == () and g.w.shape == W.shape
    assert traced_by_amp() == AMP


def test_filter_vmap():
    v = eqx.filter_vmap(loss, in_axes=(None, 0))(Linear(W), X[:, None])
    assert v.shape == (2,)
    assert traced_by_amp() == AMP
