"""diffrax under amp (issue 25, item 4): a checkpointed adjoint's backward
recomputes the forward, and must do it under the forward's policy."""

from __future__ import annotations

import jax
import pytest
from _util import BF16, hand_bf16_matmul, ode_loss, prim_dtypes, rel

from amp_jax import amp

diffrax = pytest.importorskip("diffrax")

W1 = jax.random.normal(jax.random.PRNGKey(0), (32, 64)) / 6
W2 = jax.random.normal(jax.random.PRNGKey(1), (64, 32)) / 8
Y0 = jax.random.normal(jax.random.PRNGKey(2), (16, 32))


def _mm(a, b):
    return a @ b


def _loss(mm, adjoint):
    return ode_loss(mm, "Tsit5", adjoint)


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
