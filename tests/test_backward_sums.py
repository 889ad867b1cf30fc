"""What amp does to the sums of the backward pass, under an outer ``vmap``,
and the float32 policy's identity."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import BF16, F16, eqns, rel
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
