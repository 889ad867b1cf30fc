"""Frozen study; its results: benchmarks/results/GPU_STUDIES.md, "Pure-bf16 train steps" (2026-11-22).

Why is a train step on pure-bf16 parameters slow on GPU? Variants side by side.

    python -m benchmarks.studies.pure_bf16 [--d-model 512 --layers 6 --seq 256 --batch 32]

The demo's model (``amp_jax.demo._model``), one jitted step
``params -> (loss, new params)`` per variant, medians in one process. The
variants isolate the parts: parameter dtype, amp, the optimizer, donation,
and where the embedding gather runs (its transpose is a scatter-add into the
``[vocab, d]`` table: in bfloat16 on a GPU, an atomic read-modify-write loop
per element with many tokens hitting the same rows). Prints a Markdown table
and, per variant, the scatter instructions of the optimized HLO with their
element type.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import optax

from amp_jax import amp, optim
from amp_jax.demo import _model

BF16, F32 = jnp.bfloat16, jnp.float32


def f32_gather(loss):
    """The loss with the embedding table read in float32 (gather, and its
    scatter-add transpose, in float32); the rest of the parameters as given."""

    def wrapped(params, *args):
        return loss({**params, "embed": params["embed"].astype(F32)}, *args)

    return wrapped


def step_fn(loss, tx, donate):
    def step(params, state, tokens, targets):
        value, grads = jax.value_and_grad(loss)(params, tokens, targets)
        updates, state = tx.update(grads, state, params)
        return value, optax.apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--heads", type=int, default=None, help="default: d_model // 64")
    args = p.parse_args(argv)
    heads = args.heads or max(args.d_model // 64, 1)
    cfg = _model.Config(
        d_model=args.d_model, layers=args.layers, heads=heads, seq=args.seq, batch=args.batch
    )
    loss = functools.partial(_model.loss_fn, heads=cfg.heads)
    params32 = _model.init_params(jax.random.key(0), cfg)
    params16 = jax.tree.map(lambda a: a.astype(BF16), params32)
    toks = jax.random.randint(jax.random.key(1), (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
    tokens, targets = toks[:, :-1], toks[:, 1:]
    sgd = optax.sgd(1e-3)
    kahan = optim.adamw(1e-3, mu_dtype=BF16, nu_dtype=BF16, kahan=True)
    from amp_jax.demo import _modes

    sched = _modes.schedule(1e-3, 300)  # the demo's warmup-cosine schedule
    kahan_sched = optim.adamw(sched, mu_dtype=BF16, nu_dtype=BF16, kahan=True)
    variants = {
        "f32 params, amp, adamw": (params32, amp(loss), optim.adamw(1e-3), True),
        "bf16 params, no amp, sgd": (params16, loss, sgd, True),
        "bf16 params, no amp, sgd, not donated": (params16, loss, sgd, False),
        "bf16 params, amp, sgd": (params16, amp(loss), sgd, True),
        "bf16 params, amp, adamw+kahan (demo bf16-kahan)": (params16, amp(loss), kahan, True),
        "bf16 params, no amp, sgd, f32 gather": (params16, f32_gather(loss), sgd, True),
        "bf16 params, amp, adamw+kahan, f32 gather": (params16, amp(f32_gather(loss)), kahan, True),
        "bf16 params, amp, adamw+kahan, demo schedule": (params16, amp(loss), kahan_sched, True),
        "f32 params, amp, adamw, demo schedule": (params32, amp(loss), optim.adamw(sched), True),
    }
    rows = []
    for name, (params, lfn, tx, donate) in variants.items():
        step = step_fn(lfn, tx, donate)
        copy = lambda t: jax.tree.map(jnp.copy, t)
        p, s = copy(params), tx.init(params)
        hlo = step.lower(p, s, tokens, targets).compile().as_text()
        scatters = sorted(set(re.findall(r"(\w+)\[[\d,]*\]\S* scatter\(", hlo)))
        for _ in range(3):
            _, p, s = step(p, s, tokens, targets)
        jax.block_until_ready(p)
        ts = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            _, p, s = step(p, s, tokens, targets)
            jax.block_until_ready(p)
            ts.append(time.perf_counter() - t0)
        rows.append((name, statistics.median(ts) * 1e3, ",".join(scatters) or "-"))
        print(f"{name}: {rows[-1][1]:.1f} ms, scatter types {rows[-1][2]}", flush=True)
    print(
        f"\n{jax.devices()[0].device_kind}, JAX {jax.__version__}, d={cfg.d_model}, heads={cfg.heads}, "
        f"layers={cfg.layers}, "
        f"seq={cfg.seq}, batch={cfg.batch}\n"
    )
    print("| variant | step ms | scatter element types |\n|---|---:|---|")
    for name, ms, sc in rows:
        print(f"| {name} | {ms:.1f} | {sc} |")


if __name__ == "__main__":
    main()
