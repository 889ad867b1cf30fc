"""When does a bf16 matmul pay? Small dots, float32 vs bf16 operands, side by side.

    python benchmarks/dot_thresholds.py [--reps 200]

For each shape ``[m, k] @ [k, n]`` (and the vector cases), one jitted
function computes ``reps`` independent products in a ``lax.scan`` (so that
launch overhead is paid once), once in float32 and once with the operands
cast to bf16 inside (float32 accumulation, the form amp emits). Prints a
Markdown table of the per-product times and their ratio; amp's defaults
(``Policy.min_low_contraction=8``, ``min_low_flops=1024``) keep the rows
above the line in float32.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

SHAPES = [  # (m, k, n): vector-vector, matrix-vector, tiny, small contractions, medium
    (1, 32, 1),
    (1, 7, 32),
    (32, 32, 1),
    (8, 7, 32),
    (16, 4, 16),
    (32, 8, 32),
    (64, 16, 64),
    (128, 32, 128),
    (256, 64, 256),
    (512, 512, 512),
    (1024, 1024, 1024),
]


def _time(f, *args, rounds=7):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args(argv)
    print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}\n")
    print(
        "| m x k x n | FLOPs | f32 us | bf16 operands us | bf16 / f32 |\n|---|---:|---:|---:|---:|"
    )
    for m, k, n in SHAPES:
        reps = args.reps if m * k * n < 2**24 else 4
        a = jax.random.normal(jax.random.PRNGKey(0), (reps, m, k))
        b = jax.random.normal(jax.random.PRNGKey(1), (reps, k, n))

        def many(a, b, low):
            def body(c, ab):
                x, y = ab
                if low:
                    x, y = x.astype(jnp.bfloat16), y.astype(jnp.bfloat16)
                return c + jnp.sum(lax.dot(x, y, preferred_element_type=jnp.float32)), None

            return lax.scan(body, jnp.float32(0), (a, b))[0]

        f32 = _time(jax.jit(lambda a, b: many(a, b, False)), a, b) / reps
        bf = _time(jax.jit(lambda a, b: many(a, b, True)), a, b) / reps
        print(
            f"| {m}x{k}x{n} | {2 * m * k * n} | {f32 * 1e6:.2f} | {bf * 1e6:.2f} | {bf / f32:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
