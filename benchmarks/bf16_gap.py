"""Where does the bf16 validation-loss gap of the demo come from? Variants side by side.

    python benchmarks/bf16_gap.py [--steps 300 --d-model 512 --layers 6 --seq 256 --batch 32]

Trains the demo's model (``amp_jax.demo``) from the same initialisation on
the same batches in several precision variants and prints each final
validation loss and its gap to float32. Two of the variants switch an amp
feature off by monkeypatching (experiments, not user options):

* ``no-hoist``: scanned weights cast inside the loop, not once outside it
  (so each layer's weight gradient is not rounded to bf16 on its way out);
* ``f32-batched``: batched matmuls (attention scores and weighted sums)
  kept in float32, as on CPU.

Seeds: ``--seeds 0,1`` repeats f32 and amp-bf16 with another seed so that
the gap can be compared with seed-to-seed noise.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp  # noqa: E402

from amp_jax import Policy, optim  # noqa: E402
from amp_jax._src import interpreter, rules  # noqa: E402
from amp_jax.demo import _data, _model, _modes  # noqa: E402

BF16 = jnp.bfloat16


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def no_hoist():
    return patched(interpreter, "_plan_hoisted_casts", lambda ctx, eqn: None)


def f32_batched():
    return patched(rules, "_cpu_batched", lambda eqn: bool(eqn.params["dimension_numbers"][1][0]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seeds", default="0")
    p.add_argument("--only", default=None, help="comma-separated variant names")
    args = p.parse_args(argv)
    cfg = _model.Config(
        d_model=args.d_model,
        layers=args.layers,
        heads=max(args.d_model // 64, 1),
        seq=args.seq,
        batch=args.batch,
    )
    adamw = lambda lr: optim.adamw(lr)  # noqa: E731
    f32out = Policy(BF16, allow_outputs="float32")
    M = _modes.Mode
    variants = [
        ("f32", M("f32", "", None, jnp.float32, adamw), contextlib.nullcontext),
        ("amp-bf16", M("amp-bf16", "", "bfloat16", jnp.float32, adamw), contextlib.nullcontext),
        ("amp-bf16 f32-outputs", M("a", "", f32out, jnp.float32, adamw), contextlib.nullcontext),
        ("amp-bf16 no-hoist", M("a", "", "bfloat16", jnp.float32, adamw), no_hoist),
        ("amp-bf16 f32-batched", M("a", "", "bfloat16", jnp.float32, adamw), f32_batched),
        ("amp-bf16 f32-outputs no-hoist", M("a", "", f32out, jnp.float32, adamw), no_hoist),
        ("amp-f16", _modes.MODES["amp-f16"], contextlib.nullcontext),
    ]
    if args.only:
        keep = set(args.only.split(","))
        variants = [v for v in variants if v[0] in keep]
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for seed in seeds:
        corpus = _data.load_corpus(seed)
        for name, mode, ctx in variants:
            if seed != seeds[0] and name not in ("f32", "amp-bf16"):
                continue
            with ctx():
                r = _modes.train(
                    mode,
                    cfg,
                    corpus,
                    steps=args.steps,
                    lr=args.lr,
                    seed=seed,
                    eval_every=args.steps,
                    val_batches=8,
                )
            rows.append((seed, name, r.final_val_loss, r.median_step_s * 1e3))
            print(
                f"seed {seed} {name}: val {r.final_val_loss:.4f}, {rows[-1][3]:.1f} ms/step",
                flush=True,
            )
    base = {s: v for s, n, v, _ in rows if n == "f32"}
    print(
        f"\nd={cfg.d_model} layers={cfg.layers} seq={cfg.seq} batch={cfg.batch} steps={args.steps} "
        f"lr={args.lr}\n"
    )
    print("| seed | variant | val loss | vs f32 | ms/step |\n|---:|---|---:|---:|---:|")
    for seed, name, v, ms in rows:
        print(f"| {seed} | {name} | {v:.4f} | {100 * (v / base[seed] - 1):+.2f}% | {ms:.1f} |")


if __name__ == "__main__":
    main()
