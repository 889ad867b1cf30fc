"""What amp does to the sums of the backward pass, under an outer ``vmap``,
and the float32 policy's identity."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import BF16, eqns, low_sums, rel
from jax import lax

from amp_jax import amp

KS = jax.random.split(jax.random.key(0), 6)


def _einsum_in_cond(W, h):
    def branch(h):
        return jnp.tanh(jnp.einsum("bi,ihd->bhd", h, W).reshape(h.shape[0], -1))

    return lax.cond(jnp.mean(h) > 0, branch, lambda h: h * 0.5, h)


def test_a_dot_batched_by_an_outer_vmap_runs_under_grad():
    """A ``cond`` with a batched predicate broadcasts its operands: both
    operands of the einsum's linear dots gain a batch dim after amp planned
    them, in a layout XLA:CPU has no bf16 x bf16 -> f32 kernel for
    ("Unsupported element type for DotThunk::Execute")."""
    W = jax.random.normal(KS[0], (16, 2, 8)) / 4
    X = jax.random.normal(KS[1], (3, 6, 16)) + 0.1

    def g(fn):
        loss = lambda W, X: jnp.sum(jax.vmap(fn, (None, 0))(W, X) ** 2)
        return jax.jit(jax.grad(loss, (0, 1)))(W, X)

    ref = g(_einsum_in_cond)
    got = g(amp(_einsum_in_cond))
    assert rel(got, ref) < 2e-2, rel(got, ref)
    for u, v in zip(jax.tree.leaves(g(amp(_einsum_in_cond, policy="float32"))), ref):
        np.testing.assert_array_equal(u, v)


def _abs_exp(W, x):
    return jnp.sum((jnp.exp(-jnp.abs(x)) * x) @ W)


def test_float32_policy_is_bitwise_on_every_jax_version():
    """JAX 0.12 differentiates its jitted ``jnp`` helpers (``jnp.abs``) as
    units, summing the cotangents of their inputs in another order than a
    re-evaluated jaxpr of the same program: the float32 policy runs ``fn``."""
    W = jax.random.normal(KS[0], (16, 12))
    x = jax.random.normal(KS[1], (3, 16))
    f32 = amp(_abs_exp, policy="float32")
    for argnums in (0, 1, (0, 1)):
        a = jax.jit(jax.grad(_abs_exp, argnums))(W, x)
        b = jax.jit(jax.grad(f32, argnums))(W, x)
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(u, v)
        # eagerly too
        for u, v in zip(
            jax.tree.leaves(jax.value_and_grad(_abs_exp, argnums)(W, x)),
            jax.tree.leaves(jax.value_and_grad(f32, argnums)(W, x)),
        ):
            np.testing.assert_array_equal(u, v)


# -- selection ops between two matmuls: their backward sums in float32 -------------

BF = jnp.bfloat16


def _mm(a, b, hand):
    if hand:  # only the matmul operands cast, by hand
        return jnp.dot(a.astype(BF), b.astype(BF), preferred_element_type=jnp.float32)
    return a @ b


SELECTIONS = {
    "max-keepdims": lambda h: h - jnp.max(h, 1, keepdims=True),
    "min-keepdims": lambda h: h - jnp.min(h, 0, keepdims=True),
    "pool-overlap": lambda h: lax.reduce_window(h, -jnp.inf, lax.max, (1, 4), (1, 2), "SAME"),
    "cummax": lambda h: lax.cummax(h, axis=0),
    "cummin": lambda h: lax.cummin(h, axis=1),
    "gather-repeated": lambda h: h[jnp.arange(h.shape[0]) // 8],
    "sort": lambda h: jnp.sort(h, axis=1),
    "top_k": lambda h: lax.top_k(h, 32)[0],
    "scatter-add": lambda h: jnp.zeros_like(h).at[jnp.arange(h.shape[0]) // 4].add(h),
}


def _between(mid):
    def f(W1, W2, X, hand=False):
        h = mid(_mm(X, W1, hand))
        return jnp.sum(jnp.tanh(_mm(h, W2[: h.shape[1]], hand)))

    return f


def _data(n=64):
    W1 = jax.random.normal(KS[2], (n, n)) / np.sqrt(n)
    W2 = jax.random.normal(KS[3], (n, n)) / np.sqrt(n)
    X = jax.random.normal(KS[4], (n, n))
    return W1, W2, X


@pytest.mark.parametrize("name", sorted(SELECTIONS))
def test_selection_backward_sums_in_float32(name):
    """No sum of the backward pass (a ``reduce_sum`` of a keepdims max, the
    ``select_and_scatter_add`` of overlapping pooling, the scatter-add of a
    sort, top_k or repeated gather) adds compute-dtype values, also under an
    outer ``vmap``; the gradients are within 2x the hand-cast error."""
    f = _between(SELECTIONS[name])
    W1, W2, X = _data()
    assert low_sums(jax.make_jaxpr(jax.grad(amp(f), (0, 1)))(W1, W2, X)) == []
    g = lambda fn: jax.jit(jax.grad(fn, (0, 1)))(W1, W2, X)
    ref = g(f)
    hand = rel(g(lambda a, b, c: f(a, b, c, True)), ref)
    got = rel(g(amp(f)), ref)
    assert got <= 2 * hand, (got, hand)
    # per-example (the selection over one example's rows) under an outer vmap
    per = lambda W1, W2, X: jnp.sum(jax.vmap(amp(f), (None, None, 0))(W1, W2, X))
    Xs = jnp.stack([X[:, :16], X[:, 16:32]])
    assert low_sums(jax.make_jaxpr(jax.grad(per, (0, 1)))(W1[:16], W2, Xs)) == []


def test_cummax_row_that_holds_the_running_max_sums_its_cotangents_in_float32():
    """Row 0 is the running max of all 64 rows: its gradient adds 64
    cotangents (a tree of adds in cummax's JVP). With cummax on bf16 they were
    added in bf16."""
    W1, W2, X = _data()
    W1 = jnp.abs(W1)
    X = X.at[0].set(8.0)
    f = _between(SELECTIONS["cummax"])
    g = lambda fn: jax.jit(jax.grad(fn, 2))(W1, W2, X)[0]
    ref = g(f)
    hand = rel(g(lambda a, b, c: f(a, b, c, True)), ref)
    got = rel(g(amp(f)), ref)
    assert got <= 2 * hand, (got, hand)
    adds = [
        e.primitive.name
        for e, _ in eqns(jax.make_jaxpr(jax.grad(amp(f), 2))(W1, W2, X))
        if e.primitive.name in ("add", "add_any") and np.dtype(e.invars[0].aval.dtype) == BF16
    ]
    assert adds == []


# -- a parameter that an outer vmap broadcasts: its batch sum in float32 ------------

PER_EXAMPLE = {
    "bias": lambda h, p: h + p,
    "scale": lambda h, p: h * p,
    "max": lambda h, p: jnp.maximum(h, p),
}


@pytest.mark.parametrize("name", sorted(PER_EXAMPLE))
def test_parameter_broadcast_by_an_outer_vmap_sums_in_float32(name):
    """A per-example loss vmapped outside amp: amp sees one example, and the
    outer ``vmap`` broadcasts the unbatched parameter over the batch, so its
    gradient is a sum over the batch. The elementwise op reading the float32
    parameter computes in float32: that sum is float32 too, and the
    parameter's gradient is within 2x the hand-cast error."""
    W1, W2, _ = _data()
    p = jax.random.normal(KS[5], (64,))
    X = jax.random.normal(KS[4], (512, 64))
    op = PER_EXAMPLE[name]

    def f(p, x, hand=False):
        return jnp.sum(_mm(jnp.tanh(op(_mm(x, W1, hand), p)), W2, hand))

    def g(fn):
        return jax.grad(lambda p, X: jnp.mean(jax.vmap(fn, (None, 0))(p, X)))

    ref = jax.jit(g(f))(p, X)
    hand = rel(jax.jit(g(lambda p, x: f(p, x, True)))(p, X), ref)
    got = rel(jax.jit(g(amp(f)))(p, X), ref)
    assert got <= 2 * hand, (got, hand)
    assert low_sums(jax.make_jaxpr(g(amp(f)))(p, X)) == []
