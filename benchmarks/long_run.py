"""Every optimizer recipe the docs recommend over a long run: a small transformer for 5,000 steps, 3 seeds.

    python -m benchmarks.long_run [--steps 5000 --seeds 0,1,2] [--stream-steps 10000]
    python -m benchmarks.long_run --smoke   # 2 recipes, 1 seed, 20 steps (CI); writes nothing

Short runs hide what accumulates: a bfloat16 second moment rounded to the
nearest value stops moving once ``(1 - b2) * g**2`` is below half its ulp
(after a few hundred steps), which a 400-step test never sees. Two parts:

* **The gradient stream** (the check of issue 49): one ``(64, 64)`` parameter,
  gradients ``0.01 * normal``, the optimizer beside ``optax.adamw(1e-3)`` for
  ``--stream-steps`` steps in one ``lax.scan`` under ``jit``: the median of
  ``sqrt(nu / nu_f32)`` at the end and the update norm over the last 100
  steps against float32 AdamW's, for every state dtype and format, rounded
  stochastically (the default) and to the nearest value. Then the same
  stream *applied* to a ``(64, 64)`` bfloat16 parameter (initialised
  ``normal``) with Kahan summation, stochastic rounding and master weights:
  the parameter's displacement against float32 AdamW's.
* **The model**: the demo's transformer at a size this CPU trains in
  minutes (``d_model=64``, 2 layers, 4 heads, seq 32, batch 4) for
  ``--steps`` steps (lr 3e-3, warmup + cosine to 3e-4), every seed of a recipe
  in one jitted ``vmap`` over a ``lax.scan``; each seed has its own data
  split, initialisation and batches (``amp_jax.demo``'s corpus). The final
  validation loss of each recipe beside float32 AdamW's of the same seed.

Writes ``LONG_RUN.md`` and ``long_run.json`` (the curves) into ``--out`` and
the validation curves to ``docs/images/long_run.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from amp_jax import optim
from amp_jax.demo import _data, _model, _modes
from amp_jax.optim import _quantized
from benchmarks.quantized_states import not_embeddings

HERE = os.path.dirname(os.path.abspath(__file__))
CFG = _model.Config(d_model=64, layers=2, heads=4, seq=32, batch=4)
SMOKE_CFG = _model.Config(d_model=32, layers=1, heads=2, seq=16, batch=2)


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    policy: str | None
    param_dtype: Any
    make_tx: Callable[[optax.Schedule], optax.GradientTransformation]
    loss_scaled: bool = False
    #: a control (the behaviour before a fix), not a recommendation
    control: bool = False


def _adamw(lr, **kw):
    return optim.adamw(lr, weight_decay=0.0, **kw)


def _q(fmt):
    return lambda lr: _adamw(lr, state_format=fmt, quantize_mask=not_embeddings)


BF16 = {"mu_dtype": jnp.bfloat16, "nu_dtype": jnp.bfloat16}

RECIPES: tuple[Recipe, ...] = (
    Recipe("float32", None, jnp.float32, _adamw),
    Recipe("amp bf16", "bfloat16", jnp.float32, _adamw),
    Recipe(
        "amp float16 + dynamic loss scale",
        "float16",
        jnp.float32,
        lambda lr: optim.dynamic_loss_scale(_adamw(lr)),
        loss_scaled=True,
    ),
    Recipe("bf16 params + Kahan (bf16 moments)", "bfloat16", jnp.bfloat16,
           lambda lr: _adamw(lr, kahan=True, **BF16)),
    Recipe("bf16 params + stochastic rounding (bf16 moments)", "bfloat16", jnp.bfloat16,
           lambda lr: optim.stochastic_rounding(_adamw(lr, **BF16), jax.random.key(0))),
    Recipe("bf16 params + float32 master weights", "bfloat16", jnp.bfloat16,
           lambda lr: optim.master_weights(_adamw(lr))),
    Recipe("8-bit states", None, jnp.float32, _q("8bit")),
    Recipe("4-bit states", None, jnp.float32, _q("4bit")),
    Recipe("float8 states", None, jnp.float32, _q("float8")),
    Recipe("bf16 moments", None, jnp.float32, lambda lr: _adamw(lr, **BF16)),
    Recipe("bf16 moments, nearest (before)", None, jnp.float32,
           lambda lr: _adamw(lr, state_rounding="nearest", **BF16), control=True),
    Recipe("bf16 params + Kahan (bf16 moments), nearest (before)", "bfloat16", jnp.bfloat16,
           lambda lr: _adamw(lr, kahan=True, state_rounding="nearest", **BF16), control=True),
)  # fmt: skip


# -- the gradient stream ------------------------------------------------------------


def _adam_state(state):
    """The Adam scaling state inside an ``adamw`` state (chain, Kahan)."""
    return state.inner_state[0] if hasattr(state, "inner_state") else state[0]


def _nu(state, fmt, shape):
    return _nu_leaf(_adam_state(state).nu["w"], fmt, shape)


def _nu_leaf(nu, fmt, shape):
    """One ``nu`` leaf as float64, dequantized if it is quantized."""
    if isinstance(nu, _quantized.QuantizedArray):
        nu = _quantized.dequantize(nu, _quantized._codecs(fmt)[1], shape)
    return np.asarray(nu, np.float64)


def stream(tx, fmt=None, steps=10_000, shape=(64, 64)):
    """(median ``sqrt(nu / nu_f32)``, update norm / float32 AdamW's over the
    last 100 steps) after ``steps`` steps of gradients ``0.01 * normal`` (the
    parameter is not moved: only the states are compared)."""
    p = {"w": jnp.zeros(shape)}
    ref = optax.adamw(1e-3)

    def body(carry, k):
        g = {"w": 0.01 * jax.random.normal(k, shape)}
        u, s = tx.update(g, carry[0], p)
        uf, sf = ref.update(g, carry[1], p)
        return (s, sf), jnp.linalg.norm(u["w"]) / jnp.linalg.norm(uf["w"])

    keys = jax.random.split(jax.random.key(0), steps)
    (s, sf), ratio = jax.jit(lambda: jax.lax.scan(body, (tx.init(p), ref.init(p)), keys))()
    nu_ratio = _nu(s, fmt, shape) / np.asarray(sf[0].nu["w"], np.float64)
    return float(np.median(np.sqrt(nu_ratio))), float(np.mean(np.asarray(ratio)[-100:]))


def applied_stream(tx, steps=10_000, shape=(64, 64)):
    """The stream applied to a bfloat16 parameter (``normal`` at the start):
    (displacement norm / float32 AdamW's, distance between the two
    displacements / float32's). With Kahan summation the parameter is read
    as ``p + compensation``, the value the compensation tracks."""
    p0 = jax.random.normal(jax.random.key(1), shape)
    ref = optax.adamw(1e-3)

    def body(carry, k):
        p, s, pf, sf = carry
        g = 0.01 * jax.random.normal(k, shape)
        u, s = tx.update({"w": g.astype(p["w"].dtype)}, s, p)
        uf, sf = ref.update({"w": g}, sf, pf)
        return (optax.apply_updates(p, u), s, optax.apply_updates(pf, uf), sf), None

    p = {"w": p0.astype(jnp.bfloat16)}
    pf = {"w": p0}
    keys = jax.random.split(jax.random.key(0), steps)
    go = jax.jit(lambda: jax.lax.scan(body, (p, tx.init(p), pf, ref.init(pf)), keys)[0])
    p, s, pf, _ = go()
    w = np.asarray(p["w"], np.float64)
    if hasattr(s, "compensation"):
        w = w + np.asarray(s.compensation["w"], np.float64)
    d, df = w - np.asarray(p0.astype(jnp.bfloat16), np.float64), np.asarray(pf["w"] - p0)
    return float(np.linalg.norm(d) / np.linalg.norm(df)), float(
        np.linalg.norm(d - df) / np.linalg.norm(df)
    )


def stream_cases():
    """(name, state format or None, optimizer) for the stream, both roundings."""
    cases = []
    for rounding in ("stochastic", "nearest"):
        for name, kw in (
            ("bf16 mu + nu", BF16),
            ("bf16 nu", {"nu_dtype": jnp.bfloat16}),
            ("bf16 mu", {"mu_dtype": jnp.bfloat16}),
            ("float16 mu", {"mu_dtype": jnp.float16}),
        ):
            cases.append((name, rounding, None, optim.adamw(1e-3, state_rounding=rounding, **kw)))
        for fmt in ("8bit", "4bit", "float8"):
            tx = optim.adamw(1e-3, state_format=fmt, state_rounding=rounding)
            cases.append((fmt, rounding, fmt, tx))
    return cases


def applied_cases():
    return [
        ("Kahan, bf16 moments + bf16 compensation", optim.adamw(1e-3, kahan=True, **BF16)),
        (
            "Kahan, bf16 moments (nearest) + bf16 compensation",
            optim.adamw(1e-3, kahan=True, state_rounding="nearest", **BF16),
        ),
        (
            "Kahan, bf16 moments + float32 compensation",
            optim.adamw(1e-3, kahan=True, compensation_dtype=jnp.float32, **BF16),
        ),
        ("stochastic rounding, bf16 moments", optim.stochastic_rounding(
            optim.adamw(1e-3, **BF16), jax.random.key(0))),
        ("master weights (float32 moments)", optim.master_weights(optim.adamw(1e-3))),
        ("plain bf16 params, bf16 moments", optim.adamw(1e-3, **BF16)),
    ]  # fmt: skip


def model_stream_cases():
    """(name, rounding, state format or None, optimizer) for the model's stream:
    every state dtype and format (the embeddings' moments in float32, as
    recommended), and the nearest-rounding controls of the ones that stall."""
    cases = [
        ("bf16 mu + nu", "stochastic", None, optim.adamw(1e-3, **BF16)),
        ("float16 mu", "stochastic", None, optim.adamw(1e-3, mu_dtype=jnp.float16)),
    ]
    q = {"quantize_mask": not_embeddings}  # as docs/optim.md recommends
    cases += [
        (f, "stochastic", f, optim.adamw(1e-3, state_format=f, **q)) for f in _quantized.FORMATS
    ]
    cases.append(
        ("bf16 mu + nu", "nearest", None, optim.adamw(1e-3, state_rounding="nearest", **BF16))
    )
    cases.append(
        (
            "float16 mu",
            "nearest",
            None,
            optim.adamw(1e-3, state_rounding="nearest", mu_dtype=jnp.float16),
        )
    )
    cases += [
        (f, "nearest", f, optim.adamw(1e-3, state_format=f, state_rounding="nearest", **q))
        for f in _quantized.FORMATS
    ]
    return cases


def model_stream(cases, cfg, steps, seed=0, lr=1e-3):
    """The gradients of a real model: the demo transformer trained by float32
    AdamW for ``steps`` steps (one ``lax.scan`` under ``jit``), and every
    optimizer of ``cases`` handed the same gradients, its updates compared
    and not applied (its states follow float32's trajectory, so they can be
    compared element by element). Per case: (median ``sqrt(nu / nu_f32)``
    over the elements stored in low precision where ``nu_f32 > 0``, the global
    update norm over float32 AdamW's averaged over the last 100 steps)."""
    corpus = _data.load_corpus(seed)
    off = _data.batch_offsets(len(corpus.train), cfg.seq, cfg.batch, steps, seed + 1)
    batches = [_data.windows(corpus.train, o, cfg.seq) for o in off]
    xs = jnp.asarray(np.stack([x for x, _ in batches]), jnp.int32)
    ys = jnp.asarray(np.stack([y for _, y in batches]), jnp.int32)
    loss = functools.partial(_model.loss_fn, heads=cfg.heads)
    params = _model.init_params(jax.random.PRNGKey(seed), cfg)
    ref = optax.adamw(lr, weight_decay=0.0)
    txs = [tx for *_, tx in cases]

    def body(carry, batch):
        p, sf, ss = carry
        g = jax.grad(loss)(p, *batch)
        uf, sf = ref.update(g, sf, p)
        norm_f = _norm(uf)
        ratios, new = [], []
        for tx, s in zip(txs, ss):
            u, s = tx.update(g, s, p)
            ratios.append(_norm(u) / norm_f)
            new.append(s)
        return (optax.apply_updates(p, uf), sf, tuple(new)), jnp.stack(ratios)

    init = (params, ref.init(params), tuple(tx.init(params) for tx in txs))
    (p, sf, ss), ratios = jax.jit(lambda c: jax.lax.scan(body, c, (xs, ys)))(init)
    ratios = np.asarray(ratios)
    out = []
    for i, ((_, _, fmt, _), s) in enumerate(zip(cases, ss)):
        nu, nu_f = _adam_state(s).nu, sf[0].nu
        pairs = [  # the leaves stored in low precision (not the ones kept in float32)
            (_nu_leaf(q, fmt, np.shape(f)).ravel(), np.asarray(f, np.float64).ravel())
            for q, f in zip(jax.tree.leaves(nu, is_leaf=_is_quantized), jax.tree.leaves(nu_f))
            if _is_quantized(q) or q.dtype != jnp.float32
        ]
        r = np.concatenate([q[f > 0] / f[f > 0] for q, f in pairs] or [np.zeros(0)])
        median = float(np.median(np.sqrt(r))) if r.size else float("nan")  # nu in float32
        out.append((median, float(np.mean(ratios[-100:, i]))))
    return out


def _norm(tree):
    """The global L2 norm of a pytree (optax renamed its helper between versions)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def _is_quantized(x):
    return isinstance(x, _quantized.QuantizedArray)


def model_stream_table(steps, cfg, smoke=False):
    cases = model_stream_cases()[: 2 if smoke else None]
    n = sum(x.size for x in jax.tree.leaves(_model.init_params(jax.random.key(0), cfg)))
    lines = [
        f"The gradients of a real model, {steps} steps: the demo transformer ({n} parameters) "
        "trained by float32 AdamW (lr 1e-3, seed 0), each optimizer below handed the same "
        "gradients at every step (its updates compared, not applied). Median over every "
        "element whose nu is stored in low precision; update norm is the global norm over float32 AdamW's, "
        "averaged over the last 100 steps. Quantized formats keep the embeddings' and the "
        "parameters under 4,096 elements' moments in float32, as docs/optim.md recommends.",
        "",
        "| states | rounding | median sqrt(nu / nu_f32) | update norm / float32's |",
        "|---|---|---:|---:|",
    ]
    for (name, rounding, _, _), (r, u) in zip(cases, model_stream(cases, cfg, steps)):
        lines.append(f"| {name} | {rounding} | {'-' if np.isnan(r) else f'{r:.4f}'} | {u:.4f} |")
    print("\n".join(lines[-len(cases) :]), flush=True)
    return lines


def stream_tables(steps, smoke=False):
    lines = [
        f"Gradient stream, {steps} steps: one (64, 64) parameter, gradients `0.01 * normal`, "
        "beside `optax.adamw(1e-3)` on the same gradients (one `lax.scan` under `jit`).",
        "",
        "| states | rounding | median sqrt(nu / nu_f32) | update norm / float32's |",
        "|---|---|---:|---:|",
    ]
    for name, rounding, fmt, tx in stream_cases()[: 2 if smoke else None]:
        r, u = stream(tx, fmt, steps)
        lines.append(f"| {name} | {rounding} | {r:.4f} | {u:.4f} |")
        print(lines[-1], flush=True)
    lines += [
        "",
        f"The same stream applied for {steps} steps to a (64, 64) bfloat16 parameter "
        "(initialised `normal`), beside float32 AdamW on the float32 parameter: the "
        "displacement from the start (Kahan: of `p + compensation`).",
        "",
        "| recipe | displacement / float32's | distance to float32's / its norm |",
        "|---|---:|---:|",
    ]
    for name, tx in applied_cases()[: 1 if smoke else None]:
        r, e = applied_stream(tx, steps)
        lines.append(f"| {name} | {r:.4f} | {e:.4f} |")
        print(lines[-1], flush=True)
    return lines


# -- the model ----------------------------------------------------------------------


@dataclasses.dataclass
class Curves:
    name: str
    val_steps: list[int]
    val_loss: list[list[float]]  # [seed][eval]
    train_loss: list[list[float]]  # [seed][chunk]: mean over the chunk
    seconds: float
    state_bytes_per_param: float


def _seed_data(seeds, cfg, steps, val_batches):
    xs, ys, xv, yv = [], [], [], []
    for seed in seeds:
        corpus = _data.load_corpus(seed)
        off = _data.batch_offsets(len(corpus.train), cfg.seq, cfg.batch, steps, seed + 1)
        voff = _data.batch_offsets(len(corpus.val), cfg.seq, cfg.batch, val_batches, seed + 2)
        tr = [_data.windows(corpus.train, o, cfg.seq) for o in off]
        va = [_data.windows(corpus.val, o, cfg.seq) for o in voff]
        xs.append(np.stack([x for x, _ in tr]))
        ys.append(np.stack([y for _, y in tr]))
        xv.append(np.stack([x for x, _ in va]))
        yv.append(np.stack([y for _, y in va]))
    return tuple(jnp.asarray(np.stack(a), jnp.int32) for a in (xs, ys, xv, yv))


def train(recipe, cfg, seeds, steps, lr, chunk, data):
    """Every seed of ``recipe`` in one jitted vmap over a scan of ``chunk`` steps."""
    xs, ys, xv, yv = data
    mode = _modes.Mode(recipe.name, recipe.name, recipe.policy, recipe.param_dtype, None)
    loss = _modes.mode_loss(mode, cfg)
    tx = recipe.make_tx(_modes.schedule(lr, steps))
    keys = jnp.stack([jax.random.PRNGKey(s) for s in seeds])
    params = jax.vmap(
        lambda k: jax.tree.map(lambda p: p.astype(recipe.param_dtype), _model.init_params(k, cfg))
    )(keys)
    state = jax.vmap(tx.init)(params)

    def step(carry, batch):
        p, s = carry
        if recipe.loss_scaled:
            value, grads = optim.scaled_value_and_grad(loss, s)(p, *batch)
        else:
            value, grads = jax.value_and_grad(loss)(p, *batch)
        u, s = tx.update(grads, s, p)
        return (optax.apply_updates(p, u), s), value

    def run_chunk(p, s, x, y):
        (p, s), values = jax.lax.scan(step, (p, s), (x, y))
        return p, s, jnp.mean(values)

    def evaluate(p, x, y):
        return jnp.mean(jax.lax.map(lambda b: loss(p, *b), (x, y)))

    run_chunk = jax.jit(jax.vmap(run_chunk), donate_argnums=(0, 1))
    evaluate = jax.jit(jax.vmap(evaluate))
    n_params = sum(x.size for x in jax.tree.leaves(params)) // len(seeds)
    per_param = optim.state_bytes(state) / len(seeds) / n_params
    out = Curves(recipe.name, [], [[] for _ in seeds], [[] for _ in seeds], 0.0, per_param)
    t0 = time.perf_counter()
    for start in range(0, steps, chunk):
        sl = slice(start, start + chunk)
        params, state, tl = run_chunk(params, state, xs[:, sl], ys[:, sl])
        vl = np.asarray(evaluate(params, xv, yv))
        out.val_steps.append(min(start + chunk, steps))
        for i in range(len(seeds)):
            out.val_loss[i].append(float(vl[i]))
            out.train_loss[i].append(float(tl[i]))
    out.seconds = time.perf_counter() - t0
    return out


def model_table(runs, seeds):
    base = next(r for r in runs if r.name == "float32")
    f32 = np.array([v[-1] for v in base.val_loss])
    spread = f32.max() - f32.min()
    lines = [
        "| recipe | final val loss, mean over seeds | vs float32 (same seed): mean (min, max) "
        "| within float32's seed spread or 1% | state bytes/param | seconds |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for r in runs:
        final = np.array([v[-1] for v in r.val_loss])
        gaps = 100 * (final / f32 - 1)
        ok = abs(final.mean() - f32.mean()) <= max(spread, 0.01 * f32.mean())
        verdict = "-" if r is base else ("yes" if ok else "**no**")
        lines.append(
            f"| {r.name} | {final.mean():.4f} | {gaps.mean():+.2f}% ({gaps.min():+.2f}, "
            f"{gaps.max():+.2f}) | {verdict} | {r.state_bytes_per_param:.2f} | {r.seconds:.0f} |"
        )
    lines += [
        "",
        f"float32 AdamW ends at {f32.min():.4f}-{f32.max():.4f} over seeds "
        f"{', '.join(map(str, seeds))} (spread {spread:.4f}, "
        f"{100 * spread / f32.mean():.2f}% of the mean).",
    ]
    return lines


def plot(runs, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(9, 5))
    for r in runs:
        mean = np.mean(np.array(r.val_loss), axis=0)
        style = ":" if "before" in r.name else "-"
        ax.plot(r.val_steps, mean, style, label=r.name, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (mean over seeds)")
    last = [np.mean(np.array(r.val_loss), axis=0) for r in runs]
    lo = min(v[-1] for v in last)
    ax.set_ylim(lo - 0.05, min(max(v[len(v) // 10] for v in last), lo + 1.0))
    ax.legend(fontsize=7)
    ax.set_title("Long run: every recipe against float32 AdamW")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _header(args, cfg, n_params):
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    return (
        f"Written by `python -m benchmarks.long_run`; {time.strftime('%Y-%m-%d', time.gmtime())}, "
        f"JAX {jax.__version__}, optax {optax.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()} CPU, {os.cpu_count()} cores (shared; load average at the end "
        f"{load}). Model: the demo transformer at d_model={cfg.d_model}, layers={cfg.layers}, "
        f"heads={cfg.heads}, seq={cfg.seq}, batch={cfg.batch} ({n_params} parameters), "
        f"{args.steps} steps, lr {args.lr} (warmup + cosine to a tenth), no weight decay, "
        f"seeds {args.seeds}; validation loss on {args.val_batches} batches per seed. "
        "Quantized states keep the embeddings' moments in float32 (`quantize_mask`)."
    )


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--chunk", type=int, default=250, help="steps between evaluations")
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--stream-steps", type=int, default=10_000)
    p.add_argument("--model-stream-steps", type=int, default=10_000, help="0: no real-model stream")
    p.add_argument("--only", default=None, help="comma-separated recipe names")
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--no-model", action="store_true")
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the recipes of --out's long_run.json that this run does not train",
    )
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--smoke", action="store_true", help="2 recipes, 1 seed, 20 steps; no files")
    args = p.parse_args(argv)
    cfg, recipes = CFG, list(RECIPES)
    if args.smoke:
        cfg, recipes = SMOKE_CFG, recipes[:1] + recipes[3:4]
        args.steps, args.seeds, args.chunk, args.val_batches = 20, "0", 10, 2
        args.stream_steps = args.model_stream_steps = 50
    if args.only:
        by_name = {r.name: r for r in RECIPES}
        recipes = [by_name[n] for n in args.only.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    lines = []
    if not args.no_stream:
        lines += stream_tables(args.stream_steps, smoke=args.smoke) + [""]
        if args.model_stream_steps:
            lines += model_stream_table(args.model_stream_steps, cfg, smoke=args.smoke) + [""]
    if args.no_model:
        if not args.merge:
            return write(args, lines, [])
        recipes = []  # the model table as it was (--merge)
    data = _seed_data(seeds, cfg, args.steps, args.val_batches)
    n_params = sum(x.size for x in jax.tree.leaves(_model.init_params(jax.random.key(0), cfg)))
    kept = _kept_runs(args.out) if args.merge else {}
    runs: dict[str, Curves] = {}
    text = ""
    for recipe in recipes or [None]:  # the results so far are written after every recipe
        if recipe is not None:
            runs[recipe.name] = train(recipe, cfg, seeds, args.steps, args.lr, args.chunk, data)
            print(f"{recipe.name}: {[v[-1] for v in runs[recipe.name].val_loss]}", flush=True)
        done = [runs.get(r.name, kept.get(r.name)) for r in RECIPES]
        done = [r for r in done if r is not None]
        merged = [  # (--merge)
            f"Trained in this invocation: {', '.join(runs) or 'no recipe'}; the other "
            "recipes are kept from the previous run (`--merge`).",
            "",
        ]
        head = [_header(args, cfg, n_params), ""] + lines + (merged if kept else [])
        text = write(args, head + model_table(done, seeds), done)
    return text


def _kept_runs(out):
    """The runs of ``out``'s long_run.json, by recipe name."""
    with open(os.path.join(out, "long_run.json")) as f:
        return {d["name"]: Curves(**d) for d in json.load(f)}


def write(args, lines, runs):
    """Writes LONG_RUN.md, the curves and the plot (not for ``--smoke``); returns the text."""
    text = "\n".join(lines)
    print(text)
    if args.smoke:
        return text
    with open(os.path.join(args.out, "LONG_RUN.md"), "w") as f:
        f.write("# Long runs: every recipe over 5,000 steps\n\n" + text + "\n")
    if runs:
        with open(os.path.join(args.out, "long_run.json"), "w") as f:
            json.dump([dataclasses.asdict(r) for r in runs], f)
        plot(runs, os.path.join(HERE, "..", "docs", "images", "long_run.png"))
    return text


if __name__ == "__main__":
    main()
