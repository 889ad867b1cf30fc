"""A tiny test file in Flax NNX's style for `benchmarks/jax_suite.py --smoke`:
each test passes its function to an NNX transformation the plugin wraps in
amp, and checks that it ran under amp (or not, in the baseline)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

AMP = os.environ.get("AMP_JAX_SUITE_MODE", "off") in ("float32", "bfloat16")
X = np.linspace(0, 1, 32, dtype=np.float32).reshape(2, 16)
SEEN: list[str] = []


def loss(m, x):
    # amp traces the function to a jaxpr: it sees jaxpr tracers where
    # nnx.grad and nnx.vmap alone pass JVP and batch tracers
    SEEN.append(type(m.kernel.get_value()).__name__)
    return jnp.sum(m(x) ** 2)


def traced_by_amp() -> bool:
    return SEEN.pop() == "DynamicJaxprTracer"


def model():
    return nnx.Linear(16, 16, rngs=nnx.Rngs(0))


def test_jit_program_is_amps():
    m = model()
    np.testing.assert_allclose(nnx.jit(loss)(m, X), loss(m, X), rtol=2e-2)
    text = str(jax.make_jaxpr(nnx.jit(lambda m, x: m(x)))(m, X))
    assert ("amp_dot" in text) == AMP, text


def test_grad():
    # (a function of its own: equal amp wrappers of one function share its trace, and
    # `loss` was traced by an earlier test)
    g = nnx.grad(lambda m, x: loss(m, x))(model(), X)
    assert g["kernel"].shape == (16, 16)
    assert traced_by_amp() == AMP


def test_value_and_grad_decorator():
    @nnx.value_and_grad(has_aux=True)
    def f(m, x):
        return loss(m, x), None

    (v, _), g = f(model(), X)
    assert v.shape == () and g["kernel"].shape == (16, 16)
    assert traced_by_amp() == AMP


def test_vmap():
    v = nnx.vmap(loss, in_axes=(None, 0))(model(), X[:, None])
    assert v.shape == (2,)
    assert traced_by_amp() == AMP
