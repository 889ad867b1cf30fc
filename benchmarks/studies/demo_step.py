"""Frozen study; its results: benchmarks/results/GPU_STUDIES.md, "The demo's pure-bf16 step" (2026-11-24).

The demo's train steps, mode by mode, timed the way the demo times them and apart.

    python -m benchmarks.studies.demo_step [--modes amp-bf16,bf16-kahan] [--hlo-dir DIR]
                                          [--d-model 256 --layers 2 --heads 4 --seq 64 --batch 16]

Builds each mode's step with ``amp_jax.demo._modes.build_step`` (exactly the
demo's step) and times it three ways, medians in one process:

* ``demo``: as the demo's loop does: a new batch from the NumPy corpus each
  step, and ``float(loss)`` to wait for it;
* ``device batch``: one batch already on the device, ``block_until_ready``;
* ``10 in flight``: ten steps dispatched, then one wait (per step): what the
  device itself takes when the host does not wait after each step.

For each mode it prints the optimized HLO's instruction counts (fusions,
custom calls, scatters, whiles, converts) and writes the HLO to ``--hlo-dir``.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import time

import jax

from amp_jax.demo import _data, _model, _modes
from amp_jax.demo.__main__ import DEFAULTS

_OPS = ("fusion", "custom-call", "scatter", "while", "convert", "all-reduce", "copy")


def op_counts(hlo: str) -> dict[str, int]:
    """Instructions per opcode in the entry and called computations, for ``_OPS``."""
    found = collections.Counter(re.findall(r"=\s*\S+\s+([a-z-]+)\(", hlo))
    return {op: found.get(op, 0) for op in _OPS}


def _median_ms(f, rounds: int) -> float:
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="amp-bf16,bf16-kahan")
    for k in ("d_model", "layers", "heads", "seq", "batch"):
        p.add_argument("--" + k.replace("_", "-"), type=int, default=DEFAULTS[k])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--hlo-dir", default=None)
    args = p.parse_args(argv)
    cfg = _model.Config(
        d_model=args.d_model, layers=args.layers, heads=args.heads, seq=args.seq, batch=args.batch
    )
    corpus = _data.load_corpus(0)
    steps = 3 + 3 * args.rounds + 10 * args.rounds
    offsets = _data.batch_offsets(len(corpus.train), cfg.seq, cfg.batch, steps, 1)
    batches = [_data.windows(corpus.train, o, cfg.seq) for o in offsets]
    x0, y0 = batches[0]
    dx, dy = jax.device_put(x0), jax.device_put(y0)
    rows = []
    for name in args.modes.split(","):
        mode = _modes.MODES[name]
        built = _modes.build_step(mode, cfg, steps=1000, lr=DEFAULTS["lr"], seed=0, x=x0, y=y0)
        hlo = built.compiled.as_text()
        if args.hlo_dir:
            os.makedirs(args.hlo_dir, exist_ok=True)
            with open(os.path.join(args.hlo_dir, f"{name}.hlo.txt"), "w") as fh:
                fh.write(hlo)
        state = [built.params, built.opt_state]
        it = iter(batches)

        def demo_step():
            x, y = next(it)
            state[0], state[1], v = built.compiled(state[0], state[1], x, y)
            float(v)

        def device_step():
            state[0], state[1], v = built.compiled(state[0], state[1], dx, dy)
            jax.block_until_ready(v)

        def ten_steps():
            for _ in range(10):
                state[0], state[1], v = built.compiled(state[0], state[1], dx, dy)
            jax.block_until_ready((state[0], v))

        for _ in range(3):
            demo_step()
        demo = _median_ms(demo_step, args.rounds)
        device = _median_ms(device_step, args.rounds)
        flight = _median_ms(ten_steps, args.rounds) / 10
        counts = op_counts(hlo)
        rows.append((name, demo, device, flight, counts))
        print(
            f"{name}: demo {demo:.2f} ms, device batch {device:.2f}, in flight {flight:.2f}, "
            f"{counts}",
            flush=True,
        )
    dev = jax.devices()[0]
    print(
        f"\n{dev.device_kind}, JAX {jax.__version__}, d={cfg.d_model}, layers={cfg.layers}, "
        f"heads={cfg.heads}, seq={cfg.seq}, batch={cfg.batch}\n"
    )
    print("| mode | demo ms | device batch ms | 10 in flight ms/step | " + " | ".join(_OPS) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(_OPS))
    for name, demo, device, flight, counts in rows:
        cells = " | ".join(str(counts[o]) for o in _OPS)
        print(f"| {name} | {demo:.2f} | {device:.2f} | {flight:.2f} | {cells} |")


if __name__ == "__main__":
    main()
