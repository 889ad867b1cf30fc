"""Frozen study; its results: benchmarks/README.md, "Studies", e3nn_message_passing (2026-11-27).

Its step times are printed twice: wall clock, and CPU time (which moves far
less on a shared machine; run it pinned to one core so the CPU time is the
step's work).

e3nn-jax's own ``MessagePassingConvolutionFlax`` (three layers, 200 nodes,
1,652 edges, irreps 32x0e + 16x1o + 8x2e, spherical harmonics to l=3): is
amp's train step slower than float32's on this CPU, and would a larger size
threshold (``Policy.min_low_contraction`` / ``min_low_flops``) help? Prints
each variant's gradient error against float32 and its step time against
float32's (minimum and median of interleaved rounds, one process). Needs
``e3nn-jax`` (the ``integrations`` extra).

    taskset -c 0 python -m benchmarks.studies.e3nn_message_passing [ROUNDS]
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from amp_jax import Policy, amp

VARIANTS = {
    "k17": {"min_low_contraction": 17},
    "k33": {"min_low_contraction": 33},
    "fl1M": {"min_low_flops": 10**6},
    "fl4M": {"min_low_flops": 4 * 10**6},
}


def main(rounds: int) -> None:
    # (imported here: e3nn-jax is in the integrations extra, and warns at import)
    import e3nn_jax as e3nn
    import flax.linen as nn
    from e3nn_jax.experimental.point_convolution import (
        MessagePassingConvolutionFlax,
        radial_basis,
    )

    irreps = e3nn.Irreps("32x0e + 16x1o + 8x2e")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, pos, feats, senders, receivers):
            vec = e3nn.IrrepsArray("1o", pos)
            h = feats
            for _ in range(3):
                h = MessagePassingConvolutionFlax(
                    irreps, radial_basis=lambda r: radial_basis(r, 2.5, 8), avg_num_neighbors=8.0
                )(vec, h, senders, receivers)
                h = e3nn.flax.Linear(irreps)(e3nn.gate(h))
            return h

    k = jax.random.split(jax.random.key(0), 5)
    n_nodes, n_edges = 200, 1652
    pos = jax.random.normal(k[0], (n_nodes, 3)) * 2
    senders = jax.random.randint(k[1], (n_edges,), 0, n_nodes)
    receivers = jax.random.randint(k[2], (n_edges,), 0, n_nodes)
    feats = e3nn.normal(irreps, k[3], (n_nodes,))
    model = Model()
    params = model.init(k[4], pos, feats, senders, receivers)

    def loss(params, pos, feats):
        out = model.apply(params, pos, e3nn.IrrepsArray(irreps, feats), senders, receivers)
        return jnp.mean(out.array**2)

    steps = {
        "f32": jax.jit(jax.value_and_grad(loss)),
        "amp": jax.jit(jax.value_and_grad(amp(loss))),
    }
    for name, kw in VARIANTS.items():
        pol = Policy(jnp.bfloat16, **kw)
        steps[name] = jax.jit(jax.value_and_grad(amp(loss, policy=pol)))
    args = (params, pos, feats.array)
    _, ref = steps["f32"](*args)
    den = sum(float(jnp.sum(a**2)) for a in jax.tree.leaves(ref))
    for name, fn in steps.items():
        _, g = fn(*args)
        num = sum(
            float(jnp.sum((a - b) ** 2)) for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(g))
        )
        print(f"{name}: gradient {100 * (num / den) ** 0.5:.1f}% off float32's")
    times: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            t, c = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    for label, found in (("wall", times), ("CPU time", cpu)):
        low = {n: min(t) for n, t in found.items()}
        mid = {n: float(np.median(t)) for n, t in found.items()}
        for name in steps:
            print(
                f"{name}: {label} step / float32's {low[name] / low['f32']:.3f} (minimum), "
                f"{mid[name] / mid['f32']:.3f} (median)"
            )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
