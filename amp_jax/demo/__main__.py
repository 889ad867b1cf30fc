"""A first look at amp: one MLP train step in float32 and under ``amp``.

Prints which primitives ran in which dtype (forward and backward) and how far
the bf16 loss and gradients are from float32. The full demo (a character-level
transformer trained in several precision modes) replaces this script.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from amp_jax import amp, dtype_report, format_dtype_report


def init_mlp(key: jax.Array, sizes: list[int]) -> list[tuple[jax.Array, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        (jax.random.normal(k, (a, b)) / np.sqrt(a), jnp.zeros((b,)))
        for k, a, b in zip(keys, sizes[:-1], sizes[1:])
    ]


def loss_fn(params, x, y):
    h = x
    for w, b in params[:-1]:
        h = jax.nn.gelu(h @ w + b)
    w, b = params[-1]
    logits = h @ w + b
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * y, axis=-1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="amp-jax-demo", description=__doc__)
    parser.add_argument("--width", type=int, default=256, help="hidden width (default 256)")
    parser.add_argument("--policy", default="bfloat16", help="amp policy (default bfloat16)")
    args = parser.parse_args(argv)
    if args.width < 1:
        parser.error("--width must be a positive integer")
    key = jax.random.PRNGKey(0)
    params = init_mlp(key, [64, args.width, args.width, 10])
    x = jax.random.normal(key, (32, 64))
    y = jax.nn.one_hot(jnp.arange(32) % 10, 10)
    try:
        amp_loss = amp(loss_fn, policy=args.policy)
    except ValueError as e:
        parser.error(str(e))
    step32 = jax.jit(jax.value_and_grad(loss_fn))
    step_amp = jax.jit(jax.value_and_grad(amp_loss))
    l32, g32 = step32(params, x, y)
    lamp, gamp = step_amp(params, x, y)
    print(f"amp_jax demo: one MLP train step, policy={args.policy!r}, JAX {jax.__version__} on {jax.default_backend()}")
    print("\nPrimitives of jax.value_and_grad(amp(loss)) and their dtypes:")
    print(format_dtype_report(dtype_report(jax.value_and_grad(amp_loss), params, x, y)))
    rel = max(
        float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-12))
        for a, b in zip(jax.tree.leaves(gamp), jax.tree.leaves(g32))
    )
    print(f"\nloss float32 {float(l32):.6f}  amp {float(lamp):.6f}")
    print(f"largest relative gradient difference vs float32: {rel:.2e}")
    print("gradient dtypes:", sorted({str(g.dtype) for g in jax.tree.leaves(gamp)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
