"""Frozen study; its results: benchmarks/results/QUANTIZED_STATES.md, the drift table under "Rounded to the nearest code".

How far quantized Adam moments drift from float32 Adam's on the same gradients.

    python -m benchmarks.studies.quantized_drift [--steps 300]

Trains the demo model (``amp_jax.demo`` defaults, seed 0) with float32 AdamW
and, at every step, also feeds the same gradient to AdamW with quantized
moments (8-bit, float8, 4-bit; ``state_rounding`` "stochastic" and
"nearest"; embeddings and small tensors keep float32 moments, as in
``quantized_states.py``), each with its own state. Prints, over the
quantized parameters only, the norm of each optimizer's update relative to
float32 AdamW's (mean over step ranges) and, at the end, the median of
``sqrt(nu)`` relative to float32 AdamW's: a quantized ``nu`` that lags low
shows up as a larger update, a larger learning rate in disguise.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from amp_jax import optim
from amp_jax.demo import _data, _model
from amp_jax.optim import _quantized
from benchmarks.quantized_states import not_embeddings

FORMATS = ("8bit", "float8", "4bit")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    cfg = _model.Config()
    corpus = _data.load_corpus(0)
    params = _model.init_params(jax.random.PRNGKey(0), cfg)
    loss = functools.partial(_model.loss_fn, heads=cfg.heads)
    offsets = _data.batch_offsets(len(corpus.train), cfg.seq, cfg.batch, args.steps, 1)
    txs = {"float32": optim.adamw(1e-3, weight_decay=0.0)}
    for fmt in FORMATS:
        for rounding in ("stochastic", "nearest"):
            txs[(fmt, rounding)] = optim.adamw(
                1e-3,
                weight_decay=0.0,
                state_format=fmt,
                quantize_mask=not_embeddings,
                state_rounding=rounding,
            )
    states = {k: tx.init(params) for k, tx in txs.items()}
    updates = {k: jax.jit(tx.update) for k, tx in txs.items()}
    grad = jax.jit(jax.grad(loss))
    big = jax.tree.map(lambda x, m: bool(m and x.size >= 4096), params, not_embeddings(params))
    chosen = [b for b in jax.tree.leaves(big)]

    def sq_norm(u):
        return sum(float(jnp.sum(jnp.square(x))) for x, b in zip(jax.tree.leaves(u), chosen) if b)

    ratios = {k: [] for k in txs if k != "float32"}
    for i in range(args.steps):
        g = grad(params, *_data.windows(corpus.train, offsets[i], cfg.seq))
        us = {}
        for k in txs:
            us[k], states[k] = updates[k](g, states[k], params)
        ref = sq_norm(us["float32"])
        for k in ratios:
            ratios[k].append(np.sqrt(sq_norm(us[k]) / ref))
        params = optax.apply_updates(params, us["float32"])  # float32 AdamW's trajectory

    def inner(s):
        is_adam = lambda x: hasattr(x, "nu") and hasattr(x, "mu")
        return next(x for x in jax.tree.leaves(s, is_leaf=is_adam) if is_adam(x))

    ref_nu = jax.tree.leaves(inner(states["float32"]).nu)
    edges = [0, 50, 150, args.steps]
    cols = [f"steps {a + 1}-{b}" for a, b in zip(edges[:-1], edges[1:]) if b <= args.steps]
    print(
        f"Demo model, seed 0, lr 1e-3, {args.steps} steps on float32 AdamW's trajectory; "
        f"JAX {jax.__version__}. Update norm relative to float32 AdamW's (quantized "
        f"parameters only), and the median sqrt(nu) relative to float32 AdamW's at the end.\n"
    )
    print("| states | rounding | " + " | ".join(cols) + " | median sqrt(nu) |")
    print("|---|---|" + "---:|" * (len(cols) + 1))
    for (fmt, rounding), r in ratios.items():
        r = np.asarray(r)
        means = [r[a:b].mean() for a, b in zip(edges[:-1], edges[1:]) if b <= args.steps]
        codec = _quantized._codecs(fmt)[1]
        is_q = lambda x: isinstance(x, _quantized.QuantizedArray)
        qs = jax.tree.leaves(inner(states[(fmt, rounding)]).nu, is_leaf=is_q)
        rel = [
            np.sqrt(np.asarray(_quantized.dequantize(q, codec, v.shape)) / np.asarray(v)).ravel()
            for q, v in zip(qs, ref_nu)
            if is_q(q)
        ]
        med = float(np.nanmedian(np.concatenate(rel)))
        print(
            f"| {fmt} | {rounding} | " + " | ".join(f"{m:.3f}" for m in means) + f" | {med:.3f} |"
        )


if __name__ == "__main__":
    main()
