"""Train a small byte-level transformer on the Python standard library in
several precision modes and compare speed, memory and loss.

Same model, same data, same seed in every mode: float32 (f32), amp with
bfloat16 (amp-bf16), amp with float16 and dynamic loss scaling (amp-f16)
and pure bfloat16 parameters with Kahan-compensated AdamW (bf16-kahan);
opt-in, amp with float8 matmuls (amp-fp8, e.g. --modes amp-bf16,amp-fp8 on a
GPU with float8 matmuls) and amp over parameters cast to bfloat16 at the start,
a bfloat16 residual stream (amp-bf16-stream). Writes results.json and
loss_curves.png to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import platform
import sys
import time
from typing import Any

from amp_jax import CpuBf16Support, cpu_bf16_support
from amp_jax.demo import _data, _model
from amp_jax.demo._modes import DEFAULT_MODES, MODES, RunResult, train

DEFAULTS = dict(
    steps=120,
    d_model=256,
    layers=2,
    heads=4,
    seq=64,
    batch=16,
    lr=3e-3,
    seed=0,
    val_batches=4,
    out="amp_jax_demo_out",
)


def _positive(name):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} must be a positive integer, got {text!r}"
            ) from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {value}")
        return value

    return parse


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lr must be a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"--lr must be a positive number, got {text!r}")
    return value


#: the positive integer options: (flag, help; the default is appended)
_SIZES = (
    ("--steps", "training steps per mode"),
    ("--d-model", "model width, a multiple of --heads"),
    ("--layers", "transformer blocks"),
    ("--heads", "attention heads"),
    ("--seq", "context length in bytes"),
    ("--batch", "sequences per step"),
)


def build_parser() -> argparse.ArgumentParser:
    d = DEFAULTS
    p = argparse.ArgumentParser(
        prog="python -m amp_jax.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )

    def positive(flag: str, what: str) -> None:
        default = d[flag[2:].replace("-", "_")]
        p.add_argument(
            flag, type=_positive(flag), default=default, help=f"{what} (default {default})"
        )

    positive(*_SIZES[0])
    p.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated modes to run (default: {','.join(DEFAULT_MODES)}; "
        f"all: {','.join(MODES)})",
    )
    for flag, what in _SIZES[1:]:
        positive(flag, what)
    p.add_argument(
        "--lr",
        type=_positive_float,
        default=d["lr"],
        help=f"peak learning rate, warmup + cosine (default {d['lr']})",
    )
    positive("--val-batches", "validation batches per evaluation")
    p.add_argument(
        "--seed",
        type=int,
        default=d["seed"],
        help=f"seed for init, split and batches (default {d['seed']})",
    )
    p.add_argument("--out", default=d["out"], help=f"output folder (default ./{d['out']})")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def parse_args(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        parser.error(
            f"unknown mode(s) {', '.join(map(repr, unknown)) or '(none given)'} in --modes; "
            f"valid modes: {', '.join(MODES)}"
        )
    if len(set(modes)) != len(modes):
        parser.error(f"--modes lists a mode twice: {args.modes!r}")
    args.modes = modes
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    return args


def _fmt_bytes(n):
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def format_table(results: list[RunResult]) -> str:
    header = (
        "mode",
        "tokens/s",
        "step ms",
        "compile s",
        "step mem MiB",
        "opt state MiB",
        "train loss",
        "val loss",
    )
    rows = [header]
    for r in results:
        rows.append(
            (
                r.mode,
                f"{r.tokens_per_s:,.0f}",
                f"{1e3 * r.median_step_s:.1f}",
                f"{r.compile_s:.1f}",
                _fmt_bytes(r.step_memory_bytes),
                _fmt_bytes(r.opt_state_bytes),
                f"{r.final_train_loss:.3f}",
                f"{r.final_val_loss:.3f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


#: the demo's optional dependencies (the ``demo`` extra), by import name.
EXTRAS = {"tqdm": "tqdm", "matplotlib": "matplotlib"}


def check_extras(progress: bool = True) -> None:
    """Exits with the install command when a dependency of the demo is missing.

    Checked before training, so a missing plotting library does not surface
    as a raw ``ModuleNotFoundError`` after minutes of work.
    """
    import importlib

    missing = []
    for module, package in EXTRAS.items():
        if module == "tqdm" and not progress:
            continue
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(package)
    if missing:
        raise SystemExit(
            f"python -m amp_jax.demo needs {' and '.join(missing)}, which the library alone "
            f"does not install: pip install {' '.join(missing)}\n"
            'or, in a clone of the repository: pip install -e ".[demo]"'
        )


def plot(results: list[RunResult], path: pathlib.Path, title: str) -> None:
    """Draws the train and validation loss (and any loss scale) of every mode to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(results, title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(results: list[RunResult], title: str) -> Any:
    """The figure `plot` draws: train loss, validation loss (each panel with its
    own y range: the validation losses, taken after the first steps, span a
    fraction of the training curve's), and the loss scale of loss-scaled modes."""
    import matplotlib.pyplot as plt

    scaled = [(i, r) for i, r in enumerate(results) if r.loss_scale]
    if scaled:
        fig, (ax_t, ax_v, ax_s) = plt.subplots(1, 3, figsize=(16, 4.2))
    else:
        fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(11, 4.2))
    _plot_losses(ax_t, ax_v, results)
    for i, r in scaled:
        _plot_loss_scale(ax_s, i, r)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def smoothed(values: Any, beta: float = 0.9) -> list[float]:
    """The exponential moving average of ``values`` with bias correction (as
    Adam's moments): ``m_t = beta m_(t-1) + (1 - beta) v_t`` from ``m_0 = 0``,
    divided by ``1 - beta^t``. Each point weighs the values seen so far, the
    first ones no more than the EMA's weights give them: the curve starts at
    the first loss and follows a falling loss within a few steps (an EMA
    started at the first value would hold it for tens of steps)."""
    m, out = 0.0, []
    for t, v in enumerate(values, start=1):
        m = beta * m + (1 - beta) * float(v)
        out.append(m / (1 - beta**t))
    return out


