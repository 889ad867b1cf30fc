"""The tangent-product primitive of a lowered dot (``amp_linear_dot``): its
abstract evaluation, JVP, transpose and batching rules.

The primitive is taken from the jaxpr of ``jax.jvp`` of an amp matmul (where
it appears) and bound again with that eqn's own parameters: the tests read
no private names.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from _util import BF16, F32

import amp_jax

POLICY = amp_jax.Policy(min_low_contraction=0, min_low_flops=0, allow_outputs="float32")
T = jax.random.normal(jax.random.PRNGKey(0), (4, 8))  # the tangent operand (float32)
O = jax.random.normal(jax.random.PRNGKey(1), (8, 3)).astype(jnp.bfloat16)  # the low operand


def _lowdot():
    """``(primitive, params)`` of the tangent product ``dot(cast(t), o)``, t the lhs."""
    f = amp_jax.amp(lambda x, w: x @ w, policy=POLICY)
    x, w = jnp.ones((4, 8)), jnp.ones((8, 3))
    jaxpr = jax.make_jaxpr(lambda dx: jax.jvp(lambda x: f(x, w), (x,), (dx,)))(x)
    from _util import eqns  # (inside amp's jitted dot: JAX 0.12 keeps the jit in jaxprs)

    (eqn,) = [e for e, _ in eqns(jaxpr) if e.primitive.name == "amp_linear_dot"]
    assert eqn.params["t_is_lhs"] and eqn.params["compute_dtype"] == BF16
    return eqn.primitive, dict(eqn.params)


def _ref(t, o):
    """What the product is: ``cast(t) @ o``, accumulated in float32."""
    return jnp.dot(t.astype(BF16), o, preferred_element_type=F32)


def _dots(jaxpr):
    from _util import eqns

    return [e for e, _ in eqns(jaxpr) if e.primitive.name == "dot_general"]


def test_abstract_eval_gives_the_dot_shape_in_the_accumulation_dtype():
    prim, params = _lowdot()
    out = jax.eval_shape(lambda t, o: prim.bind(t, o, **params), T, O)
    assert out.shape == (4, 3) and out.dtype == F32
    low = jax.eval_shape(lambda t, o: prim.bind(t, o, **{**params, "acc": BF16}), T, O)
    assert low.dtype == BF16
    # t on the right: dot(o, cast(t))
    swapped = {**params, "t_is_lhs": False, "dimension_numbers": (((1,), (0,)), ((), ()))}
    out = jax.eval_shape(lambda t, o: prim.bind(t, o, **swapped), T.T[:, :3], O.T)
    assert out.shape == (3, 3) and out.dtype == F32


def test_evaluation_is_the_low_dot_with_float32_accumulation():
    prim, params = _lowdot()
    np.testing.assert_allclose(prim.bind(T, O, **params), _ref(T, O), rtol=1e-6)


def test_jvp_is_the_product_of_each_tangent():
    prim, params = _lowdot()
    dt = jax.random.normal(jax.random.PRNGKey(2), T.shape)
    do = jax.random.normal(jax.random.PRNGKey(3), O.shape).astype(BF16)
    out, tan = jax.jvp(lambda t, o: prim.bind(t, o, **params), (T, O), (dt, do))
    np.testing.assert_allclose(out, _ref(T, O), rtol=1e-6)
    np.testing.assert_allclose(tan, _ref(dt, O) + _ref(T, do), rtol=1e-5, atol=1e-5)
    # in t alone: the tangent is the same primitive applied to dt
    jaxpr = jax.make_jaxpr(lambda t, d: jax.jvp(lambda t: prim.bind(t, O, **params), (t,), (d,)))
    names = [e.primitive.name for e in jaxpr(T, dt).jaxpr.eqns]
    assert names.count("amp_linear_dot") == 2, names


def test_the_jvp_rule_of_two_zero_tangents_is_a_zero_of_the_output():
    """JAX skips a rule whose tangents are all symbolic zeros; called directly,
    the rule answers a zero tangent of the output's shape and float32 dtype
    (it called a `Zero.from_primal_value` no JAX version has)."""
    from jax.interpreters import ad

    from amp_jax._src.rules.dots import lowdot

    prim, params = _lowdot()
    zeros = tuple(ad.Zero(jax.typeof(a).to_tangent_aval()) for a in (T, O))
    out, tan = lowdot._jvp((T, O), zeros, **params)
    assert type(tan) is ad.Zero
    assert (tan.aval.shape, tan.aval.dtype) == (out.shape, out.dtype) == ((4, 3), F32)


def test_transpose_writes_compute_dtype_products_with_float32_accumulation():
    prim, params = _lowdot()
    ct = jax.random.normal(jax.random.PRNGKey(4), (4, 3))
    for wrt, arg in (("t", T), ("o", O)):
        fn = (
            (lambda t: prim.bind(t, O, **params))
            if wrt == "t"
            else (lambda o: prim.bind(T, o, **params))
        )
        transpose = jax.linear_transpose(fn, arg)
        (got,) = transpose(ct)
        assert got.dtype == arg.dtype and got.shape == arg.shape  # the operand's own
        dots = _dots(jax.make_jaxpr(transpose)(ct))
        assert dots, wrt
        for e in dots:  # the cotangent rounded to bf16, times the low operand, in float32
            assert [v.aval.dtype for v in e.invars] == [BF16, BF16], e
            assert e.params["preferred_element_type"] == F32 and e.outvars[0].aval.dtype == F32
        ctl = ct.astype(BF16)
        want = (
            jnp.dot(ctl, O.T, preferred_element_type=F32)
            if wrt == "t"
            else jnp.dot(T.astype(BF16).T, ctl, preferred_element_type=F32)
        )
        np.testing.assert_allclose(got.astype(F32), want.astype(arg.dtype).astype(F32), rtol=1e-2)


def test_grad_through_forward_mode_uses_the_transpose():
    # jax.grad of a jvp (reverse-over-forward) transposes the tangent product
    f = amp_jax.amp(lambda x, w: jnp.sum(jnp.tanh(x @ w)), policy=POLICY)
    w = jnp.full((8, 3), 0.1)

    def hvp_like(x, v):
        return jax.jvp(lambda x: f(x, w), (x,), (v,))[1]

    g = jax.grad(hvp_like, argnums=1)(T, T)
    dots = _dots(jax.make_jaxpr(jax.grad(hvp_like, argnums=1))(T, T))
    low = [e for e in dots if [v.aval.dtype for v in e.invars] == [BF16, BF16]]
    assert len(low) >= 2, dots  # the forward product and its transpose, both bf16
    ref = jax.grad(lambda v: jax.jvp(lambda x: jnp.sum(jnp.tanh(x @ w)), (T,), (v,))[1])(T)
    assert g.dtype == F32
    np.testing.assert_allclose(g, ref, rtol=5e-2, atol=5e-2)


def test_batching_keeps_one_product_and_broadcasts_no_operand():
    prim, params = _lowdot()
    ts = jax.random.normal(jax.random.PRNGKey(5), (5, 4, 8))
    os_ = jax.random.normal(jax.random.PRNGKey(6), (5, 8, 3)).astype(BF16)
    cases = {
        "t": (ts, O, (0, None)),
        "o": (T, os_, (None, 0)),
        "both": (ts, os_, (0, 0)),
        "t, axis 1": (jnp.moveaxis(ts, 0, 1), O, (1, None)),
    }
    for name, (t, o, axes) in cases.items():
        fn = jax.vmap(lambda t, o: prim.bind(t, o, **params), in_axes=axes)
        got = jax.jit(fn)(t, o)
        want = jax.jit(jax.vmap(_ref, in_axes=axes))(t, o)
        assert got.shape == want.shape == (5, 4, 3), name
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
        eqs = jax.make_jaxpr(fn)(t, o).jaxpr.eqns
        (lowdot,) = [e for e in eqs if e.primitive.name == "amp_linear_dot"]
        if axes[1] is None:  # the unbatched low operand is read as it is
            assert lowdot.invars[1].aval.shape == O.shape, name
        if axes[0] is None:
            assert lowdot.invars[0].aval.shape == T.shape, name
