"""Float8 vs bfloat16 vs float32: loss and gradient errors on small models (CPU-quick).

    python -m benchmarks.float8_numerics            # prints the table (FLOAT8_NUMERICS.md)
    python -m benchmarks.float8_numerics --smoke    # the MLP only (CI)

Relative errors against the float32 model (``||g - g32|| / ||g32||`` over all
parameter gradients) for ``amp`` with the ``bfloat16``, ``float8`` and
``float8_rowwise`` policies, on an MLP and on the demo's GPT (its default
sizes, random tokens), at initialisation. Off Hopper/Ada GPUs the fp8 products
are emulated exactly (fp8 round trip + bf16 dot), so the numbers hold there too.
"""

from __future__ import annotations

import argparse
import datetime
import functools

import jax
import jax.numpy as jnp

from amp_jax import amp
from amp_jax.demo import _model

POLICIES = ("bfloat16", "float8", "float8_rowwise")


def _rel(a, b) -> float:
    num = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    den = sum(float(jnp.sum(y**2)) for y in jax.tree.leaves(b))
    return (num / den) ** 0.5


def mlp_case():
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    params = [jax.random.normal(k, (256, 256)) / 16 for k in keys[:3]]
    x = jax.random.normal(keys[3], (128, 256))

    def loss(params, x):
        for w in params:
            x = jax.nn.gelu(x @ w)
        return jnp.mean(x**2)

    return "MLP 3x256, batch 128", loss, (params, x)


def gpt_case():
    cfg = _model.Config(d_model=256, layers=2, heads=4, seq=64, batch=16)
    params = _model.init_params(jax.random.PRNGKey(0), cfg)
    toks = jax.random.randint(jax.random.PRNGKey(1), (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
    loss = functools.partial(_model.loss_fn, heads=cfg.heads)
    return "demo GPT d=256, 2 layers, seq 64, batch 16", loss, (params, toks[:, :-1], toks[:, 1:])


def main(argv: list[str] | None = None) -> str:
    """Prints the table and returns it as Markdown."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="the MLP only (CI)")
    args = p.parse_args(argv)
    lines = [
        f"JAX {jax.__version__} on {jax.default_backend()}, {datetime.date.today()}",
        "",
        "| model | policy | loss rel err | grad rel err |",
        "|---|---|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for name, loss, fargs in (mlp_case(),) if args.smoke else (mlp_case(), gpt_case()):
        l32, g32 = jax.jit(jax.value_and_grad(loss))(*fargs)
        for policy in POLICIES:
            l, g = jax.jit(jax.value_and_grad(amp(loss, policy=policy)))(*fargs)
            rel_l = abs(float(l - l32) / float(l32))
            lines.append(f"| {name} | {policy} | {rel_l:.2e} | {_rel(g, g32):.4f} |")
            print(lines[-1], flush=True)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
