"""Where compile time goes: trace / lower / compile, float32 vs amp vs hand bf16.

Usage::

    python -m benchmarks.compile_time                    # writes benchmarks/results/COMPILE_TIME.md
    python -m benchmarks.compile_time --models mlp,eqx_relu --reps 3 --no-write
    python -m benchmarks.compile_time --depths 50,100,200   # amp's tracing vs depth
    python -m benchmarks.compile_time --models "" --depths "" --no-write  # per-kernel costs
    python -m benchmarks.compile_time --smoke          # small mlp, f32 and amp, 1 repeat, no write

For each model the train step ``jax.value_and_grad(loss)`` is measured in
three stages, each on fresh functions (a new ``amp`` wrapper and a new
``jax.jit`` per repeat, so that no cache of an earlier repeat is hit):

* ``trace``: ``jax.make_jaxpr`` of the step (for ``amp``: amp's tracing of
  ``loss``, its planning and its rewrite, under JAX's AD);
* ``lower``: ``jax.jit(step).lower(*args)`` (tracing again, plus StableHLO);
* ``compile``: ``lowered.compile()``, XLA alone; wall time and the CPU time
  of the process (XLA:CPU compiles kernels on a thread pool; CPU time is the
  steadier number on a shared machine).

Medians over the repeats, variants interleaved. The optimized HLO's structure
explains the compile time: XLA:CPU compiles one LLVM kernel per *distinct*
loop fusion (identical fusions, e.g. the same layer repeated, share one), and
that codegen is most of its compile time, so the table counts loop fusions,
distinct ones, ``convert``s and ``copy``s. Models: workloads/models.py's
``mlp``, ``gpt``, ``cnn`` and, where Equinox is installed, benchmarks/peers.py's
``eqx_relu`` and ``eqx_gelu``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from amp_jax import amp, explain
from amp_jax._src import backends
from benchmarks import _report, run
from workloads import models as M

BF16 = jnp.bfloat16
F32 = jnp.float32
TARGET = run.TARGET_COMPILE_VS_F32


# -- models --------------------------------------------------------------------------


def _bf16_elementwise(make: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
    """``make()`` (an amp function) traced for this backend with its ``follow``
    ops painted low, as before 2026-11-29 (XLA:CPU's record now keeps them
    float32: ``Backend.low_elementwise``), to measure both side by side."""
    record = dataclasses.replace(backends.current(), low_elementwise=True)
    fn = make()

    def traced(*a: Any) -> Any:
        with backends.use(record):
            return fn(*a)

    return traced


def _own(model: M.Model) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Callable]]:
    args = (model.init(jax.random.PRNGKey(0)), *model.batch(jax.random.PRNGKey(1)))
    loss = model.loss
    return (
        loss,
        args,
        {
            "f32": lambda: lambda *a: loss(*a),
            "amp": lambda: amp(lambda *a: loss(*a)),
            "amp_ew": lambda: _bf16_elementwise(lambda: amp(lambda *a: loss(*a))),
            "hand": lambda: lambda *a: loss(*a, dtype=BF16, acc=F32),
        },
    )


def _peer(name: str) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Callable]]:
    from benchmarks import peers

    model = peers.MODELS[name]()
    loss = model.loss
    args = (model.params, *model.batch)
    return (
        loss,
        args,
        {
            "f32": lambda: lambda *a: loss(*a),
            "amp": lambda: amp(lambda *a: loss(*a)),
            "amp_ew": lambda: _bf16_elementwise(lambda: amp(lambda *a: loss(*a))),
            "hand": lambda: peers.hand(loss),
        },
    )


MODELS: dict[str, Callable[[], tuple[Callable, tuple, dict[str, Callable]]]] = {
    "mlp": lambda: _own(M.mlp()),
    "mlp_small": lambda: _own(M.mlp(small=True)),
    "gpt": lambda: _own(M.gpt()),
    "cnn": lambda: _own(M.cnn()),
    "eqx_relu": lambda: _peer("eqx_relu"),
    "eqx_gelu": lambda: _peer("eqx_gelu"),
}


# -- HLO structure -------------------------------------------------------------------

_COMP_HEAD = re.compile(r"^(?:ENTRY )?%(\S+) \((.*)\) -> (.*) \{$")
_FUSION = re.compile(r"fusion\(.*kind=(k\w+).*calls=%([\w.\-]+)")
_OPCODE = re.compile(r"^\s*(?:ROOT )?%\S+ = \S+ ([\w\-]+)\(")


def _computations(hlo_text: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    name = None
    for line in hlo_text.splitlines():
        head = _COMP_HEAD.match(line)
        if head:
            name = head.group(1)
            comps[name] = [f"({head.group(2)}) -> {head.group(3)}"]
        elif name is not None:
            if line == "}":
                name = None
            else:
                comps[name].append(line)
    return comps


def _canonical(body: list[str]) -> str:
    """A fused computation with its names, metadata and parameter names
    dropped: two fusions XLA:CPU compiles to the same kernel read the same."""
    text = "\n".join(body)
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    names: dict[str, str] = {}

    def rename(m: re.Match) -> str:
        return "%" + names.setdefault(m.group(1), f"v{len(names)}")

    text = re.sub(r"%([\w.\-]+)", rename, text)
    return re.sub(r"[\w.\-]+: ", "", text)


def _loops(hlo_text: str) -> list[str]:
    """The called computations of the LLVM-compiled fusions (not library calls)."""
    return [
        m.group(2)
        for line in hlo_text.splitlines()
        if (m := _FUSION.search(line)) and m.group(1) != "kCustom"
    ]


def distinct_kernels(hlo_text: str) -> list[str]:
    """The distinct LLVM-compiled fusions of an optimized HLO module (what
    XLA:CPU compiles once each), as canonical texts, sorted."""
    comps = _computations(hlo_text)
    return sorted({_canonical(comps[c]) for c in _loops(hlo_text) if c in comps})


def hlo_structure(hlo_text: str) -> dict[str, int]:
    """Loop fusions (XLA:CPU's LLVM kernels), distinct ones, and opcode counts."""
    loops = _loops(hlo_text)
    ops = collections.Counter(
        m.group(1) for line in hlo_text.splitlines() if (m := _OPCODE.match(line))
    )
    return {
        "loop_fusions": len(loops),
        "distinct_kernels": len(distinct_kernels(hlo_text)),
        "converts": ops["convert"],
        "copies": ops["copy"],
        "instructions": sum(ops.values()),
    }


# -- measuring -----------------------------------------------------------------------


def _stages(make: Callable[[], Callable], args: tuple[Any, ...]) -> tuple[dict[str, float], Any]:
    t0 = time.perf_counter()
    jax.make_jaxpr(jax.value_and_grad(make()))(*args)
    t1 = time.perf_counter()
    lowered = jax.jit(jax.value_and_grad(make())).lower(*args)
    t2 = time.perf_counter()
    c0 = time.process_time()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    return {
        "trace_s": t1 - t0,
        "lower_s": t2 - t1,
        "compile_s": t3 - t2,
        "compile_cpu_s": time.process_time() - c0,
    }, compiled


def bench(name: str, reps: int, which: tuple[str, ...]) -> dict[str, dict[str, float]]:
    _, args, makers = MODELS[name]()
    makers = {k: v for k, v in makers.items() if k in which}
    times: dict[str, list[dict[str, float]]] = {k: [] for k in makers}
    res: dict[str, dict[str, float]] = {}
    for rep in range(reps + 1):  # the first round warms JAX's own caches up
        for v, make in makers.items():
            t, compiled = _stages(make, args)
            if rep:
                times[v].append(t)
            else:
                res[v] = {k: float(x) for k, x in hlo_structure(compiled.as_text()).items()}
    for v, ts in times.items():
        for k in ts[0]:
            res[v][k] = statistics.median(t[k] for t in ts)
    return res


def depth_scaling(depths: list[int]) -> list[tuple[int, int, int, float, float, float]]:
    """(depth, f32 eqns, amp eqns, f32 trace s, amp trace s, explain s) of a
    narrow MLP's train step, unrolled, to see amp's own cost per equation."""
    rows = []
    for depth in depths:
        m = M.mlp(batch=8, width=64, depth=depth)
        args = (m.init(jax.random.PRNGKey(0)), *m.batch(jax.random.PRNGKey(1)))
        t0 = time.perf_counter()
        jf = jax.make_jaxpr(jax.value_and_grad(lambda *a: m.loss(*a)))(*args)
        t1 = time.perf_counter()
        ja = jax.make_jaxpr(jax.value_and_grad(amp(lambda *a: m.loss(*a))))(*args)
        t2 = time.perf_counter()
        explain(lambda *a: m.loss(*a), *args, grad=True)
        t3 = time.perf_counter()
        rows.append((depth, len(jf.jaxpr.eqns), len(ja.jaxpr.eqns), t1 - t0, t2 - t1, t3 - t2))
        print(f"# depth {depth}: {rows[-1]}", flush=True)
    return rows


def kernel_costs(n: int = 12) -> list[tuple[str, float]]:
    """XLA:CPU compile CPU ms per kernel of one kind: ``n`` independent ops
    on arrays of ``n`` different shapes (so that no two kernels are alike),
    minus the compile time of a function returning its arguments, over ``n``."""
    shapes = [(512, 1024 + 8 * i) for i in range(n)]
    f32 = [jnp.ones(s, F32) for s in shapes]
    b16 = [jnp.ones(s, BF16) for s in shapes]

    def cpu(f: Callable, xs: list[Any]) -> float:
        ts = []
        for i in range(3):
            lowered = jax.jit(lambda *a, i=i: [f(x) for x in a]).lower(*xs)
            c0 = time.process_time()
            lowered.compile()
            ts.append(time.process_time() - c0)
        return statistics.median(ts)

    base = cpu(lambda x: x, f32)
    cases = [
        ("float32 add", lambda x: x + 1, f32),
        ("float32 tanh", jnp.tanh, f32),
        ("bf16 add (XLA:CPU computes it in float32)", lambda x: x + 1, b16),
        ("convert float32 -> bf16", lambda x: x.astype(BF16), f32),
        ("convert bf16 -> float32", lambda x: x.astype(F32), b16),
        ("float32 transpose (a copy)", lambda x: x.T, f32),
        ("bf16 transpose (a copy)", lambda x: x.T, b16),
    ]
    return [(name, 1e3 * (cpu(f, xs) - base) / n) for name, f, xs in cases]


# -- report --------------------------------------------------------------------------


def model_table(res: dict[str, dict[str, float]]) -> list[str]:
    f32 = res["f32"]
    lines = [
        "| variant | trace s | lower s | compile s (CPU s) | compile vs f32 (CPU) | "
        "loop fusions | distinct kernels | converts | copies |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v, r in res.items():
        lines.append(
            f"| {v} | {r['trace_s']:.3f} | {r['lower_s']:.3f} | "
            f"{r['compile_s']:.2f} ({r['compile_cpu_s']:.2f}) | "
            f"{r['compile_s'] / f32['compile_s']:.2f} "
            f"({r['compile_cpu_s'] / f32['compile_cpu_s']:.2f}) | "
            f"{r['loop_fusions']:.0f} | {r['distinct_kernels']:.0f} | "
            f"{r['converts']:.0f} | {r['copies']:.0f} |"
        )
    return lines


def report(all_res, rows, load_start, reps, costs=()) -> str:
    mach = run.machine()
    out = [
        "# amp_jax compile time",
        "",
        "Generated by `python -m benchmarks.compile_time` (medians of "
        f"{reps} repeats, fresh functions each; variants interleaved). Wall times on a "
        "shared machine; CPU time (all threads of the process) and the HLO structure "
        "are the steadier numbers.",
        "",
        "## Machine",
        "",
    ]
    out += [f"- {k}: {v}" for k, v in mach.items() if not k.startswith("load")]
    out += [
        f"- load average (1/5/15 min): {load_start} at the start, "
        f"{mach['load average (1/5/15 min)']} at the end",
        "",
        "## Train step `jax.value_and_grad(loss)`: trace / lower / compile",
        "",
        "`trace`: `jax.make_jaxpr` of the step. `lower`: `jax.jit(step).lower` (traces "
        "again). `compile`: `lowered.compile()` (XLA), wall (CPU) seconds. "
        "`loop fusions`: XLA:CPU's LLVM-compiled fusions in the optimized HLO; "
        "`distinct kernels`: those that differ (XLA:CPU compiles identical ones once). "
        "`hand`: the model written in bf16 by hand (float32 accumulation). `amp_ew`: amp "
        "with its follow ops painted bf16 between two low matmuls, as before 2026-11-29 "
        "(XLA:CPU computes them in float32 with a convert each way: `Backend.low_elementwise`).",
        "",
    ]
    targets = ["| model | amp compile vs f32 (wall) | (CPU) | <= 1.3x |", "|---|---:|---:|:---:|"]
    for name, res in all_res.items():
        out += [f"### {name}", "", *model_table(res), ""]
        wall = res["amp"]["compile_s"] / res["f32"]["compile_s"]
        cpu = res["amp"]["compile_cpu_s"] / res["f32"]["compile_cpu_s"]
        ok = "met" if max(wall, cpu) <= TARGET else "NOT met"
        targets.append(f"| {name} | {wall:.2f} | {cpu:.2f} | {ok} |")
    out += ["## Target: compile <= 1.3x float32", "", *targets, ""]
    if costs:
        out += [
            "## XLA:CPU compile cost per kernel",
            "",
            "CPU ms of `compile()` per distinct loop fusion of one kind (12 of them on "
            "[512, ~1024] arrays of different shapes, minus a function that returns its "
            "arguments):",
            "",
            "| kernel | ms |",
            "|---|---:|",
            *(f"| {k} | {ms:.1f} |" for k, ms in costs),
            "",
        ]
    if rows:
        out += [
            "## amp's own cost vs depth",
            "",
            "Unrolled MLP (width 64, batch 8), train step traced with `jax.make_jaxpr`; "
            "`explain(..., grad=True)` on the same model.",
            "",
            "| depth | f32 eqns | amp eqns | f32 trace s | amp trace s | amp ms / eqn | "
            "explain s |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for d, ef, ea, tf, ta, te in rows:
            out.append(
                f"| {d} | {ef} | {ea} | {tf:.3f} | {ta:.3f} | {1e3 * ta / ea:.3f} | {te:.3f} |"
            )
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> str:
    """Runs the benchmark; returns the Markdown report (written unless ``--no-write``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mlp,gpt,cnn,eqx_relu,eqx_gelu")
    ap.add_argument("--variants", default="f32,amp,amp_ew,hand")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--depths", default="50,100,200", help="'' to skip the depth study")
    ap.add_argument("--no-kernel-costs", action="store_true")
    ap.add_argument("--out", default=os.path.join(_report.RESULTS, "COMPILE_TIME.md"))
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny: small mlp, f32 and amp, 1 repeat, no write (CI)"
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.models, args.variants, args.reps, args.depths = "mlp_small", "f32,amp", 1, "2"
        args.no_kernel_costs = args.no_write = True
    load_start = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    which = tuple(args.variants.split(","))
    all_res = {}
    for name in filter(None, args.models.split(",")):
        try:
            all_res[name] = bench(name, args.reps, which)
        except ImportError as e:  # Equinox not installed
            print(f"# {name}: skipped ({e})", flush=True)
            continue
        print(f"# {name}", *model_table(all_res[name]), sep="\n", flush=True)
    rows = depth_scaling([int(d) for d in args.depths.split(",") if d])
    costs = [] if args.no_kernel_costs else kernel_costs()
    text = report(all_res, rows, load_start, args.reps, costs)
    return _report.emit(text, None if args.no_write else args.out)


if __name__ == "__main__":
    main()
