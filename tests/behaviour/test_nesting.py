"""amp functions inside amp functions, amp functions as arguments, jitted functions under amp.

A library layer decorated with ``@amp`` inside a user's ``@amp`` loss, an
energy under ``@amp`` whose forces ``jax.grad`` feeds an amp'd loss (force
matching), a jitted amp function handed to ``lax.map`` or a solver: amp must
run each function as written, never another one's trace.
"""

from __future__ import annotations

import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from amp_jax import amp

POLICIES = ["bfloat16", "float16", "float32"]


def _f(x):
    return jnp.sin(x) * x


@pytest.mark.parametrize("policy", POLICIES)
def test_amp_of_a_grad_of_an_amp_function_is_that_gradient(policy):
    # jax.grad copies amp(f).__dict__ onto its wrapper; amp of the wrapper once
    # took amp(f)'s fn and trace cache for its own and returned f(x)
    inner = amp(_f, policy=policy)
    got = amp(jax.grad(inner), policy=policy)(0.7)
    np.testing.assert_allclose(got, jax.grad(_f)(0.7), rtol=1e-2)
    assert not np.isclose(got, _f(0.7), rtol=1e-3)


@pytest.mark.parametrize("policy", POLICIES)
def test_second_derivative_through_two_amp_layers(policy):
    twice = jax.grad(amp(jax.grad(amp(_f, policy=policy)), policy=policy))(0.7)
    np.testing.assert_allclose(twice, jax.grad(jax.grad(_f))(0.7), rtol=1e-2)


@pytest.mark.parametrize("wrap", [jax.jit, jax.vmap, jax.grad])
def test_amp_of_any_jax_wrapper_of_an_amp_function_runs_the_wrapper(wrap):
    inner = amp(lambda x: jnp.sum(jnp.tanh(x) * 3.0))
    x = jnp.linspace(-1.0, 1.0, 4)
    outer = wrap(inner)
    np.testing.assert_allclose(amp(outer)(x), outer(x), rtol=1e-2)


def test_functools_wraps_of_an_amp_function_runs_the_outer_function():
    inner = amp(lambda x: x * 2)

    @functools.wraps(inner)
    def outer(x):
        return inner(x) + 1

    assert float(outer(1.0)) == 3.0
    assert float(amp(outer)(1.0)) == 3.0
    assert amp(outer).fn is outer


def test_a_library_amp_layer_inside_a_users_amp_loss():
    @amp
    def layer(w, x):
        return jax.nn.relu(x @ w)

    def loss(w, x):
        return jnp.mean(layer(w, x) ** 2)

    w = jax.random.normal(jax.random.key(0), (256, 256)) / 16
    x = jax.random.normal(jax.random.key(1), (64, 256))
    want = jax.grad(loss)(w, x)
    got = jax.grad(amp(loss))(w, x)
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05 * float(jnp.abs(want).max()))
    # the inner layer's dot is bf16 in the program the outer amp runs
    jaxpr = str(jax.make_jaxpr(amp(loss))(w, x))
    assert re.search(r"bf16\[64,256\]", jaxpr) and "preferred_element_type=float32" in jaxpr


def test_force_matching_energy_under_amp():
    # forces from an amp'd energy, fed to an amp'd loss
    energy = amp(lambda r: jnp.sum(jnp.cos(r @ r.T)))

    def loss(r, target):
        return jnp.mean((jax.grad(energy)(r) - target) ** 2)

    r = jax.random.normal(jax.random.key(2), (6, 3))
    target = jnp.zeros((6, 3))
    plain = lambda r, t: jnp.mean((jax.grad(lambda r: jnp.sum(jnp.cos(r @ r.T)))(r) - t) ** 2)
    np.testing.assert_allclose(amp(loss)(r, target), plain(r, target), rtol=0.05)


# -- amp functions passed as arguments -----------------------------------------------


def _jitted_amp():
    f = jax.jit(amp(lambda y: jnp.sin(y) * 2))
    f(jnp.ones(3))  # its trace cache now holds a trace (with constants)
    return f


def _apply(h, y):
    return h(y)


@pytest.mark.parametrize("how", ["argument", "partial", "lax_map"])
def test_a_jitted_amp_function_is_accepted_as_an_argument(how):
    f, x = _jitted_amp(), jnp.ones(3)
    if how == "argument":
        got = amp(lambda h, y: h(y))(f, x)
    elif how == "partial":
        got = amp(functools.partial(_apply, f))(x)
    else:
        got = jax.jit(amp(lax.map), static_argnums=0)(f, x)
    np.testing.assert_allclose(got, jnp.sin(x) * 2, rtol=1e-2)


def test_a_plain_object_holding_arrays_is_still_refused():
    class Holder:
        def __init__(self):
            self.w = jnp.ones(3)

        def __call__(self, y):
            return y * self.w

    with pytest.raises(TypeError, match=r"argument `h` is a Holder that holds arrays \(`h.w`\)"):
        amp(lambda h, y: h(y))(Holder(), jnp.ones(3))


# -- a jitted function under amp stays one compiled program ---------------------------


@jax.jit
def _jitted(x):
    return jnp.tanh(x @ x.T).sum() * 2 + 1


def _compiled_names(run) -> list[str]:
    """The names of the XLA computations JAX compiles while ``run()`` runs."""
    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler, logger = Grab(), logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            run()
    finally:
        logger.removeHandler(handler)
    return [m.group(1) for r in records if (m := re.match(r"Compiling (\S+)", r))]


@pytest.mark.parametrize("grad", [False, True], ids=["call", "grad"])
def test_an_eager_call_of_amp_of_a_jitted_function_compiles_one_program(grad):
    x = jax.random.normal(jax.random.key(3), (256, 256)) / 16
    f = amp(_jitted)
    run = (lambda: jax.grad(f)(x)) if grad else (lambda: f(x))
    names = _compiled_names(run)
    # one program named after the user's jit, not one per primitive
    assert names and all("_jitted" in n for n in names), names
    assert not _compiled_names(run)  # compiled once, cached
    np.testing.assert_allclose(f(x), _jitted(x), rtol=1e-2)


def test_amp_of_a_jitted_function_keeps_its_jit_in_the_program():
    x = jnp.ones((256, 256))
    jaxpr = jax.make_jaxpr(amp(_jitted))(x).jaxpr
    (eqn,) = jaxpr.eqns
    assert eqn.primitive.name in ("jit", "pjit") and eqn.params["name"] == "_jitted"
    assert "bf16" in str(eqn.params["jaxpr"])  # the rewritten body, not the original
