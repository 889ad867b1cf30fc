"""diffrax under amp (issue 25, item 4): a checkpointed adjoint's backward
recomputes the forward, and must do it under the forward's policy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _util import BF16, hand_bf16_matmul, prim_dtypes, rel

from amp_jax import amp

diffrax = pytest.importorskip("diffrax")

W1 = jax.random.normal(jax.random.PRNGKey(0), (32, 64)) / 6
W2 = jax.random.normal(jax.random.PRNGKey(1), (64, 32)) / 8
Y0 = jax.random.normal(jax.random.PRNGKey(2), (16, 32))


def _mm(a, b):
    return a @ b


def _loss(mm, adjoint):
    def loss(w1, w2, y0):
        def vf(t, y, args):
            return jnp.tanh(mm(jnp.tanh(mm(y, args[0])), args[1]))

        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(vf),
            diffrax.Tsit5(),
            0.0,
            1.0,
            0.1,
            y0,
            args=(w1, w2),
            stepsize_controller=diffrax.PIDController(rtol=1e-4, atol=1e-6),
            adjoint=adjoint,
            max_steps=64,
        )
        return jnp.sum(sol.ys[-1] ** 2)

    return loss


@pytest.mark.parametrize("adjoint", ["recursive_checkpoint", "direct"])
def test_diffrax_gradients_with_the_default_adjoint(adjoint):
    """(the checkpointed adjoint crashed under jit on XLA:CPU, "Unsupported
    element type for DotThunk": its backward transposes dot results, see
    test_backend_cpu.py::test_a_transposed_dot_result_runs_and_matches_float32)"""
    adj = {
        "recursive_checkpoint": diffrax.RecursiveCheckpointAdjoint(),  # (the default)
        "direct": diffrax.DirectAdjoint(),
    }[adjoint]
    grad = lambda f: jax.jit(jax.grad(f, (0, 1)))(W1, W2, Y0)  # noqa: E731
    want = grad(_loss(_mm, adj))
    hand = grad(_loss(hand_bf16_matmul, adj))
    amp_loss = amp(_loss(_mm, adj))
    got = grad(amp_loss)
    for g, h, w in zip(got, hand, want):
        assert g.dtype == w.dtype
        # (was 74% off with the checkpointed adjoint: its backward recomputed
        # the solve in float32 and accepted other steps than the bf16 forward)
        assert rel(g, w) <= 2 * rel(h, w) + 1e-4, (rel(g, w), rel(h, w))
    # the forward and the backward ran their vector-field matmuls in bf16
    jaxpr = jax.make_jaxpr(jax.grad(amp_loss, (0, 1)))(W1, W2, Y0)
    assert BF16 in {d[0][0] for d in prim_dtypes(jaxpr, "dot_general")}