def _plot_losses(ax_t: Any, ax_v: Any, results: list[RunResult]) -> None:
    """Train loss (per step and its moving average) and validation loss, one line per mode."""
    import numpy as np

    for i, r in enumerate(results):
        color = f"C{i}"
        loss = np.asarray(r.train_loss)
        ax_t.plot(r.train_steps, loss, color=color, alpha=0.2, lw=0.8)
        smooth = smoothed(loss)  # a moving average, as most training dashboards show
        # the first mode (f32, the reference) is drawn wide underneath: modes that
        # match it closely (amp-f16 usually does) would otherwise hide it.
        # and each mode has its own dash and marker, so one that lies on another
        # (amp-bf16 under amp-f16) still shows
        lw = 4.0 if i == 0 else 1.6
        alpha = 0.45 if i == 0 else 1.0
        dash = ("-", "--", "-.", ":", (0, (5, 1, 1, 1)))[i % 5]
        ax_t.plot(r.train_steps, smooth, color=color, lw=lw, ls=dash, alpha=alpha, label=r.mode)
        ax_v.plot(
            r.val_steps,
            r.val_loss,
            color=color,
            marker="osD^v"[i % 5],
            ms=4.5 - 0.5 * (i % 3),
            lw=lw,
            ls=dash,
            alpha=alpha,
            label=f"{r.mode} ({r.final_val_loss:.3f})",
        )
    ax_t.set_title(
        "train loss (faint: per step, bold: EMA 0.9, bias-corrected; log scale)", fontsize=10
    )
    ax_v.set_title("validation loss (held-out stdlib files)", fontsize=10)
    for ax in (ax_t, ax_v):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    ax_t.set_ylabel("cross-entropy (nats / byte)")
    # every step on the x axis; a log y axis shows the first steps' loss and the
    # small differences at the end in one panel
    ax_t.set_yscale("log")
    ax_t.set_xlim(0, max(max(r.train_steps) for r in results))
    # the validation losses' own range, with a margin
    lo = min(min(r.val_loss) for r in results)
    hi = max(max(r.val_loss) for r in results)
    pad = 0.05 * (hi - lo) or 0.05 * abs(hi) or 0.05
    ax_v.set_ylim(lo - pad, hi + pad)


