"""Model libraries users bring, trained a few steps under amp (heavy: newest-JAX leg).

A penzai Llama-like transformer and an e3nn-jax equivariant message-passing
network (tensor products with spherical harmonics, irreps-wise linears,
gates, ``segment_sum`` over edges), each trained beside float32 and a
hand-cast bf16 version (penzai's own ``activation_dtype=bfloat16``; for
e3nn-jax, which has no dtype option, every float32 input and parameter cast
to bf16). amp's loss curve stays within 2x the hand-cast one's distance from
float32, and the matmuls of the rewritten program run in bf16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from amp_jax import amp, dtype_report

pytestmark = pytest.mark.heavy

STEPS = 4


def _train(loss, params, batch, tx=None):
    """Losses of STEPS jitted optimizer steps of ``loss(params, *batch)``."""
    tx = tx or optax.adam(1e-2)

    @jax.jit
    def step(p, s):
        value, g = jax.value_and_grad(loss)(p, *batch)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    state, losses = tx.init(params), []
    for _ in range(STEPS):
        params, state, value = step(params, state)
        losses.append(float(value))
    return np.array(losses)


def _check(loss, params, batch, hand_loss, hand_params, tol):
    """amp within ``tol`` of float32 and within 2x the hand-cast error; bf16 matmuls."""
    ref = _train(loss, params, batch)
    got = _train(amp(loss), params, batch)
    hand = _train(hand_loss, hand_params, batch)
    assert got[-1] < got[0], got  # it trains
    err_amp = float(np.max(np.abs(got - ref) / np.abs(ref)))
    err_hand = float(np.max(np.abs(hand - ref) / np.abs(ref)))
    assert err_amp <= tol, (err_amp, ref, got)
    assert err_amp <= 2 * err_hand + 1e-4, (err_amp, err_hand)
    rows = dtype_report(jax.grad(amp(loss)), params, *batch)
    dots = [r for r in rows if r[0] == "dot_general"]
    low = sum(r[4] for r in dots if r[1] == "bfloat16,bfloat16")
    assert low >= 1, dots
    return err_amp, err_hand


def _cast(tree, dtype):
    return jax.tree.map(
        lambda a: a.astype(dtype) if getattr(a, "dtype", None) == jnp.float32 else a, tree
    )


# -- penzai: a Llama-like decoder ----------------------------------------------------


def _penzai_lm(activation_dtype):
    ll = pytest.importorskip("penzai.models.transformer.variants.llamalike_common")
    cfg = ll.LlamalikeTransformerConfig(
        num_kv_heads=2,
        query_head_multiplier=2,
        embedding_dim=64,
        projection_dim=16,
        mlp_hidden_dim=128,
        num_decoder_blocks=2,
        vocab_size=97,
        mlp_variant="swiglu",
        tie_embedder_and_logits=False,
        activation_dtype=activation_dtype,
    )
    return ll.build_llamalike_transformer(cfg, init_base_rng=jax.random.key(0))


def _penzai_loss(model):
    from penzai import pz

    unbound, params = pz.unbind_params(model, freeze=True)

    def loss(params, tokens):
        lm = pz.bind_variables(unbound, params)
        inputs = pz.nx.wrap(tokens[:, :-1]).tag("batch", "seq")
        logits = lm(inputs, token_positions=pz.nx.arange("seq", tokens.shape[1] - 1))
        logits = logits.untag("batch", "seq", "vocabulary").unwrap().astype(jnp.float32)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

    return loss, params


def test_penzai_llama_trains_under_amp():
    pytest.importorskip("penzai")
    loss, params = _penzai_loss(_penzai_lm(jnp.float32))
    hand_loss, hand_params = _penzai_loss(_penzai_lm(jnp.bfloat16))
    tokens = jax.random.randint(jax.random.key(1), (8, 33), 0, 97)
    _check(loss, params, (tokens,), hand_loss, hand_params, tol=2e-2)


# -- e3nn-jax: an equivariant message-passing network (workloads/equivariant.py) ----


def test_e3nn_message_passing_trains_under_amp():
    pytest.importorskip("e3nn_jax")
    from workloads.equivariant import message_passing

    loss, params, batch = message_passing("small")

    def hand(params, x, sh, *rest):
        params, x, sh = _cast((params, x, sh), jnp.bfloat16)
        return loss(params, x, sh, *rest)

    _check(loss, params, batch, hand, params, tol=2e-2)
