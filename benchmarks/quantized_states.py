"""8-bit, float8 and 4-bit AdamW states on the demo model: loss curves and step time.

    python -m benchmarks.quantized_states [--steps 1000 --seeds 0] [--out benchmarks]
    python -m benchmarks.quantized_states --smoke --out /tmp/q   # 2 variants, 2 steps (CI)

Trains the demo's model (``amp_jax.demo``, default size, float32 parameters
and compute) from the same initialisation on the same batches with float32
AdamW and with ``optim.adamw(state_format=...)`` for each format (the token
and position embeddings keep float32 moments via ``quantize_mask``, as
Dettmers et al. prescribe), and writes

* ``QUANTIZED_STATES.md``: final validation loss and its gap to float32
  AdamW, state bytes per parameter, the demo's median train-step time, and
  the optimizer update alone timed against bf16-state AdamW;
* ``quantized_states.json``: the curves (train and validation loss);
* ``quantized_states.png``: the validation curves (when matplotlib is there).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from amp_jax import optim
from amp_jax.demo import _data, _model, _modes

EMBEDDINGS = ("embed", "pos")


def not_embeddings(params):
    """quantize_mask: every parameter except the token/position embeddings."""

    def keep(path, _):
        return not any(getattr(k, "key", None) in EMBEDDINGS for k in path)

    return jax.tree_util.tree_map_with_path(keep, params)


def variants():
    """(name, tx factory taking the learning-rate schedule)."""
    q = lambda fmt, rounding="stochastic": (
        lambda lr: optim.adamw(
            lr,
            weight_decay=0.0,
            state_format=fmt,
            quantize_mask=not_embeddings,
            state_rounding=rounding,
        )
    )
    return [
        ("float32 AdamW", lambda lr: optim.adamw(lr, weight_decay=0.0)),
        ("8bit", q("8bit")),
        ("float8", q("float8")),
        ("4bit", q("4bit")),
        ("8bit nearest", q("8bit", "nearest")),
        ("float8 nearest", q("float8", "nearest")),
        ("4bit nearest", q("4bit", "nearest")),
        (
            "8bit, embeddings quantized too",
            lambda lr: optim.adamw(lr, weight_decay=0.0, state_format="8bit"),
        ),
    ]


def _median_ms(fn, *args, reps=30):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return 1e3 * float(np.median(ts))


def update_times(params, reps=30):
    """Median ms of ``jit(update + apply_updates)`` per format, bf16-state AdamW first."""
    txs = [("bf16-state AdamW", optim.adamw(1e-3, mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16))]
    txs += [(f, optim.adamw(1e-3, state_format=f)) for f in ("8bit", "float8", "4bit")]
    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(1), p.shape, p.dtype), params)
    out = []
    for name, tx in txs:

        def step(p, s, g, tx=tx):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        out.append((name, _median_ms(jax.jit(step), params, tx.init(params), grads, reps=reps)))
    return out


def main(argv=None) -> str:
    """Trains and writes QUANTIZED_STATES.md, its curves and plot into ``--out``;
    returns the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seeds", default="0")
    p.add_argument("--only", default=None, help="comma-separated variant names (see variants())")
    p.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    )
    p.add_argument("--no-timing", action="store_true", help="skip the update timings")
    p.add_argument(
        "--timing-only",
        action="store_true",
        help="only print the update-timing table (no training)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="2 variants, a tiny model, 2 steps, no timings (CI; give --out)",
    )
    args = p.parse_args(argv)
    if args.timing_only:
        text = "\n".join(timing_table(timings(_model.Config())))
        print(text)
        return text
    cfg = _model.Config()
    chosen = variants()
    if args.smoke:
        args.steps, args.no_timing, chosen = 2, True, chosen[:2]
        cfg = _model.Config(d_model=64, layers=1, seq=32, batch=4)
    if args.only:  # in the order given
        by_name = dict(chosen)
        chosen = [(n, by_name[n]) for n in args.only.split(",")]
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        corpus = _data.load_corpus(seed)
        for name, make_tx in chosen:
            mode = _modes.Mode(name, name, None, jnp.float32, make_tx)
            r = _modes.train(
                mode,
                cfg,
                corpus,
                steps=args.steps,
                lr=args.lr,
                seed=seed,
                eval_every=max(args.steps // 20, 1),
                val_batches=8,
            )
            runs.append((seed, name, r))
            print(
                f"seed {seed} {name}: val {r.final_val_loss:.4f}, "
                f"{r.median_step_s * 1e3:.2f} ms/step, state {r.opt_state_bytes} B",
                flush=True,
            )
            write(args, cfg, runs, {})  # after every run: a long run keeps what it has
    return write(args, cfg, runs, {} if args.no_timing else timings(cfg))


def timings(cfg):
    """``update_times`` on the demo's parameters and on one 2048x2048 matrix."""
    params = _model.init_params(jax.random.PRNGKey(0), cfg)
    big = {"w": jax.random.normal(jax.random.key(0), (2048, 2048))}
    return {"demo": update_times(params), "2048x2048": update_times(big)}


def _device() -> str:
    """The device the timings ran on: ``x86_64 CPU`` or, say, ``gpu NVIDIA H100 80GB HBM3``."""
    d = jax.devices()[0]
    return f"{platform.machine()} CPU" if d.platform == "cpu" else f"{d.platform} {d.device_kind}"


def timing_table(times):
    """Markdown lines of the update-timing table, with where it was measured."""
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    lines = [
        "Optimizer update alone (`jit(tx.update + optax.apply_updates)`, float32 "
        f"params, median of 30): JAX {jax.__version__}, Python {platform.python_version()}, "
        f"{_device()}, {os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}, load average after the run {load}.",
        "",
        "| params | states | ms | vs bf16-state AdamW |",
        "|---|---|---:|---:|",
    ]
    for where, rows in times.items():
        ref = rows[0][1]
        lines += [f"| {where} | {name} | {ms:.2f} | {ms / ref:.2f}x |" for name, ms in rows]
    return lines


def seed_summary(runs, base):
    """Markdown lines: per format, the gap to float32 AdamW over the seeds run
    (mean, min, max), beside float32 AdamW's own spread across seeds."""
    if len(base) < 2:
        return []
    lines = [
        "",
        f"Over {len(base)} seeds (each seed: its own data split, initialisation and "
        "batches; the gap is to float32 AdamW of the same seed):",
        "",
        "| states | mean gap | min | max |",
        "|---|---:|---:|---:|",
    ]
    for name in dict.fromkeys(n for _, n, _ in runs):
        gaps = [
            100 * (r.final_val_loss / base[s] - 1) for s, n, r in runs if n == name and s in base
        ]
        if name != "float32 AdamW" and gaps:
            lines.append(
                f"| {name} | {np.mean(gaps):+.2f}% | {min(gaps):+.2f}% | {max(gaps):+.2f}% |"
            )
    f32 = np.array(list(base.values()))
    lines += [
        "",
        f"float32 AdamW's final validation loss itself ranges {f32.min():.4f}-{f32.max():.4f} "
        f"across the seeds ({100 * (f32.max() / f32.min() - 1):.2f}% apart).",
    ]
    return lines


def write(args, cfg, runs, times):
    """Writes the table, the curves and the plot for the runs so far; returns the table."""
    n_params = sum(x.size for x in jax.tree.leaves(_model.init_params(jax.random.PRNGKey(0), cfg)))

    base = {s: r.final_val_loss for s, n, r in runs if n == "float32 AdamW"}
    lines = [
        f"Demo model (`amp_jax.demo` defaults: d={cfg.d_model}, layers={cfg.layers}, "
        f"seq={cfg.seq}, batch={cfg.batch}, {n_params} parameters), float32 params and "
        f"compute, {args.steps} steps, lr {args.lr} (warmup + cosine), JAX "
        f"{jax.__version__}, {platform.machine()} CPU, {os.cpu_count()} cores. "
        "Optimizer state bytes per parameter include the float32 moments of the "
        "parameters kept unquantized (embeddings, tensors under 4096 elements).",
        "",
        "| seed | states | final val loss | vs float32 AdamW | state bytes/param | ms/step |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for seed, name, r in runs:
        gap = 100 * (r.final_val_loss / base[seed] - 1) if seed in base else float("nan")
        lines.append(
            f"| {seed} | {name} | {r.final_val_loss:.4f} | {gap:+.2f}% | "
            f"{r.opt_state_bytes / n_params:.2f} | {r.median_step_s * 1e3:.2f} |"
        )
    lines += seed_summary(runs, base)
    if times:
        lines += [""] + timing_table(times)
    table = "\n".join(lines)
    print("\n" + table)
    with open(os.path.join(args.out, "QUANTIZED_STATES.md"), "w") as f:
        f.write("# Quantized AdamW states: convergence and step time\n\n")
        f.write("Written by `python -m benchmarks.quantized_states`.\n\n" + table + "\n")
    curves = [
        {
            "seed": seed,
            "states": name,
            "train_steps": r.train_steps,
            "train_loss": r.train_loss,
            "val_steps": r.val_steps,
            "val_loss": r.val_loss,
        }
        for seed, name, r in runs
    ]
    with open(os.path.join(args.out, "quantized_states.json"), "w") as f:
        json.dump(curves, f)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return table
    fig, ax = plt.subplots(figsize=(7, 4))
    for c in curves:
        ax.plot(c["val_steps"], c["val_loss"], label=f"{c['states']} (seed {c['seed']})")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_ylim(top=min(max(c["val_loss"][0] for c in curves), 3.5))
    ax.legend()
    ax.set_title("demo model: AdamW with quantized states")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "quantized_states.png"), dpi=100)
    # the copy the docs show (docs/optim.md); never from a smoke run
    docs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "images")
    if os.path.isdir(docs) and not args.smoke:
        fig.savefig(os.path.join(docs, "quantized_states.png"), dpi=100)
    plt.close(fig)
    return table


if __name__ == "__main__":
    main()
