"""amp's cost as the program grows: trace + lower of an unrolled decoder, float32 against amp.

    python -m benchmarks.trace_cost                     # depths 4,16,32,48; writes benchmarks/results/TRACE_COST.md
    python -m benchmarks.trace_cost --depths 4,8 --no-write
    python -m benchmarks.trace_cost --smoke             # depth 1 and 2, 1 repeat, no write (CI)

The model is workloads/models.py's GPT decoder with ``unrolled=True`` (d=256,
4 heads, seq 32, batch 2, vocab 256): every block has its own equations, so
the program grows linearly with the depth. Per depth, in one process,
interleaved round-robin (fresh ``amp`` wrapper and fresh ``jax.jit`` each
time, a full garbage collection before each measure, the order rotated from
one repeat to the next) and the fastest of ``--reps``:

* ``f32 s``: ``jax.jit(jax.value_and_grad(loss)).lower(*args)``;
* ``amp s``: the same of ``amp(loss)`` (bfloat16 policy): amp traces the
  loss, plans, and binds every equation again under JAX's AD;
* ``amp / f32``: the ratio (about 2 is the floor of a trace-and-rebind);
* ``amp us / eqn``: ``(amp s - f32 s)`` over the equations of the float32
  ``value_and_grad`` jaxpr: amp's own time per equation, which should not grow
  with the model;
* ``explain s``: ``amp_jax.explain(loss, *args, grad=True)``, and its ratio
  to ``amp s``.

Tracing and lowering run on one thread, so the main table is the process's
CPU time (``time.process_time``): on a shared machine it moves far less than
the wall clock, which counts the time other jobs held the core. The wall-clock
ratios follow in a second table.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import time
from collections.abc import Callable

import jax

from amp_jax import amp, explain
from benchmarks import _report
from benchmarks.run import machine as _run_machine
from workloads import models as M

SIZES = dict(batch=2, seq=32, d=256, heads=4, vocab=256)
TARGETS = {"amp / f32": 2.0, "explain / amp": 1.5}


def _timed(run: Callable[[], object]) -> tuple[float, float]:
    """``(CPU s, wall s)`` of ``run()``, after a full collection (so that no
    earlier garbage is collected on its time)."""
    gc.collect()
    c0, w0 = time.process_time(), time.perf_counter()
    run()
    return time.process_time() - c0, time.perf_counter() - w0


def measure(depth: int, reps: int) -> dict[str, float]:
    """CPU and wall seconds of float32's and amp's trace + lower and of explain, at one depth."""
    model = M.gpt(layers=depth, unrolled=True, **SIZES)
    args = (model.init(jax.random.PRNGKey(0)), *model.batch(jax.random.PRNGKey(1)))
    loss = model.loss

    def lower(fn: Callable) -> Callable[[], object]:
        return lambda: jax.jit(jax.value_and_grad(fn)).lower(*args)

    runs = {
        "f32": lambda: lower(lambda *a: loss(*a))(),
        "amp": lambda: lower(amp(lambda *a: loss(*a)))(),
        "explain": lambda: explain(lambda *a: loss(*a), *args, grad=True),
    }
    for run in runs.values():  # warms JAX's own caches
        run()
    eqns = len(jax.make_jaxpr(jax.value_and_grad(loss))(*args).jaxpr.eqns)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    names = list(runs)
    for rep in range(reps):
        for name in names[rep % 3 :] + names[: rep % 3]:
            times[name].append(_timed(runs[name]))
    out: dict[str, float] = {"eqns": eqns}
    for name, ts in times.items():
        out[name] = min(c for c, _ in ts)
        out[f"{name} wall"] = min(w for _, w in ts)
    return out


def _machine(load_start: str) -> list[str]:
    import jaxlib

    load_end = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    m = _run_machine()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return [
        f"- machine: {platform.processor() or platform.machine()}, backend "
        f"{jax.default_backend()}, {cores} of {os.cpu_count()} cores available to the process",
        f"- cpu: {m['cpu']}; cpu flags: {m['cpu flags']}; amp bf16 dots: "
        f"{m['amp bf16 dots on this cpu']}",
        f"- versions: Python {platform.python_version()}, jax {jax.__version__}, "
        f"jaxlib {jaxlib.__version__}",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- load average (1/5/15 min): {load_start} at the start, {load_end} at the end "
        "(a shared machine: the ratios, measured side by side, are the numbers to read)",
    ]


def _targets(rows: dict[int, dict[str, float]]) -> list[str]:
    """One line per target: the worst ratio over the depths and whether it holds."""
    out = []
    for name, limit in TARGETS.items():
        a, b = name.split(" / ")
        worst = max(r[a] / r[b] for r in rows.values())
        met = "met" if worst <= limit else "NOT met"
        out.append(f"- {name} <= {limit}: worst {worst:.2f} (CPU time): {met}")
    own = [1e6 * (r["amp"] - r["f32"]) / r["eqns"] for r in rows.values()]
    out.append(
        f"- amp us / eqn constant as the depth grows: {own[0]:.0f} at the smallest depth, "
        f"{own[-1]:.0f} at the largest"
    )
    return out


def report(rows: dict[int, dict[str, float]], reps: int, load_start: str) -> str:
    out = [
        "# Trace cost: amp's trace + lower against float32's, by depth",
        "",
        "Generated by `python -m benchmarks.trace_cost` (see its docstring): "
        "`jax.jit(jax.value_and_grad(loss)).lower(*args)` of workloads/models.py's GPT "
        f"decoder with `unrolled=True` ({', '.join(f'{k} {v}' for k, v in SIZES.items())}), "
        f"fastest of {reps}, float32, amp and explain interleaved in one process. "
        "Seconds are the process's CPU time (tracing and lowering use one thread).",
        "",
        *_machine(load_start),
        "",
        "| depth | f32 eqns | f32 s | amp s | amp / f32 | amp us / eqn | explain s | "
        "explain / amp |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for depth, r in rows.items():
        own = 1e6 * (r["amp"] - r["f32"]) / r["eqns"]
        out.append(
            f"| {depth} | {r['eqns']} | {r['f32']:.3f} | {r['amp']:.3f} | "
            f"{r['amp'] / r['f32']:.2f} | {own:.0f} | {r['explain']:.3f} | "
            f"{r['explain'] / r['amp']:.2f} |"
        )
    out += ["", "Targets:", "", *_targets(rows), "", "The same runs, wall clock:", ""]
    out += [
        "| depth | f32 wall s | amp wall s | amp / f32 | explain wall s | explain / amp |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for depth, r in rows.items():
        f, a, e = r["f32 wall"], r["amp wall"], r["explain wall"]
        out.append(f"| {depth} | {f:.3f} | {a:.3f} | {a / f:.2f} | {e:.3f} | {e / a:.2f} |")
    return "\n".join([*out, ""])


def main(argv: list[str] | None = None) -> str:
    """Runs the benchmark; returns the Markdown report (written unless ``--no-write``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", default="4,16,32,48")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=os.path.join(_report.RESULTS, "TRACE_COST.md"))
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--smoke", action="store_true", help="depths 1 and 2, 1 repeat, no write (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.depths, args.reps, args.no_write = "1,2", 1, True
    load_start = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = {}
    for depth in (int(d) for d in args.depths.split(",")):
        rows[depth] = measure(depth, args.reps)
        print(f"# depth {depth}: {rows[depth]}", flush=True)
    text = report(rows, args.reps, load_start)
    return _report.emit(text, None if args.no_write else args.out)


if __name__ == "__main__":
    main()
