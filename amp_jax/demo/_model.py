"""A small GPT-style byte-level transformer in plain JAX.

Pre-LayerNorm blocks (causal multi-head attention, GELU MLP), learned position
embeddings, layers stacked and run with ``lax.scan``. Written for float32 and
left to [`amp_jax.amp`][amp_jax.amp] to run in low precision: there is no ``dtype``
argument anywhere.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Config:
    """Model and batch sizes."""

    vocab: int = 256
    d_model: int = 128
    layers: int = 2
    heads: int = 4
    seq: int = 128
    batch: int = 16


def init_params(key: jax.Array, cfg: Config) -> dict[str, Any]:
    """float32 parameters; the blocks are stacked along a leading layer axis."""
    d, n, std = cfg.d_model, cfg.layers, 0.02
    ks = jax.random.split(key, 7)
    out_std = std / math.sqrt(2 * n)

    def normal(k, shape, s):
        return jax.random.normal(k, shape, jnp.float32) * s

    return {
        "embed": normal(ks[0], (cfg.vocab, d), std),
        "pos": normal(ks[1], (cfg.seq, d), std),
        "blocks": {
            "ln1_scale": jnp.ones((n, d)),
            "ln1_bias": jnp.zeros((n, d)),
            "w_qkv": normal(ks[2], (n, d, 3 * d), std),
            "b_qkv": jnp.zeros((n, 3 * d)),
            "w_out": normal(ks[3], (n, d, d), out_std),
            "b_out": jnp.zeros((n, d)),
            "ln2_scale": jnp.ones((n, d)),
            "ln2_bias": jnp.zeros((n, d)),
            "w_up": normal(ks[4], (n, d, 4 * d), std),
            "b_up": jnp.zeros((n, 4 * d)),
            "w_down": normal(ks[5], (n, 4 * d, d), out_std),
            "b_down": jnp.zeros((n, d)),
        },
        "lnf_scale": jnp.ones((d,)),
        "lnf_bias": jnp.zeros((d,)),
        "unembed": normal(ks[6], (d, cfg.vocab), std),
    }


def layer_norm(x, scale, bias, eps=1e-5):
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def attention(x, p, heads):
    b, s, d = x.shape
    qkv = x @ p["w_qkv"] + p["b_qkv"]
    q, k, v = jnp.split(qkv.reshape(b, s, 3 * heads, d // heads), 3, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads)
    causal = jnp.tril(jnp.ones((s, s), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, d)
    return out @ p["w_out"] + p["b_out"]


def block(x, p, heads):
    x = x + attention(layer_norm(x, p["ln1_scale"], p["ln1_bias"]), p, heads)
    h = jax.nn.gelu(layer_norm(x, p["ln2_scale"], p["ln2_bias"]) @ p["w_up"] + p["b_up"])
    return x + h @ p["w_down"] + p["b_down"]


def logits_fn(params, tokens, heads):
    x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
    x, _ = jax.lax.scan(lambda h, p: (block(h, p, heads), None), x, params["blocks"])
    x = layer_norm(x, params["lnf_scale"], params["lnf_bias"])
    return x @ params["unembed"]


def loss_fn(params, tokens, targets, heads):
    """Mean next-byte cross-entropy in nats."""
    logp = jax.nn.log_softmax(logits_fn(params, tokens, heads).astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
