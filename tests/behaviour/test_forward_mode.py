"""Issue 25, item 6: amp composes with forward-mode differentiation.

A lowered dot is a ``custom_jvp`` whose tangent products are amp's linear
low-precision dot (``amp_jax._src.rules.dots.lowdot``): ``jax.jvp``, ``jacfwd``,
``linearize``, ``linear_transpose`` and Hessian-vector products work, and
``jax.grad`` still multiplies compute-dtype cotangents with compute-dtype
operands (the transpose rule of the linear dot).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import BF16, eqns, prim_dtypes

from amp_jax import Policy, amp

KEY = jax.random.PRNGKey(0)
W = jax.random.normal(KEY, (32, 64)) * 0.2
W2 = jax.random.normal(jax.random.PRNGKey(1), (64, 16)) * 0.2
X = jax.random.normal(jax.random.PRNGKey(2), (8, 32))


def f(w, x):
    return jnp.tanh(jnp.tanh(x @ w) @ W2)


def hand(w, x):
    """The same program cast by hand as amp casts it: matmul operands in bf16,
    and the tanh between the two matmuls (a follower of low ops) in bf16."""

    def mm(a, b):
        return jnp.matmul(a.astype(BF16), b.astype(BF16), preferred_element_type=jnp.float32)

    return jnp.tanh(mm(jnp.tanh(mm(x, w).astype(BF16)), W2))


def loss(g):
    return lambda w, x: jnp.sum(g(w, x) ** 2)


def _rel(a, b):
    a, b = jnp.ravel(jnp.asarray(a)), jnp.ravel(jnp.asarray(b))
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


TANGENTS = (jax.random.normal(jax.random.PRNGKey(3), W.shape), X)

FORWARD = {
    "jvp": lambda g: jax.jvp(g, (W, X), TANGENTS)[1],
    "jit_jvp": lambda g: jax.jit(lambda w, x: jax.jvp(g, (w, x), TANGENTS)[1])(W, X),
    "jvp_of_jit": lambda g: jax.jvp(jax.jit(g), (W, X), TANGENTS)[1],
    "jacfwd": lambda g: jax.jacfwd(g)(W, X),
    "linearize": lambda g: jax.linearize(g, W, X)[1](*TANGENTS),
    "hvp": lambda g: jax.jvp(jax.grad(loss(g)), (W, X), TANGENTS)[1],
    "vmap_jvp": lambda g: jax.vmap(lambda t: jax.jvp(g, (W, X), (t, X))[1])(
        jnp.stack([TANGENTS[0], -TANGENTS[0]])
    ),
}


@pytest.mark.parametrize("name", list(FORWARD))
def test_forward_mode_runs_and_is_as_close_as_hand_cast(name):
    run = FORWARD[name]
    want, got, by_hand = run(f), run(amp(f)), run(hand)
    assert got.shape == want.shape
    err, err_hand = _rel(got, want), _rel(by_hand, want)
    assert err <= 2 * err_hand + 1e-6, (err, err_hand)
    assert err > 0  # (it did run in bf16: float32 would be exact)


def test_jvp_products_are_low_precision_and_grad_products_too():
    tangent_jaxpr = jax.make_jaxpr(lambda w, x: jax.jvp(amp(f), (w, x), TANGENTS))(W, X)
    linear = [e for e, _ in eqns(tangent_jaxpr) if e.primitive.name == "amp_linear_dot"]
    # the first dot: a product per operand (w and x have tangents); the
    # second: one (W2 is a constant)
    assert len(linear) == 3
    assert all(np.dtype(e.invars[1].aval.dtype) == BF16 for e in linear)
    grad_jaxpr = jax.make_jaxpr(jax.grad(loss(amp(f))))(W, X)
    dots = prim_dtypes(grad_jaxpr, "dot_general")
    assert len(dots) == 2 + 1 + 1  # forward; dh of the second; dw of the first (not dx)
    assert all(ins == (BF16, BF16) for ins, _, _ in dots), dots
    assert not [e for e, _ in eqns(grad_jaxpr) if e.primitive.name == "amp_linear_dot"]


def test_linear_transpose_of_a_lowered_matmul():
    lin = amp(lambda x: x @ W)
    ct = jax.random.normal(KEY, (8, 64))
    (got,) = jax.linear_transpose(lin, X)(ct)
    assert got.shape == X.shape and 0 < _rel(got, ct @ W.T) < 1e-2


def test_hessian_vector_product_under_jit_matches_float32():
    def hvp(g):
        return jax.jit(
            lambda w, x, t: jax.jvp(jax.grad(loss(g)), (w, x), (t, jnp.zeros_like(x)))[1]
        )

    got, want = hvp(amp(f))(W, X, TANGENTS[0]), hvp(f)(W, X, TANGENTS[0])
    by_hand = hvp(hand)(W, X, TANGENTS[0])
    assert _rel(got, want) <= 2 * _rel(by_hand, want)


# -- convolutions ------------------------------------------------------------------
# (kept float32 on CPU by the backend-aware rule; backend_aware=False makes
# them run in bf16 here as they do on a GPU)

CONV_POLICY = Policy(backend_aware=False)
CX = jax.random.normal(jax.random.PRNGKey(4), (2, 8, 8, 4))
CW = jax.random.normal(jax.random.PRNGKey(5), (3, 3, 4, 8)) * 0.3
CT = jax.random.normal(jax.random.PRNGKey(6), CW.shape)


def _conv(x, w):
    return jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def conv_net(w, x):
    return jnp.tanh(_conv(x, w))


def conv_hand(w, x):
    y = jax.lax.conv_general_dilated(
        x.astype(BF16),
        w.astype(BF16),
        (1, 1),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        preferred_element_type=jnp.float32,
    )
    return jnp.tanh(y)


CONV_FORWARD = {
    "jvp": lambda g: jax.jvp(lambda w: g(w, CX), (CW,), (CT,))[1],
    "jacfwd": lambda g: jax.jacfwd(lambda w: g(w, CX)[0, 0, 0])(CW),
    "linearize": lambda g: jax.linearize(lambda w: g(w, CX), CW)[1](CT),
    "hvp": lambda g: jax.jit(jax.jvp, static_argnums=0)(
        jax.grad(lambda w: jnp.sum(g(w, CX) ** 2)), (CW,), (CT,)
    )[1],
}


@pytest.mark.parametrize("name", list(CONV_FORWARD))
def test_forward_mode_through_a_lowered_conv(name):
    run = CONV_FORWARD[name]
    want, got = run(conv_net), run(amp(conv_net, policy=CONV_POLICY))
    by_hand = run(conv_hand)
    err, err_hand = _rel(got, want), _rel(by_hand, want)
    assert 0 < err <= 2 * err_hand + 1e-6, (err, err_hand)


def test_conv_tangent_and_cotangent_convolutions_take_bf16_operands():
    g = amp(conv_net, policy=CONV_POLICY)
    tangent = jax.make_jaxpr(lambda w: jax.jvp(lambda v: g(v, CX), (w,), (CT,)))(CW)
    convs = prim_dtypes(tangent, "conv_general_dilated")
    assert len(convs) == 2 and all(ins == (BF16, BF16) for ins, _, _ in convs), convs
    backward = jax.make_jaxpr(jax.grad(lambda w, x: jnp.sum(g(w, x) ** 2), argnums=(0, 1)))(CW, CX)
    convs = prim_dtypes(backward, "conv_general_dilated")
    # the forward conv, and one cotangent conv per operand
    assert len(convs) == 3 and all(ins == (BF16, BF16) for ins, _, _ in convs), convs


def test_forward_mode_through_a_float8_matmul_is_refused_with_the_fix():
    w = jax.random.normal(KEY, (256, 256))
    x = jax.random.normal(KEY, (64, 256))
    g = amp(lambda w: jnp.tanh(x @ w), policy="float8")
    with pytest.raises(TypeError, match="policy='bfloat16'"):
        jax.jvp(g, (w,), (w,))
    assert jax.grad(lambda w: jnp.sum(g(w)))(w).shape == w.shape  # reverse mode works
