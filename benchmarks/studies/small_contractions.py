"""Frozen study; its results: benchmarks/README.md, "Studies", small_contractions (2026-11-25).

Many small tensor-product-like contractions: amp's step time against float32.

A stand-in for an e3nn-jax message-passing network (e3nn-jax is not installed
here): node features as irreps blocks (multiplicity ``MUL`` of l = 0, 1, 2,
i.e. dimensions 1, 3, 5), per layer a channel-mixing linear per irrep and a
tensor product of every pair of irreps with a small Clebsch-Gordan-like
tensor, the products summed over edges with a ``segment_sum``. Most
contractions are small (a 5x5x5 coupling tensor, 16x16 channel mixing), a
few are larger.

Prints, in one process and on one machine, the jitted train step
(``value_and_grad``) of float32 and of ``amp`` (bfloat16), as medians, and
their ratio, with the count of contractions amp lowered and kept.

    python -m benchmarks.studies.small_contractions
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from amp_jax import amp, explain

MUL, NODES, EDGES, LAYERS = 16, 256, 2048, 3
DIMS = (1, 3, 5)


def _params(key):
    ps = []
    for _ in range(LAYERS):
        layer = {}
        for l1, d1 in enumerate(DIMS):
            key, k = jax.random.split(key)
            layer[f"lin{l1}"] = jax.random.normal(k, (MUL, MUL)) / np.sqrt(MUL)
            for l2, d2 in enumerate(DIMS):
                for l3, d3 in enumerate(DIMS):
                    if abs(l1 - l2) <= l3 <= l1 + l2:
                        key, k = jax.random.split(key)
                        cg = jax.random.normal(k, (d1, d2, d3)) / np.sqrt(d1 * d2)
                        layer[f"cg{l1}{l2}{l3}"] = cg
        ps.append(layer)
    return ps


def model(params, feats, sh, src, dst):
    """``feats``: per irrep (nodes, MUL, d); ``sh``: per irrep (edges, d)."""
    for layer in params:
        msgs = [0.0] * len(DIMS)
        for l1 in range(len(DIMS)):
            x = jnp.einsum("nud,uv->nvd", feats[l1], layer[f"lin{l1}"])[src]
            for l2 in range(len(DIMS)):
                for l3 in range(len(DIMS)):
                    cg = layer.get(f"cg{l1}{l2}{l3}")
                    if cg is not None:
                        msgs[l3] = msgs[l3] + jnp.einsum("eui,ej,ijk->euk", x, sh[l2], cg)
        feats = [f + jax.ops.segment_sum(m, dst, NODES) / 8.0 for f, m in zip(feats, msgs)]
        feats = [feats[0] * jax.nn.sigmoid(feats[0]), *feats[1:]]
    return sum(jnp.sum(f**2) for f in feats)


def _data(key):
    k = jax.random.split(key, 6)
    feats = [jax.random.normal(k[i], (NODES, MUL, d)) for i, d in enumerate(DIMS)]
    sh = [jax.random.normal(k[3 + i], (EDGES, d)) for i, d in enumerate(DIMS)]
    src = jax.random.randint(k[0], (EDGES,), 0, NODES)
    dst = jax.random.randint(k[1], (EDGES,), 0, NODES)
    return feats, sh, src, dst


def _time(fn, *args, reps=20):
    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main():
    params = _params(jax.random.key(0))
    data = _data(jax.random.key(1))
    f32 = jax.jit(jax.value_and_grad(model))
    low = jax.jit(jax.value_and_grad(amp(model)))
    t32, tlow = _time(f32, params, *data), _time(low, params, *data)
    t32b = _time(f32, params, *data)  # float32 again: the spread between two runs
    rows = explain(amp(model), params, *data).rows
    dots = [r for r in rows if r.primitive == "dot_general" and not r.backward]
    n_low = sum(r.count for r in dots if r.dtype != "float32")
    n_kept = sum(r.count for r in dots if r.dtype == "float32")
    print(f"jax {jax.__version__}, {jax.default_backend()}")
    print(f"float32 step {t32 * 1e3:.2f} ms (again: {t32b * 1e3:.2f} ms)")
    print(f"amp bf16 step {tlow * 1e3:.2f} ms: {tlow / t32:.2f}x float32")
    print(f"forward contractions: {n_low} lowered, {n_kept} kept float32")


if __name__ == "__main__":
    main()
