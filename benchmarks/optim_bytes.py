"""Bytes per parameter (weights + gradients + optimizer state) per scheme.

Measured with ``amp_jax.optim.state_bytes`` on the real state pytrees built by
each optimizer's ``init`` (abstractly, via ``jax.eval_shape``). Run::

    python -m benchmarks.optim_bytes

and paste the printed table into ``docs/optim.md`` (a test checks they match).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from amp_jax import optim

N_PARAMS = 1024 * 1024  # one 1024x1024 weight matrix


def _schemes():
    lr = 1e-3
    return [
        ("float32 AdamW", jnp.float32, lambda: optim.adamw(lr)),
        (
            "bf16 params + float32 master weights + float32 moments",
            jnp.bfloat16,
            lambda: optim.master_weights(optim.adamw(lr)),
        ),
        (
            "fp16 params + float32 master weights + float32 moments + dynamic loss scale",
            jnp.float16,
            lambda: optim.dynamic_loss_scale(optim.master_weights(optim.adamw(lr))),
        ),
        (
            "pure bf16 + Kahan (bf16 moments, bf16 compensation)",
            jnp.bfloat16,
            lambda: optim.adamw(lr, kahan=True),
        ),
        (
            "pure bf16 + stochastic rounding (bf16 moments)",
            jnp.bfloat16,
            lambda: optim.stochastic_rounding(optim.adamw(lr), 0),
        ),
        (
            "float32 params + bf16 moments (adamw mu_dtype/nu_dtype)",
            jnp.float32,
            lambda: optim.adamw(lr, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16),
        ),
        (
            "float32 params + 8-bit moments (adamw state_format='8bit')",
            jnp.float32,
            lambda: optim.adamw(lr, state_format="8bit"),
        ),
        (
            "float32 params + float8 moments (adamw state_format='float8')",
            jnp.float32,
            lambda: optim.adamw(lr, state_format="float8"),
        ),
        (
            "float32 params + 4-bit moments (adamw state_format='4bit')",
            jnp.float32,
            lambda: optim.adamw(lr, state_format="4bit"),
        ),
        (
            "pure bf16 + Kahan (bf16 compensation) + 8-bit moments",
            jnp.bfloat16,
            lambda: optim.adamw(lr, kahan=True, state_format="8bit"),
        ),
        (
            "pure bf16 + stochastic rounding + 8-bit moments",
            jnp.bfloat16,
            lambda: optim.stochastic_rounding(optim.adamw(lr, state_format="8bit"), 0),
        ),
        (
            "pure bf16 + stochastic rounding + 4-bit moments",
            jnp.bfloat16,
            lambda: optim.stochastic_rounding(optim.adamw(lr, state_format="4bit"), 0),
        ),
    ]


def rows(n_params: int = N_PARAMS) -> list[tuple[str, float, float, float]]:
    """(scheme, weight, gradient, state) bytes per parameter for each scheme."""
    out = []
    for name, dtype, make in _schemes():
        params = {"w": jax.ShapeDtypeStruct((n_params,), dtype)}
        grads = params  # gradients have the parameters' dtype
        state = jax.eval_shape(make().init, params)
        out.append(
            (
                name,
                optim.state_bytes(params) / n_params,
                optim.state_bytes(grads) / n_params,
                optim.state_bytes(state) / n_params,
            )
        )
    return out


def markdown_table(n_params: int = N_PARAMS) -> str:
    """The table as markdown (2 decimals; scalars such as counters included)."""
    lines = [
        "| scheme | weights | gradients | optimizer state | total bytes/param |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, w, g, s in rows(n_params):
        lines.append(f"| {name} | {w:.2f} | {g:.2f} | {s:.2f} | {w + g + s:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    """Prints the table (docs/optim.md's) and returns it."""
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    text = markdown_table()
    print(text)
    return text


if __name__ == "__main__":
    main()
