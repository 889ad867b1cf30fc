"""Peak memory of eager (in-backward) updates vs the standard training step.

Compiles (does not run) the training step of a stack of MLP blocks whose
parameters dominate memory (batch 1) and reads XLA's memory analysis:
argument + output + temp bytes minus aliased bytes (params and optimizer state
are donated in every variant). Prints a table and writes
benchmarks/results/EAGER_MEMORY.md.

    python -m benchmarks.eager_memory [--layers 12] [--width 512]
    python -m benchmarks.eager_memory --fsdp   # per device, 8 host devices
    python -m benchmarks.eager_memory --smoke  # 2 blocks of width 64, no write (CI)

``--fsdp`` forces 8 host CPU devices, shards every block weight's last dim
over them (FSDP) and writes benchmarks/results/EAGER_MEMORY_FSDP.md: per-device peaks
of the standard step and of the eager step under ``jax.set_mesh`` (state
slice carried) and without it (state writes ordered by an index read from the
written rows, which costs scalar all-reduces in the loop: counted).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

if "--fsdp" in sys.argv:  # before jax is imported
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax
import jax.numpy as jnp
import optax

import amp_jax
from amp_jax.optim import state_bytes
from benchmarks import _report
from workloads import models as M


def model(width, layers, seq, dtype=jnp.float32):
    """workloads' residual block stack: its functions, parameter shapes and a batch's."""
    params = jax.eval_shape(lambda: M.stack_params(jax.random.key(0), width, layers, dtype))
    batch = jax.ShapeDtypeStruct((seq, width), jnp.float32)
    return M.stack_embed, M.stack_block, M.stack_head, params, batch


def memory(fn, *args):
    """(argument, output, temp, alias, peak) bytes of ``jit(fn, donate 0,1)``."""
    c = jax.jit(fn, donate_argnums=(0, 1)).lower(*args).compile()
    m = c.memory_analysis()
    a, o, t, al = (
        m.argument_size_in_bytes,
        m.output_size_in_bytes,
        m.temp_size_in_bytes,
        m.alias_size_in_bytes,
    )
    return dict(args=a, out=o, temp=t, alias=al, peak=a + o + t - al)


def standard_fn(loss, tx):
    def f(p, s, x):
        l, g = jax.value_and_grad(loss)(p, x)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, l

    return f


def unrolled_loss(embed, block, head):
    def loss(p, x):
        h = embed(p["embed"], x)
        for i in range(jax.tree.leaves(p["blocks"])[0].shape[0]):
            h = block(jax.tree.map(lambda a: a[i], p["blocks"]), h)
        return head(p["head"], h, x)

    return loss


def unrolled_params(params):
    """Blocks as a list of per-layer dicts (what a python-loop model holds)."""
    n = jax.tree.leaves(params["blocks"])[0].shape[0]
    layer = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params["blocks"])
    return {"embed": params["embed"], "blocks": [layer] * n, "head": params["head"]}


def unrolled_loss_list(embed, block, head):
    def loss(p, x):
        h = embed(p["embed"], x)
        for lp in p["blocks"]:
            h = block(lp, h)
        return head(p["head"], h, x)

    return loss


def rows_for(name, tx, width, layers, seq, dtype=jnp.float32, variants=None):
    embed, block, head, params, batch = model(width, layers, seq, dtype)
    p_bytes = state_bytes(params)
    layer_grad = state_bytes(params["blocks"]) // layers
    out = []
    variants = variants or ["standard", "unrolled", "eager", "eager+remat"]
    for v in variants:
        if v == "standard":
            step = amp_jax.eager.scan_step(embed, block, head, tx)
            s = jax.eval_shape(tx.init, params)
            m = memory(standard_fn(step.loss, tx), params, s, batch)
        elif v == "unrolled":
            up = unrolled_params(params)
            s = jax.eval_shape(tx.init, up)
            m = memory(standard_fn(unrolled_loss_list(embed, block, head), tx), up, s, batch)
        else:
            step = amp_jax.eager.scan_step(embed, block, head, tx, remat=v.endswith("remat"))
            s = jax.eval_shape(step.init, params)
            m = memory(step.update, params, s, batch)
        m.update(variant=v, opt=name, params=p_bytes, state=state_bytes(s), layer_grad=layer_grad)
        out.append(m)
    return out


def _time(fn, args, reps):
    """Median wall ms of the jitted, donated step."""
    import time

    f = jax.jit(fn, donate_argnums=(0, 1))
    p, s, x = args
    out = []
    for r in range(reps + 1):
        t0 = time.perf_counter()
        p, s, _ = jax.block_until_ready(f(p, s, x))  # outputs feed the next step
        if r:  # the first call compiles
            out.append((time.perf_counter() - t0) * 1e3)
    return sorted(out)[len(out) // 2]


def rows_f16(name, inner, width, layers, seq, reps):
    """float16 compute (amp policy), float32 parameters, loss scaling:
    the standard dynamic step vs eager with a static scale (no finite check)
    and eager with the dynamic scale (check-first)."""
    embed, block, head, params, batch = model(width, layers, seq)
    block = amp_jax.amp(block, policy="float16")
    dyn = amp_jax.optim.dynamic_loss_scale(inner)
    static = amp_jax.optim.static_loss_scale(inner, 2.0**10)
    x = jnp.ones(batch.shape, batch.dtype)
    p_bytes = state_bytes(params)
    layer_grad = state_bytes(params["blocks"]) // layers
    out = []
    for v, tx in (
        ("standard f16+dynamic", dyn),
        ("eager f16+static", static),
        ("eager f16+dynamic", dyn),
    ):
        step = amp_jax.eager.scan_step(embed, block, head, tx)
        if v.startswith("standard"):

            def fn(p, s, x, step=step, tx=tx):
                l, g = amp_jax.optim.scaled_value_and_grad(step.loss, s)(p, x)
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s, l

            init = tx.init
        else:
            fn, init = step.update, step.init
        s = jax.eval_shape(init, params)
        m = memory(fn, params, s, batch)
        real_p = jax.tree.map(lambda a: jnp.full(a.shape, 0.01, a.dtype), params)
        s_real = init(real_p)
        m["ms"] = _time(fn, (real_p, s_real, x), reps) if reps else float("nan")
        m.update(variant=v, opt=name, params=p_bytes, state=state_bytes(s), layer_grad=layer_grad)
        out.append(m)
    return out


def fsdp_table(width, layers, seq):
    """Per-device peaks with every block weight's last dim sharded over 8 devices."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from workloads.hlo import loop_scalar_all_reduces

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

    def spec(x):
        return P(*([None] * (x.ndim - 1)), "data") if x.ndim and x.shape[-1] % 8 == 0 else P()

    def shard(tree):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec(x))),
            tree,
        )

    embed, block, head, params, batch = model(width, layers, max(seq, 8))
    params = shard(params)
    batch = jax.ShapeDtypeStruct(batch.shape, batch.dtype, sharding=NamedSharding(mesh, P("data")))
    lines = [
        "# Eager updates with FSDP-sharded stacks: per-device compiled peak memory",
        "",
        f"Machine: {platform.machine()} CPU, 8 forced host devices, JAX {jax.__version__}, "
        f"optax {optax.__version__}; date {datetime.date.today()}.",
        f"Model: {layers} MLP blocks of width {width} (as in EAGER_MEMORY.md), batch "
        f"{batch.shape[0]} sharded over the devices; every weight's last dim sharded over "
        "the 8 devices. XLA's memory analysis of the compiled step (per device).",
        "`set_mesh`: jitted inside `jax.set_mesh(mesh)` (the step carries the layer's "
        "state slice); `shardings only`: the same arguments without `set_mesh` (the step "
        "orders its state writes by an index read from the written rows). `loop "
        "all-reduces` = scalar all-reduces per backward-loop iteration.",
        "",
        "| optimizer | variant | temp MiB | peak MiB | vs standard | loop all-reduces |",
        "|---|---|---|---|---|---|",
    ]
    for name, tx in (
        ("sgd(momentum=0.9)", optax.sgd(1e-2, momentum=0.9)),
        ("adam", optax.adam(1e-3)),
    ):
        step = amp_jax.eager.scan_step(embed, block, head, tx)
        rows = []
        with jax.set_mesh(mesh):
            rows.append(
                (
                    "standard",
                    standard_fn(step.loss, tx),
                    shard(jax.eval_shape(tx.init, params)),
                    True,
                )
            )
        s = shard(jax.eval_shape(step.init, params))
        rows += [
            ("eager, set_mesh", step.update, s, True),
            ("eager, shardings only", step.update, s, False),
        ]
        std = None
        for v, fn, s, under_mesh in rows:
            lowered = lambda: jax.jit(fn, donate_argnums=(0, 1)).lower(params, s, batch).compile()
            if under_mesh:
                with jax.set_mesh(mesh):
                    c = lowered()
            else:
                c = lowered()
            m = c.memory_analysis()
            peak = (
                m.argument_size_in_bytes
                + m.output_size_in_bytes
                + m.temp_size_in_bytes
                - m.alias_size_in_bytes
            )
            std = std or peak
            lines.append(
                f"| {name} | {v} | {m.temp_size_in_bytes / 2**20:.2f} | {peak / 2**20:.2f} | "
                f"{peak / std:.3f} | {loop_scalar_all_reduces(c.as_text())} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    """Runs the benchmark; returns the Markdown report (written unless ``--smoke``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--seq", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20, help="timed steps (f16 table)")
    ap.add_argument(
        "--out", default=None, help="default: benchmarks/results/EAGER_MEMORY[_FSDP].md"
    )
    ap.add_argument("--fsdp", action="store_true", help="per-device table on 8 host devices")
    ap.add_argument("--smoke", action="store_true", help="2 blocks of width 64, no write (CI)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.layers, a.width, a.reps = 2, 64, 1
    here = _report.RESULTS
    if a.fsdp:
        out = a.out or os.path.join(here, "EAGER_MEMORY_FSDP.md")
        return _report.emit(fsdp_table(a.width, a.layers, a.seq), None if a.smoke else out)
    a.out = a.out or os.path.join(here, "EAGER_MEMORY.md")
    lines = _memory_table(a, _memory_rows(a)) + _f16_table(a)
    return _report.emit("\n".join(lines) + "\n", None if a.smoke else a.out)


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def _memory_rows(a: argparse.Namespace) -> list[dict]:
    """The float32 table's rows: every optimizer, standard, unrolled and eager."""
    rows = []
    rows += rows_for("sgd(momentum=0.9)", optax.sgd(1e-2, momentum=0.9), a.width, a.layers, a.seq)
    rows += rows_for("adam", optax.adam(1e-3), a.width, a.layers, a.seq)
    kahan = amp_jax.optim.kahan_summation(optax.adam(1e-3))
    rows += [
        dict(
            r,
            variant="eager bf16+Kahan" if r["variant"] == "eager" else r["variant"] + " bf16+Kahan",
        )
        for r in rows_for(
            "kahan(adam)",
            kahan,
            a.width,
            a.layers,
            a.seq,
            jnp.bfloat16,
            variants=["standard", "eager"],
        )
    ]
    rows += [
        dict(r, variant=r["variant"] + " 8-bit states")
        for r in rows_for(
            "adamw 8bit",
            amp_jax.optim.adamw(1e-3, state_format="8bit"),
            a.width,
            a.layers,
            a.seq,
            variants=["standard", "eager"],
        )
    ]
    return rows


def _memory_table(a: argparse.Namespace, rows: list[dict]) -> list[str]:
    std = {r["opt"]: r["peak"] for r in rows if r["variant"].startswith("standard")}
    lines = [
        "# Eager updates: compiled peak memory",
        "",
        f"Machine: {platform.machine()} CPU, {os.cpu_count()} cores, JAX {jax.__version__}, "
        f"optax {optax.__version__}, backend {jax.default_backend()}; date {datetime.date.today()}.",
        f"Model: {a.layers} MLP blocks `h + tanh(h @ w1 + b1) @ w2`, width {a.width}, "
        f"batch {a.seq} x {a.width}; embed and head are {a.width}x{a.width} matrices.",
        "Numbers are XLA's `memory_analysis()` of the compiled step "
        "(`jax.jit(step, donate_argnums=(0, 1))`): peak = argument + output + temp - alias "
        "bytes. `bound` = params + optimizer state + one layer's gradient (+ activations, "
        "which are tiny at batch 1). Ratio = peak / standard peak (same optimizer).",
        "",
        "| optimizer | variant | params MiB | opt state MiB | temp MiB | peak MiB | bound MiB | peak/bound | vs standard |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bound = r["params"] + r["state"] + r["layer_grad"]
        lines.append(
            f"| {r['opt']} | {r['variant']} | {_mib(r['params'])} | {_mib(r['state'])} | "
            f"{_mib(r['temp'])} | {_mib(r['peak'])} | {_mib(bound)} | {r['peak'] / bound:.3f} | "
            f"{r['peak'] / std[r['opt']]:.3f} |"
        )
    return lines


def _f16_table(a: argparse.Namespace) -> list[str]:
    """The float16 section: loss scaling, static and dynamic, with step times."""
    f16 = rows_f16(
        "sgd(momentum=0.9)", optax.sgd(1e-2, momentum=0.9), a.width, a.layers, a.seq, a.reps
    )
    f16 += rows_f16("adam", optax.adam(1e-3), a.width, a.layers, a.seq, a.reps)
    std16 = {r["opt"]: r for r in f16 if r["variant"].startswith("standard")}
    lines = [
        "",
        "### float16 compute with loss scaling",
        "",
        'Blocks under `amp(block, policy="float16")`, float32 parameters; the '
        "standard step is `scaled_value_and_grad` + `dynamic_loss_scale(opt)`. "
        "`eager f16+static` has no finite check (static scale 2**10); "
        "`eager f16+dynamic` runs the check-first backward pass. ms = median wall "
        f"time of {a.reps} jitted steps (2 shared cores under other load: noisy).",
        "",
        "| optimizer | variant | temp MiB | peak MiB | bound MiB | peak/bound | vs standard | ms/step | time vs standard |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in f16:
        bound = r["params"] + r["state"] + r["layer_grad"]
        sd = std16[r["opt"]]
        lines.append(
            f"| {r['opt']} | {r['variant']} | {_mib(r['temp'])} | {_mib(r['peak'])} | "
            f"{_mib(bound)} | {r['peak'] / bound:.3f} | {r['peak'] / sd['peak']:.3f} | "
            f"{r['ms']:.2f} | {r['ms'] / sd['ms']:.2f} |"
        )
    return lines
