"""amp_jax._src.compat: the params of JAX's higher-order primitives, on this JAX.

The suite runs on JAX 0.10 (CI) and 0.11 (the accelerator machine); these
tests pin the version-dependent reads so that a change in JAX fails here,
by name, rather than deep inside a rewrite.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from amp_jax._src import compat


def _eqn(jaxpr, name):
    found = [e for e in compat.jaxpr_of(jaxpr).eqns if e.primitive.name in name]
    assert found, [e.primitive.name for e in compat.jaxpr_of(jaxpr).eqns]
    return found[0]


def _rebind(jaxpr, eqn_name, args, **kw):
    """Evaluates ``jaxpr`` with the ``eqn_name`` eqn re-bound through compat."""
    closed = jaxpr
    eqn = _eqn(closed, eqn_name)

    def run(*a):
        env = dict(zip(compat.jaxpr_of(closed).invars, a))
        env.update(zip(compat.jaxpr_of(closed).constvars, compat.consts_of(closed)))
        read = lambda v: compat.literal_value(v) if isinstance(v, compat.Literal) else env[v]
        for e in compat.jaxpr_of(closed).eqns:
            params = compat.map_subjaxprs(e, lambda c: c) if e is eqn else None
            outs = compat.bind_eqn(e, [read(v) for v in e.invars], params)
            env.update(zip(e.outvars, outs))
        return [read(v) for v in compat.jaxpr_of(closed).outvars]

    return run(*args)


@pytest.mark.parametrize("n_consts, n_carry, n_xs", [(0, 1, 1), (2, 1, 3), (1, 2, 0)])
def test_scan_xs_are_the_trailing_scanned_operands(n_consts, n_carry, n_xs):
    consts = [jnp.full((3,), float(i)) for i in range(n_consts)]
    xs = [jnp.ones((5, 3)) * (i + 1) for i in range(n_xs)]

    def f(carry, xs):
        def body(c, x):
            c = tuple(ci + sum(consts, 0.0) + sum(x, 0.0) for ci in c)
            return c, c[0]

        return lax.scan(body, carry, xs, length=5)

    carry = tuple(jnp.zeros(3) for _ in range(n_carry))
    jaxpr = jax.make_jaxpr(f)(carry, xs)
    eqn = _eqn(jaxpr, {"scan"})
    body, idx = compat.scan_xs(eqn)
    assert list(idx) == list(range(len(eqn.invars) - n_xs, len(eqn.invars)))
    assert compat.scan_num_xs(eqn.params) == n_xs
    # the scanned operands are [length, ...] slices of the body's trailing inputs
    for i in idx:
        assert eqn.invars[i].aval.shape == (5, *compat.in_avals(body)[i].shape)
    # a body with retyped inputs is accepted by the primitive
    new = compat.scan_params_with_body(eqn, body)
    assert new["jaxpr"] is body


@pytest.mark.parametrize(
    "name, fn",
    [
        (
            "while",
            lambda x: lax.while_loop(
                lambda c: c[0] < 5, lambda c: (c[0] + 1, jnp.tanh(c[1])), (0, x)
            )[1],
        ),
        ("cond", lambda x: lax.cond(x[0] > 0, jnp.sin, jnp.cos, x)),
        ("scan", lambda x: lax.scan(lambda c, y: (c * y, c), x, jnp.ones((3, 4)))[0]),
        ("checkpoint", jax.checkpoint(lambda x: jnp.sin(x) * 2)),
        ("custom_jvp_call", jax.nn.relu),
        ("custom_vjp_call", jax.custom_vjp(lambda x: x * 3)),
        ("jit", jax.jit(lambda x: x @ x.T)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_map_subjaxprs_identity_rebinds_every_higher_order_primitive(name, fn):
    if name == "custom_vjp_call":
        fn.defvjp(lambda x: (x * 3, None), lambda _, g: (g * 3,))
    x = jnp.linspace(-1.0, 1.0, 4)
    jaxpr = jax.make_jaxpr(fn)(x)
    names = {name, "pjit", "remat", "remat2", "custom_vjp_call_jaxpr"} & {
        e.primitive.name for e in jaxpr.eqns
    }
    assert names, [e.primitive.name for e in jaxpr.eqns]
    eqn = _eqn(jaxpr, names)
    assert compat.has_subjaxprs(eqn)
    out = _rebind(jaxpr, names, [x])
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(fn(x)))
    if name == "custom_jvp_call":
        assert "jvp_jaxpr_fun" in eqn.params and compat.is_closed_jaxpr(eqn.params["call_jaxpr"])
    if name == "custom_vjp_call":
        assert "fwd_jaxpr_thunk" in eqn.params


def test_jit_is_inlinable_only_without_shardings_or_donation():
    x = jnp.ones(4)
    plain = _eqn(jax.make_jaxpr(jax.jit(jnp.sin))(x), compat.JIT_NAMES)
    donated = _eqn(
        jax.make_jaxpr(lambda x: jax.jit(jnp.sin, donate_argnums=0)(x))(x), compat.JIT_NAMES
    )
    assert compat.jit_is_inlinable(plain)
    assert not compat.jit_is_inlinable(donated)
    assert compat.is_closed_jaxpr(compat.jit_jaxpr(plain))


def test_closed_and_open_jaxprs():
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) + 1.0)(jnp.ones(2))
    assert compat.is_closed_jaxpr(closed)
    opened = compat.jaxpr_of(closed)
    assert [v.aval for v in opened.invars] == compat.in_avals(closed)
    again = compat.close(opened, compat.consts_of(closed))
    assert compat.is_closed_jaxpr(again)
