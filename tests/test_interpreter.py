"""The evaluation of a plan (``amp_jax._src.interpreter``): what it writes into
the rewritten jaxpr, seen through ``jax.make_jaxpr`` of an amp function.

Each (value, dtype) cast is made once, a low elementwise op with a float32
operand computes in float32, outputs keep the original program's dtypes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import BF16, F16, F32, prim_dtypes

import amp_jax
from amp_jax import amp

# toy shapes: every matmul lowered; float32 matmul results on every backend
POLICY = amp_jax.Policy(min_low_contraction=0, min_low_flops=0, allow_outputs="float32")
X, W, W2 = jnp.ones((4, 8)), jnp.full((8, 8), 0.1), jnp.full((8, 8), 0.2)
X8 = jax.random.normal(jax.random.PRNGKey(2), (4, 8))


def _converts_of(jaxpr, var):
    return [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type" and var in e.invars]


@pytest.mark.usefixtures("low_elementwise")  # (the painting: XLA:CPU keeps them float32)
def test_a_value_read_low_twice_is_cast_once():
    def f(x, w, w2):
        h = x @ w  # written in float32 (allow_outputs), read low by two unary ops
        return (jnp.tanh(h) @ w2) + (jnp.negative(h) @ w2)

    jaxpr = jax.make_jaxpr(amp(f, policy=POLICY))(X, W, W2).jaxpr
    readers = [e for e in jaxpr.eqns if e.primitive.name in ("tanh", "neg")]
    assert [e.invars[0].aval.dtype for e in readers] == [BF16, BF16]
    (h,) = [v for v in jaxpr.eqns[0].outvars]  # the first dot's result
    assert h.aval.dtype == F32
    casts = _converts_of(jaxpr, h)
    assert len(casts) == 1, casts  # one bf16 copy of h, read by both ops
    assert readers[0].invars[0] is readers[1].invars[0] is casts[0].outvars[0]


@pytest.mark.usefixtures("low_elementwise")  # (the painting: XLA:CPU keeps them float32)
def test_a_cast_is_shared_by_every_reader():
    def f(x, w, w2):
        h = x @ w
        return jnp.tanh(h) @ w2, jnp.abs(h) @ w2

    jaxpr = jax.make_jaxpr(amp(f, policy=POLICY))(X, W, W2).jaxpr
    (h,) = jaxpr.eqns[0].outvars
    assert len(_converts_of(jaxpr, h)) == 1


@pytest.mark.usefixtures("low_elementwise")  # (the painting: XLA:CPU keeps them float32)
def test_an_elementwise_op_with_a_float32_operand_computes_in_float32():
    # the bias [8] (float32) added to a low [4, 8]: the add reads the widest
    # input's dtype and casts its result down, so the transpose of the bias's
    # broadcast (a sum over the batch) runs in float32
    def f(x, w, b, w2):
        return jnp.tanh(x @ w + b) @ w2

    policy = amp_jax.Policy(min_low_contraction=0, min_low_flops=0, allow_outputs="compute")
    jaxpr = jax.make_jaxpr(amp(f, policy=policy))(X, W, jnp.ones(8), W2).jaxpr
    (add,) = [e for e in jaxpr.eqns if e.primitive.name == "add"]
    assert [v.aval.dtype for v in add.invars] == [F32, F32]
    (tanh,) = [e for e in jaxpr.eqns if e.primitive.name == "tanh"]
    assert tanh.invars[0].aval.dtype == BF16
    grad = jax.make_jaxpr(jax.grad(lambda b: jnp.sum(amp(f, policy=policy)(X, W, b, W2))))
    sums = [e for e in grad(jnp.ones(8)).jaxpr.eqns if e.primitive.name == "reduce_sum"]
    assert sums and all(e.invars[0].aval.dtype == F32 for e in sums), sums


def test_outputs_keep_their_dtypes():
    def f(x, w):
        h = x @ w  # written in bf16 (allow_outputs="compute"), returned as float32
        return h, h.astype(jnp.bfloat16), x.astype(jnp.float16)

    policy = amp_jax.Policy(min_low_contraction=0, min_low_flops=0, allow_outputs="compute")
    jaxpr = jax.make_jaxpr(amp(f, policy=policy))(X, W).jaxpr
    assert [v.aval.dtype for v in jaxpr.outvars] == [F32, BF16, F16]
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    back = producer[jaxpr.outvars[0]]  # the low result, cast back to its own dtype
    assert back.primitive.name == "convert_element_type"
    assert back.invars[0].aval.dtype == BF16
    outs = amp(f, policy=policy)(X, W)
    assert [o.dtype for o in outs] == [r.dtype for r in f(X, W)]


def test_output_dtypes_preserved():
    def f(x):
        return x.astype(jnp.bfloat16) @ x.astype(jnp.bfloat16).T, x @ x.T, x.astype(jnp.float16)

    outs = amp(f)(X8)
    refs = f(X8)
    assert [o.dtype for o in outs] == [r.dtype for r in refs]
    dots = prim_dtypes(jax.make_jaxpr(amp(f))(X8), "dot_general")
    assert [i for i, _, _ in dots] == [(BF16, BF16)] * 2  # (x @ x.T lowered too)


@pytest.mark.usefixtures("low_elementwise")  # (the painting: XLA:CPU keeps them float32)
def test_literal_operands_are_cast_as_constants():
    def f(x, w, w2):
        return ((x @ w) * 3.0) @ w2  # the dot writes bf16: the literal is read as bf16

    policy = amp_jax.Policy(min_low_contraction=0, min_low_flops=0, allow_outputs="compute")
    jaxpr = jax.make_jaxpr(amp(f, policy=policy))(X, W, W2).jaxpr
    (mul,) = [e for e in jaxpr.eqns if e.primitive.name == "mul"]
    assert [v.aval.dtype for v in mul.invars] == [BF16, BF16]
    np.testing.assert_allclose(amp(f, policy=policy)(X, W, W2), f(X, W, W2), rtol=2e-2)


def test_a_python_scalar_that_a_primitive_gives_is_read_like_a_literal():
    # JAX's custom_vjp3 (a config flag) binds one "hi" primitive that runs the
    # traced function on its operands as they are: a Python float captured
    # from a static argument comes back a Python float, which amp then read
    # as if it had a dtype (custom_api_test's
    # test_initial_style_vmap_with_collective, found by benchmarks/jax_suite.py)
    from jax import lax

    from amp_jax._src.testing import interpreted_float32

    previous = jax.config.jax_custom_vjp3
    jax.config.update("jax_custom_vjp3", True)
    try:

        @jax.custom_vjp
        def total(x):
            return lax.psum(x, "i")

        total.defvjp(lambda x: (total(x), None), lambda _, g: (g,))
        for wrap in (amp, interpreted_float32):
            fn = wrap(lambda _, x: total(x))
            out = jax.vmap(fn, axis_name="i", in_axes=(0, None), out_axes=None)(
                jnp.arange(4.0), 2.0
            )
            assert float(out) == 8.0
    finally:
        jax.config.update("jax_custom_vjp3", previous)


@pytest.mark.parametrize("kind", ["numpy", "python"])
def test_each_cotangent_a_backward_rule_is_handed_is_its_own(kind):
    # vjp handed a NumPy or Python cotangent passes it, as it is, to a
    # custom_vjp's backward rule: amp traced the rule with it as a static,
    # cached the trace by its shape, and gave the first call's cotangent's
    # result for every later one
    @jax.custom_vjp
    def f(x):
        return x * 3.0

    f.defvjp(lambda x: (x * 3.0, None), lambda _, g: (g * 2.0,))
    x = X if kind == "numpy" else 1.0
    _, pull = jax.vjp(amp(f), x)
    for scale in (1.0, 5.0):
        ct = np.full((4, 8), scale, np.float32) if kind == "numpy" else scale
        (got,) = pull(ct)
        np.testing.assert_array_equal(got, 2 * np.asarray(ct))


def test_a_chain_of_backward_rules_drops_each_cotangent_once_used():
    # a rule returning a NumPy array: amp kept the array in its cache of the
    # rule's trace (as if a symbolic zero), so each cotangent of a chain of
    # custom_vjp rules stayed alive for as long as the amp function did
    # (JAX's api_test test_backward_pass_ref_dropping)
    import weakref

    refs, alive = [], []

    @jax.custom_vjp
    def f(x):
        return x

    def bwd(_, g):
        alive.append([r() is not None for r in refs])
        zero = np.zeros((), np.float32)
        refs.append(weakref.ref(zero))
        return (zero,)

    f.defvjp(lambda x: (x, None), bwd)
    g = jax.grad(amp(lambda x: f(f(f(x)))))(1.0)
    assert alive[2][0] is False  # the first rule's output, used by the second
    assert isinstance(g, jax.Array) and float(g) == 0.0
