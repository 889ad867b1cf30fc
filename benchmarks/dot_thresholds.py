"""When does a bf16 matmul pay? float32 dots against amp's lowered form, by shape, side by side.

    python -m benchmarks.dot_thresholds [--rounds 5] [--out FILE]

For each ``[m, k] @ [k, n]`` of a grid (m in 1..1652, k in 8..256, n in
2..256, plus three 1024-wide layers), two jitted functions run the product
in a ``lax.fori_loop`` (launch overhead paid once): float32 as written, and
amp's form on XLA:CPU, the float32 operands cast to bf16 inside and a
bf16 x bf16 -> float32 dot. Each is timed in CPU time on one core (the
process pinned to core 0; CPU time moves far less than the wall clock on a
shared machine), interleaved, medians of ``--rounds``.

The report writes the grid per contraction size with each cell's
lowered / float32 ratio, a ``*`` where a candidate per-shape rule (`lowers`)
would lower the dot, and that rule's misses: cells it lowers that ran slower,
cells it keeps that ran more than 10% faster. amp itself lowers every dot
that passes ``Policy.min_low_contraction`` and ``min_low_flops`` (8 and 256
by default); how-amp-works.md says why the candidate is not amp's rule.
Written with the machine, versions, date and load to
``benchmarks/results/DOT_THRESHOLDS_<backend>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

import amp_jax

M = [1, 2, 4, 8, 16, 64, 256, 1652]
K = [8, 16, 32, 64, 256]
N = [2, 8, 16, 32, 64, 256]
WIDE = [(1, 1024, 1024), (4, 1024, 1024), (16, 1024, 1024)]


def _lowered(a: jax.Array, b: jax.Array) -> jax.Array:
    bf = jnp.bfloat16
    return lax.dot(a.astype(bf), b.astype(bf), preferred_element_type=jnp.float32)


def _loop(dot: Callable[[jax.Array, jax.Array], jax.Array], reps: int) -> Callable[..., jax.Array]:
    # each product reads the carry, so XLA can neither hoist nor drop it
    return jax.jit(
        lambda a, b: lax.fori_loop(0, reps, lambda i, c: c + dot(a + c * 0, b)[0, 0], 0.0)
    )


def ratio(m: int, k: int, n: int, rounds: int) -> tuple[float, float]:
    """``(lowered / float32 CPU time, float32 us per product)`` of one shape."""
    a = jax.random.normal(jax.random.PRNGKey(0), (m, k))
    b = jax.random.normal(jax.random.PRNGKey(1), (k, n))
    reps = max(1, int(3e7 / (2 * m * k * n + 2e4)))
    fns = {"f32": _loop(lax.dot, reps), "low": _loop(_lowered, reps)}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        jax.block_until_ready(fn(a, b))
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.process_time()
            jax.block_until_ready(fn(a, b))
            times[name].append((time.process_time() - t0) / reps)
    f32 = statistics.median(times["f32"])
    return statistics.median(times["low"]) / f32, f32 * 1e6


def lowers(m: int, k: int, n: int) -> bool:
    """A per-shape rule fitted to this grid on a 2-core AMD EPYC (AVX512-BF16),
    JAX 0.10.2 and 0.12, 2026-11-27: lower only where both free sizes reach a
    tile. Not amp's rule (amp lowers every dot that passes
    ``Policy.min_low_contraction`` / ``min_low_flops``): the report says how far
    it is from the measurements, on each machine it runs on."""
    if k >= 64:
        return (m >= 16 and n >= 64) or (m >= 64 and n >= 16)
    return (m >= 64 and n >= 64) or (m >= 16 and n >= 256)


def main(argv: list[str] | None = None) -> str:
    """Runs the benchmark; returns the Markdown report (written unless ``--smoke``)."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", help="default: benchmarks/results/DOT_THRESHOLDS_<backend>.md")
    p.add_argument("--smoke", action="store_true", help="two shapes, one round, no write (CI)")
    args = p.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    grid = list(itertools.product([1, 64], [8], [2])) if args.smoke else None
    shapes = grid or [*itertools.product(M, K, N), *WIDE]
    rounds = 1 if args.smoke else args.rounds
    load = os.getloadavg()
    found: dict[tuple[int, int, int], tuple[float, float]] = {}
    for shape in shapes:
        found[shape] = ratio(*shape, rounds)
        print(f"{'x'.join(map(str, shape))}: {found[shape][0]:.2f}", flush=True)
    end = os.getloadavg()
    lines = []
    for k in sorted({s[1] for s in shapes}):
        ns = sorted({s[2] for s in shapes if s[1] == k})
        lines += [
            f"k = {k}:",
            "",
            "| m | " + " | ".join(f"n = {n}" for n in ns) + " |",
            "|---:|" + "---:|" * len(ns),
        ]
        for m in sorted({s[0] for s in shapes if s[1] == k}):
            cells = [
                f"{found[m, k, n][0]:.2f}{' *' if lowers(m, k, n) else ''}"
                if (m, k, n) in found
                else ""
                for n in ns
            ]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    slower = [s for s, (r, _) in found.items() if lowers(*s) and r > 1.0]
    missed = [s for s, (r, _) in found.items() if not lowers(*s) and r < 0.9]
    named = lambda ss: ", ".join(f"{'x'.join(map(str, s))} ({found[s][0]:.2f})" for s in ss)
    lines += [
        f"The candidate rule lowers {sum(lowers(*s) for s in found)} of {len(found)} shapes; "
        f"lowered but slower than float32: {len(slower)}{': ' + named(slower) if slower else ''}; "
        f"kept float32 though more than 10% faster lowered: {len(missed)}"
        f"{': ' + named(missed) if missed else ''}.",
    ]
    support = amp_jax.cpu_bf16_support()
    head = [
        "# Dots on this backend: float32 against amp's lowered form (casts included)",
        "",
        "Generated by `python -m benchmarks.dot_thresholds`: each cell is the CPU time "
        "of `[m, k] @ [k, n]` with its float32 operands cast to bf16 inside (bf16 x bf16 "
        "-> float32, amp's form) over the float32 dot's, one core, medians of "
        f"{rounds} interleaved rounds; `*` where the candidate rule `lowers` would lower it "
        "(one table per contraction size k).",
        "",
        f"- device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"{os.cpu_count()} host cores, {platform.processor() or platform.machine()}",
        f"- cpu flags: {', '.join(support.flags) or 'not reported by the OS'}; amp bf16 "
        f"dots on this cpu: {'yes' if support.pays else 'no'} ({support.evidence})",
        f"- python {platform.python_version()}, jax {jax.__version__}",
        f"- date: {datetime.datetime.now():%Y-%m-%d %H:%M}",
        f"- load average (1/5/15 min): {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} at the "
        f"start, {end[0]:.2f}, {end[1]:.2f}, {end[2]:.2f} at the end",
        "",
    ]
    text = "\n".join(head + lines) + "\n"
    print(text)
    if not args.smoke:
        out = args.out or os.path.join(
            os.path.dirname(__file__), "results", f"DOT_THRESHOLDS_{jax.default_backend()}.md"
        )
        with open(out, "w") as f:
            f.write(text)
        print(f"wrote {out}")
    return text


if __name__ == "__main__":
    main()
