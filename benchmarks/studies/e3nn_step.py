"""Frozen study; its results: benchmarks/README.md, "Studies", e3nn_step (2026-11-25).

A real e3nn-jax message-passing network (workloads/equivariant.py: tensor
products with spherical harmonics, irreps-wise linears, gates, a
``segment_sum`` over edges): is amp's train step slower than float32's where
it lowers few of many small contractions?

Prints, per size, the forward contractions amp lowered and kept, the
converts, fusions and dots of the optimized HLO of both steps, and the
jitted ``value_and_grad`` step of float32 and of ``amp`` timed interleaved
round-robin in one process (minimum, 25th percentile and median, and the
ratios). Needs ``e3nn-jax`` (the ``integrations`` extra).

    taskset -c 1 python -m benchmarks.studies.e3nn_step [--rounds 100] [--sizes small,lmax3]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from amp_jax import amp, explain


def _hlo_counts(fn, args):
    text = fn.lower(*args).compile().as_text()
    return {k: text.count(f" {k}(") for k in ("convert", "fusion", "dot")}


def _interleaved(fns, args, rounds):
    """Per function, the step times of ``rounds`` round-robin calls."""
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t)
    return times


def study(size, rounds):
    from workloads.equivariant import message_passing

    loss, params, batch = message_passing(size)
    args = (params, *batch)
    rows = explain(amp(loss), *args).rows
    dots = [r for r in rows if r.primitive == "dot_general" and not r.backward]
    low = sum(r.count for r in dots if r.dtype != "float32")
    kept = sum(r.count for r in dots if r.dtype == "float32")
    fns = {
        "float32": jax.jit(jax.value_and_grad(loss)),
        "amp": jax.jit(jax.value_and_grad(amp(loss))),
    }
    print(f"\n{size}: forward contractions {low} lowered, {kept} kept float32")
    for name, fn in fns.items():
        print(f"  {name} optimized HLO: {_hlo_counts(fn, args)}")
    times = _interleaved(fns, args, rounds)
    for stat, f in (
        ("min", np.min),
        ("p25", lambda v: np.percentile(v, 25)),
        ("median", np.median),
    ):
        a, b = f(times["float32"]), f(times["amp"])
        print(f"  {stat}: float32 {a * 1e3:.3f} ms, amp {b * 1e3:.3f} ms, amp/float32 {b / a:.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--sizes", default="small,medium,lmax3")
    opts = ap.parse_args()
    print(f"jax {jax.__version__}, {jax.default_backend()}")
    for size in opts.sizes.split(","):
        study(size, opts.rounds)


if __name__ == "__main__":
    main()