def _plot_loss_scale(ax_s: Any, i: int, r: RunResult) -> None:
    """The dynamic loss scale of mode ``r`` over the steps, its skipped steps marked."""
    ax_s.step(
        r.train_steps, r.loss_scale, where="post", color=f"C{i}", label=f"{r.mode} loss scale"
    )
    if r.skipped_at:
        ys = [r.loss_scale[s - 1] for s in r.skipped_at]
        ax_s.plot(
            r.skipped_at,
            ys,
            "x",
            color="red",
            ms=7,
            label=f"skipped steps ({len(r.skipped_at)})",
        )
    ax_s.set_yscale("log", base=2)
    ax_s.set_title("dynamic loss scale (x: skipped, non-finite step)", fontsize=10)
    ax_s.set_xlabel("step")
    ax_s.set_ylabel("loss scale")
    ax_s.grid(alpha=0.3)
    ax_s.legend()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_extras(progress=not args.no_progress)
    import jax

    cfg = _model.Config(
        d_model=args.d_model, layers=args.layers, heads=args.heads, seq=args.seq, batch=args.batch
    )
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    corpus = _data.load_corpus(args.seed)
    n_params = sum(
        x.size
        for x in jax.tree.leaves(
            jax.eval_shape(lambda: _model.init_params(jax.random.PRNGKey(0), cfg))
        )
    )
    _print_setup(args, cfg, corpus, n_params)
    support = cpu_bf16_support() if jax.default_backend() == "cpu" else None
    if support is not None:
        print(cpu_line(support))
    eval_every = max(1, args.steps // 10)
    results = [_train_mode(name, args, cfg, corpus, eval_every) for name in args.modes]
    _print_results(results)
    title = (
        f"amp_jax demo: {n_params:,}-parameter byte-level transformer on the Python stdlib, "
        f"{args.steps} steps, JAX {jax.__version__} on {jax.default_backend()}"
    )
    plot(results, out / "loss_curves.png", title)
    payload = _payload(args, corpus, results, n_params=n_params, eval_every=eval_every)
    if support is not None:
        payload["environment"]["cpu_bf16"] = dataclasses.asdict(support)
    payload["wall_time_s"] = time.perf_counter() - t_start
    (out / "results.json").write_text(json.dumps(payload, indent=1))
    lines = conclusions({r.mode: r.step_times_s for r in results}, jax.default_backend(), support)
    if lines:
        print("\n" + "\n".join(lines))
    print(f"\ntotal {payload['wall_time_s']:.0f} s; wrote results.json and loss_curves.png to")
    print(out)
    return 0


#: a relative spread of step times (interquartile range / median) above which the
#: machine was too busy for the one-run step times to rank the modes
NOISY = 0.25


def _timing(times: list[float]) -> tuple[float, float]:
    """``(median, half the interquartile range)`` of a mode's step times, the
    first (compiling, warming caches) left out."""
    import numpy as np

    t = np.asarray(times[1:] or times, dtype=float)
    q1, med, q3 = np.percentile(t, [25, 50, 75])
    return float(med), float(q3 - q1) / 2


def cpu_line(support: CpuBf16Support) -> str:
    """The CPU's bfloat16 support and what amp decided because of it, in words."""
    if support.pays:
        return (
            f"CPU bfloat16 dots: yes ({support.evidence}): amp runs the matmuls in bfloat16 "
            "with float32 accumulation"
        )
    return (
        f"CPU bfloat16 dots: no ({support.evidence}): amp keeps the matmuls in float32, "
        "which runs faster here (Policy(backend_aware=False) lowers them anyway; "
        "AMP_JAX_CPU_BF16=yes|no overrides the decision)"
    )


def _why(mode: str, backend: str, support: CpuBf16Support | None) -> str:
    """Why ``mode`` runs at the speed it does on ``backend`` ('' where not known)."""
    if backend != "cpu" or support is None:
        return ""
    if mode == "amp-f16":
        return (
            "XLA:CPU has no float16 matmul kernel (it converts the operands to float32), "
            "and dynamic loss scaling checks every gradient each step"
        )
    if support.pays:
        return "this CPU runs bfloat16 matmuls with its bfloat16 dot instructions"
    if mode == "amp-bf16":
        return "this CPU has no bfloat16 dot instructions, so amp kept the matmuls in float32"
    return "bfloat16 parameters on a CPU without bfloat16 dot instructions: casts, no faster matmul"


def conclusions(
    step_times: dict[str, list[float]], backend: str, support: CpuBf16Support | None = None
) -> list[str]:
    """What the demo's own step times support, in words: which mode was faster
    than which, only where the medians differ by more than the spread of the
    times (and by 3%); that the machine was too busy to tell where the times
    spread too much. On a CPU, ``support`` (`amp_jax.cpu_bf16_support`) says
    why each mode ran at its speed."""
    timing = {m: _timing(t) for m, t in step_times.items() if t}
    noisy = sorted(m for m, (med, half) in timing.items() if med > 0 and 2 * half / med > NOISY)
    if noisy:
        worst = max(2 * timing[m][1] / timing[m][0] for m in noisy)
        return [
            f"Step times varied by up to {100 * worst:.0f}% within a mode ({', '.join(noisy)}): "
            "the machine was too busy to tell which mode is faster. Run again on an idle machine."
        ]

    def compare(a: str, b: str) -> str | None:
        (ma, ha), (mb, hb) = timing[a], timing[b]
        if abs(ma - mb) <= max(ha + hb, 0.03 * min(ma, mb)):
            return None
        return "faster" if ma < mb else "slower"

    out = []
    for mode in ("amp-bf16", "amp-f16", "bf16-kahan"):
        if mode in timing and "f32" in timing:
            verdict = compare(mode, "f32")
            ratio = timing["f32"][0] / timing[mode][0]
            why = _why(mode, backend, support)
            if verdict is None:
                why = f" ({why})" if why else ""
                out.append(
                    f"{mode} and f32: the same step time within the spread of the times{why}."
                )
            else:
                why = f": {why}" if why else ""
                out.append(f"{mode}'s step was {ratio:.2f}x f32's speed ({verdict}{why}).")
    if "amp-f16" in timing and "amp-bf16" in timing:
        verdict = compare("amp-f16", "amp-bf16")
        if verdict is None:
            out.append("amp-f16 and amp-bf16: the same step time within the spread of the times.")
        elif verdict == "faster":
            out.append("amp-f16 was faster than amp-bf16 here.")
        elif backend == "cpu":
            fast = (
                "the CPU's fast low-precision matmul instructions (AVX512-BF16, AMX) take bfloat16"
                if support is None or support.pays
                else "amp-bf16 ran float32's matmuls (no bfloat16 dot instructions here)"
            )
            out.append(
                f"amp-f16 was slower than amp-bf16 here: {fast}, XLA:CPU converts float16 "
                "matmul operands to float32, and dynamic loss scaling checks every gradient "
                "each step. On a GPU both run on the same tensor cores."
            )
        else:
            out.append("amp-f16 was slower than amp-bf16 here (dynamic loss scaling's checks).")
    return out


def _print_setup(args: argparse.Namespace, cfg: _model.Config, corpus: Any, n_params: int) -> None:
    """The model, the data and the machine, before training."""
    import jax

    print(
        f"amp_jax demo: byte-level transformer, {n_params:,} parameters "
        f"(d_model={cfg.d_model}, layers={cfg.layers}, heads={cfg.heads}, seq={cfg.seq}, batch={cfg.batch}), "
        f"{args.steps} steps per mode"
    )
    print(
        f"data: {corpus.n_train_files} train / {corpus.n_val_files} validation files from {corpus.root} "
        f"({len(corpus.train) / 1e6:.1f} MB / {len(corpus.val) / 1e6:.1f} MB)"
    )
    print(
        f"JAX {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind}), "
        f"{os.cpu_count()} CPU cores visible"
    )


def _train_mode(
    name: str, args: argparse.Namespace, cfg: _model.Config, corpus: Any, eval_every: int
) -> RunResult:
    """Trains mode ``name`` (with a progress bar unless ``--no-progress``)."""
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        def bar(it):
            return tqdm(it, desc=f"{name:>10}", unit="step", dynamic_ncols=True, leave=True)

    return train(
        MODES[name],
        cfg,
        corpus,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        eval_every=eval_every,
        val_batches=args.val_batches,
        progress=bar,
    )


def _print_results(results: list[RunResult]) -> None:
    """The comparison table, what its columns mean and each mode's extra numbers."""
    print()
    print(format_table(results))
    print(
        "\nstep ms: median wall time of one compiled train step; step mem: temp + argument bytes of the "
        "compiled step (XLA memory_analysis); opt state: amp_jax.optim.state_bytes; train loss: mean of "
        "the last 10% of steps; val loss: last evaluation."
    )
    for r in results:
        if r.extra:
            print(f"{r.mode}: " + ", ".join(f"{k}={v:g}" for k, v in r.extra.items()))


def _payload(
    args: argparse.Namespace,
    corpus: Any,
    results: list[RunResult],
    *,
    n_params: int,
    eval_every: int,
) -> dict[str, Any]:
    """What results.json holds: the configuration, the machine, the data and every mode's curves."""
    import jax

    return {
        "config": {
            **{k: v for k, v in vars(args).items() if k != "no_progress"},
            "n_params": n_params,
            "eval_every": eval_every,
        },
        "environment": {
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
        },
        "data": {
            "root": corpus.root,
            "train_files": corpus.n_train_files,
            "val_files": corpus.n_val_files,
            "train_bytes": int(len(corpus.train)),
            "val_bytes": int(len(corpus.val)),
        },
        "modes": {r.mode: _mode_record(r) for r in results},
    }


def _mode_record(r: RunResult) -> dict[str, Any]:
    """One mode's summary and curves, as results.json stores them."""
    return {
        "description": r.description,
        **r.summary(),
        **r.extra,
        "train_steps": r.train_steps,
        "train_loss": r.train_loss,
        "val_steps": r.val_steps,
        "val_loss": r.val_loss,
        **({"loss_scale": r.loss_scale, "skipped_at": r.skipped_at} if r.loss_scale else {}),
        "step_times_s": r.step_times_s,
    }


if __name__ == "__main__":
    sys.exit(main())
