"""Side-by-side speed benchmark: float32 vs ``amp`` (bf16 policy) vs hand-written bf16.

Usage::

    python -m benchmarks.run                       # all models, writes benchmarks/results/RESULTS.md
    python -m benchmarks.run --quick               # fewer repeats, no ResNet-50 compile study
    python -m benchmarks.run --models mlp,gpt      # a subset (mlp, gpt, cnn)
    python -m benchmarks.run --out /tmp/r.md       # write the report elsewhere
    python -m benchmarks.run --no-write            # print only
    python -m benchmarks.run --smoke               # tiny models, f32/amp, 1 round, no write (CI)

Everything is measured in one process and one run. For each model the train
step ``jax.jit(jax.value_and_grad(loss))`` is built for these variants:

* ``f32``       the float32 model;
* ``amp``       ``amp_jax.amp(loss)`` of the same float32 model, bf16 policy;
* ``hand``      the model written by hand in bf16 (params and inputs cast to
  bf16 at the start, bf16 matmul/conv results, float32 norms/softmax/loss),
  as Flax ``dtype=bfloat16, param_dtype=float32`` or jmp users write it;
* ``hand_acc``  the same with ``preferred_element_type=float32`` on every
  matmul/conv (an "expert" hand version);
* ``amp_fp8``   ``amp_jax.amp(loss, policy="float8")``: the dense matmuls in
  float8 (tensorwise dynamic scales), the rest as ``amp`` (``amp_fp8_rowwise``:
  row-wise scales). The ``gpt_fp8``
  model (d_model 2048, 8 layers on a GPU) runs ``amp`` and ``amp_fp8`` by
  default: ``python -m benchmarks.run --models gpt_fp8`` on an H100.

Per variant it reports the median step time (after warm-up; the variants are
timed round-robin so that machine noise hits them alike), the lower+compile
wall time, ``temp`` and ``argument`` bytes from ``compiled.memory_analysis()``
and the number of ``convert`` instructions in the optimized HLO. It also
measures the backend-aware choices (convolution and weight-gradient dot
layouts on this backend) and the compile-time ratio of ``jit(grad(amp(f)))``
vs ``jit(grad(f))`` on a ResNet-50-sized model. Inputs come from fixed PRNG
keys; only the timings vary between runs.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Collection
from typing import Any

# The PyTorch peer shares the GPU: let JAX allocate as it goes, not 75% up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import amp_jax
from amp_jax import Policy, amp
from benchmarks import _report
from workloads import models as M

BF16 = jnp.bfloat16
F32 = jnp.float32

#: targets of issue 3 (CPU): (description, check on the results dict)
TARGET_STEP_VS_F32 = 0.5
TARGET_STEP_VS_HAND = 1.0
TARGET_TEMP_VS_F32 = 0.6
TARGET_COMPILE_VS_F32 = 1.3
#: targets of issue 29 (GPU, H100)
GPU_TARGETS = {
    "gpt_vs_hand_cudnn": 1.0,
    "gpt_vs_torch_sdpa": 1.0,
    "gpt_vs_torch_compile": 1.0,  # stretch
    "gpt_vs_f32": 0.3,
    "gpt_temp_vs_hand_cudnn": 1.1,
    "mlp_vs_hand": 1.0,
    "cnn_vs_hand": 1.0,
    # issue 17: amp fp8 step time vs amp bf16 on the d_model=2048 GPT
    "gpt_fp8_vs_amp": 0.8,
}
#: dense bf16 peak used for MFU: H100 SXM datasheet (989 TFLOP/s).
GPU_PEAK_FLOPS = 989e12


# -- measuring -----------------------------------------------------------------------


_CONVERT = re.compile(r"=\s*\S+\s+convert\(")


def count_converts(hlo_text: str) -> int:
    """``convert`` instructions in an HLO module's text (fused computations included)."""
    return len(_CONVERT.findall(hlo_text))


def train_step(loss: Callable[..., Any]) -> Callable[..., Any]:
    return jax.jit(jax.value_and_grad(loss))


def compile_step(step: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, float, float]:
    """(compiled, lower+compile seconds, of which lowering: tracing, amp's rewrite, StableHLO)."""
    t0 = time.perf_counter()
    lowered = step.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    return compiled, time.perf_counter() - t0, t1 - t0


def scan_output_bytes(fn: Callable[..., Any], args: tuple[Any, ...]) -> int:
    """Bytes of the outputs of the top-level ``scan`` eqns of ``fn``'s jaxpr: for a
    train step over a scanned model, the forward scan's stacked residuals (what
    the backward pass keeps per layer) plus its carry."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    total = 0
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            total += sum(
                int(np.prod(v.aval.shape)) * np.dtype(v.aval.dtype).itemsize for v in e.outvars
            )
            break  # the first scan is the forward one
    return total


def matmul_flops(fn: Callable[..., Any], args: tuple[Any, ...]) -> float:
    """FLOPs of the dot_general and conv eqns of ``fn``'s jaxpr (2 per multiply-add),
    recursively, a scan body counted ``length`` times."""
    from jax.extend import core as jex_core

    def walk(jaxpr, mult):
        total = 0.0
        for e in jaxpr.eqns:
            name = e.primitive.name
            if name == "dot_general":
                (lc, _), _ = e.params["dimension_numbers"]
                k = math.prod(e.invars[0].aval.shape[d] for d in lc)
                total += mult * 2.0 * k * math.prod(e.outvars[0].aval.shape)
            elif name == "conv_general_dilated":
                w = e.invars[1].aval.shape
                total += (
                    mult
                    * 2.0
                    * math.prod(e.outvars[0].aval.shape)
                    * math.prod(w)
                    / max(w[e.params["dimension_numbers"].rhs_spec[0]], 1)
                )
            inner = mult * (e.params["length"] if name == "scan" else 1)
            for sub in jex_core.jaxprs_in_params(e.params):
                total += walk(
                    sub.jaxpr
                    if hasattr(sub, "jaxpr") and not isinstance(sub, jex_core.Jaxpr)
                    else sub,
                    inner,
                )
        return total

    return walk(jax.make_jaxpr(fn)(*args).jaxpr, 1)


def variants(model: M.Model, which: tuple[str, ...]) -> dict[str, Callable[..., Any]]:
    loss = model.loss
    table = {
        "f32": loss,
        "amp": amp(loss, policy="bfloat16"),
        # amp with float32 allow-op results on every backend (the CPU default)
        "amp_f32out": amp(loss, policy=Policy(BF16, allow_outputs="float32")),
        "amp_fp8": amp(loss, policy="float8"),
        "amp_fp8_rowwise": amp(loss, policy="float8_rowwise"),
        "hand": functools.partial(loss, dtype=BF16),
        "hand_acc": functools.partial(loss, dtype=BF16, acc=F32),
        # amp of the program with a bf16 residual stream: parameters cast at the
        # start as the hand variant does, so the stream between blocks is bf16
        # (LayerNorm statistics stay float32 under amp, as they do by hand)
        "amp_bf16_stream": amp(functools.partial(loss, dtype=BF16), policy="bfloat16"),
    }
    if model.name == "gpt":  # hand bf16 + jax.nn.dot_product_attention(implementation="cudnn")
        table["hand_cudnn"] = functools.partial(loss, dtype=BF16, attention="cudnn")
        # the same bf16-stream program (cuDNN attention) under amp
        table["amp_bf16_stream"] = amp(table["hand_cudnn"], policy="bfloat16")
    return {k: table[k] for k in which if k in table}


def bench_model(
    model: M.Model, which: tuple[str, ...], rounds: int, warmup: int, hlo_dir: str | None = None
) -> dict[str, dict[str, float]]:
    params = model.init(jax.random.PRNGKey(0))
    batch = model.batch(jax.random.PRNGKey(1))
    args = (params, *batch)
    res: dict[str, dict[str, float]] = {}
    fns = {}
    flops = matmul_flops(jax.value_and_grad(model.loss), args)
    for name, loss in variants(model, which).items():
        compiled, ct, lt = compile_step(train_step(loss), args)
        mem = compiled.memory_analysis()
        res[name] = {
            "compile_s": ct,
            "lower_s": lt,
            "temp_bytes": float(mem.temp_size_in_bytes),
            "arg_bytes": float(mem.argument_size_in_bytes),
            "converts": float(count_converts(compiled.as_text())),
        }
        fns[name] = compiled
        if hlo_dir:
            os.makedirs(hlo_dir, exist_ok=True)
            with open(os.path.join(hlo_dir, f"{model.name}_{name}.hlo.txt"), "w") as fh:
                fh.write(compiled.as_text())
        res[name]["scan_out_bytes"] = float(scan_output_bytes(jax.value_and_grad(loss), args))
        out = compiled(*args)
        jax.block_until_ready(out)
        res[name]["loss"] = float(out[0])
        res[name]["flops"] = flops
    for _ in range(warmup):
        for f in fns.values():
            jax.block_until_ready(f(*args))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[name].append(time.perf_counter() - t0)
    for name in fns:
        res[name]["step_s"] = statistics.median(times[name])
    return res


def time_fn(f: Callable[..., Any], args: tuple[Any, ...], reps: int) -> float:
    jf = jax.jit(f)
    jax.block_until_ready(jf(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(jf(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_conv(reps: int) -> list[tuple[str, float]]:
    """A 3x3 NHWC conv (16x32x32x128 -> 128), forward and forward+backward, per dtype form."""
    kx, kw = jax.random.split(jax.random.PRNGKey(2))
    x = jax.random.normal(kx, (16, 32, 32, 128), F32)
    w = jax.random.normal(kw, (3, 3, 128, 128), F32) * 0.03
    dn = ("NHWC", "HWIO", "NHWC")

    def conv(x, w, pet=None):
        return lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=dn, preferred_element_type=pet
        )

    forms = {
        "float32": lambda x, w: conv(x, w),
        "bf16 operands, bf16 result": lambda x, w: conv(x.astype(BF16), w.astype(BF16)),
        "bf16 operands, f32 result (pet=f32)": lambda x, w: conv(
            x.astype(BF16), w.astype(BF16), F32
        ),
    }
    rows = []
    for name, f in forms.items():
        fwd = time_fn(f, (x, w), reps)
        g = jax.grad(lambda x, w, f=f: jnp.sum(f(x, w).astype(F32) ** 2), argnums=(0, 1))
        both = time_fn(g, (x, w), reps)
        rows.append((name, fwd, both))
    return rows


def bench_dw(reps: int) -> list[tuple[str, float]]:
    """The weight-gradient dot ``x.T @ g`` (x: [512, 1024], g: [512, 1024]) in several forms."""
    kx, kg = jax.random.split(jax.random.PRNGKey(3))
    x = jax.random.normal(kx, (512, 1024), F32).astype(BF16)
    g = jax.random.normal(kg, (512, 1024), F32).astype(BF16)
    tn = (((0,), (0,)), ((), ()))
    nn = (((1,), (0,)), ((), ()))
    from amp_jax._src.backends.cpu import materialized_transpose

    forms = {
        "float32 x.T @ g (TN)": lambda x, g: lax.dot_general(x.astype(F32), g.astype(F32), tn),
        "bf16 TN, bf16 result (hand-bf16 backward)": lambda x, g: lax.dot_general(x, g, tn),
        "bf16 TN, pet=f32 (JAX transpose rule)": lambda x, g: lax.dot_general(
            x, g, tn, preferred_element_type=F32
        ),
        "bf16 x.T materialized, then NN, pet=f32 (amp rule)": lambda x, g: lax.dot_general(
            materialized_transpose(x, (1, 0)), g, nn, preferred_element_type=F32
        ),
        "reference: bf16 NN of the same size, pet=f32": lambda x, g: lax.dot_general(
            x.reshape(1024, 512), g, nn, preferred_element_type=F32
        ),
    }
    return [(name, time_fn(f, (x, g), reps)) for name, f in forms.items()]


def bench_resnet50_compile(reps: int) -> dict[str, float]:
    model = M.resnet50()
    params = model.init(jax.random.PRNGKey(0))
    args = (params, *model.batch(jax.random.PRNGKey(1)))
    out = {}
    fns = {
        "f32": model.loss,
        "amp": amp(model.loss),
        "amp_bf16_convs": amp(model.loss, policy=Policy(BF16, backend_aware=False)),
    }
    for name, f in fns.items():
        ts = []
        for _ in range(reps):
            # a fresh jit (and, for amp, a fresh amp trace) every time
            g = f if name == "f32" else amp(model.loss, policy=f.policy)
            _, ct, _ = compile_step(jax.jit(jax.grad(g)), args)
            ts.append(ct)
        out[name] = statistics.median(ts)
    return out


# -- reporting ------------------------------------------------------------------------


def cpu_flags(flags: Collection[str]) -> str:
    """The CPU flags that decide whether amp's bfloat16 dots pay, as the machine
    line writes them: ``"avx512_bf16, no amx_bf16, avx2"``."""
    return ", ".join(f if f in flags else f"no {f}" for f in ("avx512_bf16", "amx_bf16", "avx2"))


def machine() -> dict[str, str]:
    """The machine a report was measured on: the CPU, its bfloat16 flags and
    what amp decided from them (`amp_jax.cpu_bf16_support`), versions, load."""
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    support = amp_jax.cpu_bf16_support()
    return {
        "cpu": cpu,
        "cpu flags": cpu_flags(support.flags) if support.flags else "not reported by the OS",
        "amp bf16 dots on this cpu": f"{'yes' if support.pays else 'no'} ({support.evidence})",
        "cores (os.cpu_count)": str(os.cpu_count()),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else "?",
        "backend": f"{jax.default_backend()} ({jax.devices()[0].device_kind})",
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        # other jobs share the machine: the load when the report was written
        "load average (1/5/15 min)": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def _mb(b: float) -> str:
    return f"{b / 2**20:.1f}"


def model_table(name: str, res: dict[str, dict[str, float]]) -> list[str]:
    """One row per variant; rows of the PyTorch peer have no XLA columns ("-")."""
    lines = [
        "| variant | step ms | vs f32 | amp vs this | MFU | lower+compile s (lower) | temp MiB | temp vs f32 "
        "| arg MiB | converts | loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    f32 = res.get("f32")
    a = res.get("amp")
    gpu = jax.default_backend() == "gpu"
    for v, r in res.items():
        vs = f"{r['step_s'] / f32['step_s']:.2f}" if f32 else "-"
        amp_vs = f"{a['step_s'] / r['step_s']:.2f}" if a else "-"
        flops = r.get("flops") or (f32 or {}).get("flops")
        mfu = f"{flops / r['step_s'] / GPU_PEAK_FLOPS:.0%}" if (gpu and flops) else "-"
        if "compile_s" in r:
            temp_vs = f"{r['temp_bytes'] / f32['temp_bytes']:.2f}" if f32 else "-"
            xla = (
                f"{r['compile_s']:.2f} ({r['lower_s']:.2f}) | {_mb(r['temp_bytes'])} | "
                f"{temp_vs} | {_mb(r['arg_bytes'])} | {int(r['converts'])}"
            )
        else:
            first = r.get("first_step_s")
            first = f"{first:.2f} (first step)" if first is not None else "-"
            xla = f"{first} | peak {_mb(r.get('peak_bytes', float('nan')))} | - | - | -"
        lines.append(
            f"| {v} | {r['step_s'] * 1e3:.1f} | {vs} | {amp_vs} | {mfu} | {xla} | {r['loss']:.4f} |"
        )
    return lines


def gpu_targets(all_res: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    rows = ["| target | measured | met |", "|---|---:|:---:|"]

    def add(desc, num, den, limit, key="step_s"):
        if num is None or den is None:
            return
        ratio = num[key] / den[key]
        rows.append(
            f"| {desc} <= {limit}x | {ratio:.2f}x | {'met' if ratio <= limit else 'NOT met'} |"
        )

    g, m, c = all_res.get("gpt", {}), all_res.get("mlp", {}), all_res.get("cnn", {})
    t = GPU_TARGETS
    add(
        "gpt: amp step vs hand bf16 + cuDNN attention",
        g.get("amp"),
        g.get("hand_cudnn"),
        t["gpt_vs_hand_cudnn"],
    )
    add(
        "gpt: amp step vs torch autocast + SDPA",
        g.get("amp"),
        g.get("torch_autocast_sdpa"),
        t["gpt_vs_torch_sdpa"],
    )
    add(
        "gpt: amp step vs torch.compile + autocast + SDPA (stretch)",
        g.get("amp"),
        g.get("torch_compile_sdpa"),
        t["gpt_vs_torch_compile"],
    )
    add("gpt: amp step vs f32", g.get("amp"), g.get("f32"), t["gpt_vs_f32"])
    add(
        "gpt: amp temp bytes vs hand + cuDNN",
        g.get("amp"),
        g.get("hand_cudnn"),
        t["gpt_temp_vs_hand_cudnn"],
        key="temp_bytes",
    )
    add("mlp: amp step vs hand", m.get("amp"), m.get("hand"), t["mlp_vs_hand"])
    add("cnn: amp step vs hand", c.get("amp"), c.get("hand"), t["cnn_vs_hand"])
    g8 = all_res.get("gpt_fp8", {})
    add("gpt_fp8: amp fp8 step vs amp bf16", g8.get("amp_fp8"), g8.get("amp"), t["gpt_fp8_vs_amp"])
    for name, r in all_res.items():
        add(
            f"{name}: amp compile vs f32",
            r.get("amp"),
            r.get("f32"),
            TARGET_COMPILE_VS_F32,
            key="compile_s",
        )
    return rows


def targets(
    all_res: dict[str, dict[str, dict[str, float]]], r50: dict[str, float] | None
) -> list[str]:
    rows = ["| target | measured | met |", "|---|---:|:---:|"]

    def add(desc, value, ok):
        rows.append(f"| {desc} | {value} | {'met' if ok else 'NOT met'} |")

    for m in ("mlp", "gpt"):
        if m not in all_res or "f32" not in all_res[m]:
            continue
        r = all_res[m]
        ratio = r["amp"]["step_s"] / r["f32"]["step_s"]
        add(
            f"{m}: amp step <= {TARGET_STEP_VS_F32}x f32",
            f"{ratio:.2f}x",
            ratio <= TARGET_STEP_VS_F32,
        )
        if "hand" in r:
            ratio = r["amp"]["step_s"] / r["hand"]["step_s"]
            add(
                f"{m}: amp step <= {TARGET_STEP_VS_HAND}x hand-bf16",
                f"{ratio:.2f}x",
                ratio <= TARGET_STEP_VS_HAND,
            )
    if "gpt" in all_res and "f32" in all_res["gpt"]:
        r = all_res["gpt"]
        ratio = r["amp"]["temp_bytes"] / r["f32"]["temp_bytes"]
        add(
            f"gpt: amp temp bytes <= {TARGET_TEMP_VS_F32}x f32",
            f"{ratio:.2f}x",
            ratio <= TARGET_TEMP_VS_F32,
        )
    for m, r in all_res.items():
        if "amp" not in r or "f32" not in r:
            continue
        ratio = r["amp"]["compile_s"] / r["f32"]["compile_s"]
        add(
            f"{m}: amp compile <= {TARGET_COMPILE_VS_F32}x f32",
            f"{ratio:.2f}x",
            ratio <= TARGET_COMPILE_VS_F32,
        )
    if r50:
        for k in ("amp", "amp_bf16_convs"):
            ratio = r50[k] / r50["f32"]
            add(
                f"ResNet-50 jit(grad({k})) compile <= {TARGET_COMPILE_VS_F32}x f32",
                f"{ratio:.2f}x",
                ratio <= TARGET_COMPILE_VS_F32,
            )
    return rows


def report(args, all_res, descs, conv_rows, dw_rows, r50) -> str:
    """The Markdown report: machine, train-step tables, targets and the CPU studies."""
    out = _report_header(args) + _train_step_section(all_res, descs)
    if jax.default_backend() == "gpu":
        out += _gpu_targets_section(all_res)
    else:
        out += ["## Targets (CPU)", ""] + targets(all_res, r50) + [""]
    if r50:
        out += _resnet50_section(args, r50)
    if conv_rows:
        out += _conv_section(conv_rows)
    if dw_rows:
        out += _dw_section(dw_rows)
    return "\n".join(out)


def _report_header(args) -> list[str]:
    mach = machine()
    out = [
        "# amp_jax speed benchmark",
        "",
        f"Generated by `python -m benchmarks.run{' --quick' if args.quick else ''}"
        f"{' --models ' + args.models if args.models != 'mlp,gpt,cnn' else ''}` "
        f"({args.rounds} timed rounds, medians). Timings are wall-clock on a shared machine; "
        "structure (converts, bytes) is deterministic.",
        "",
        "## Machine",
        "",
    ]
    return out + [f"- {k}: {v}" for k, v in mach.items()]


def _train_step_section(all_res, descs) -> list[str]:
    out = [
        "",
        "## Train step `jax.jit(jax.value_and_grad(loss))`",
        "",
        "`f32`: float32 model. `amp`: `amp(loss)` (bf16 policy, defaults). `hand`: hand-written bf16 "
        "(params/inputs cast at the start, bf16 matmul results, f32 norms/softmax/loss, like Flax "
        "`dtype=bfloat16`). `hand_acc`: hand-written bf16 with `preferred_element_type=float32`. "
        "`amp_fp8`: `amp(loss, policy='float8')` (dense matmuls in float8, tensorwise scales; "
        "emulated off Hopper/Ada). "
        "`amp vs this` = amp step time / this variant's step time. converts = `convert` "
        "instructions in the optimized HLO.",
        "",
    ]
    for name, res in all_res.items():
        out += [f"### {name}: {descs[name]}", ""] + model_table(name, res) + [""]
        if any(r.get("scan_out_bytes") for r in res.values()):
            out += [
                "Forward-scan outputs (stacked residuals kept for the backward, from the jaxpr): "
                + ", ".join(
                    f"{v} {_mb(r['scan_out_bytes'])} MiB"
                    for v, r in res.items()
                    if "scan_out_bytes" in r
                ),
                "",
            ]
    return out


def _gpu_targets_section(all_res) -> list[str]:
    return [
        "## Targets (GPU)",
        "",
        f"MFU: matmul/conv FLOPs of the step (from the jaxpr) per second, "
        f"over {GPU_PEAK_FLOPS / 1e12:.0f} TFLOP/s dense bf16. Rows `torch_*`: the same GPT in "
        "PyTorch (`benchmarks/torch_peer.py`), autocast bf16, einsum attention or "
        "`F.scaled_dot_product_attention`, eager or `torch.compile`d (`torch_compile_sdpa`); "
        "their memory column is the CUDA peak allocation. `amp_bf16_stream`: amp of the "
        "program with its parameters cast to bf16 at the start (the residual stream between "
        "blocks in bf16, as in `hand`; on the GPT, of `hand_cudnn`).",
        "",
        *gpu_targets(all_res),
        "",
    ]


def _resnet50_section(args, r50) -> list[str]:
    out = [
        "## ResNet-50-sized compile time",
        "",
        "`jax.jit(jax.grad(f)).lower(...).compile()` wall time (median of "
        f"{args.r50_reps}, fresh jit and fresh amp trace each time), "
        f"{M.resnet50().description}:",
        "",
        "| variant | compile s | vs f32 |",
        "|---|---:|---:|",
    ]
    for k, v in r50.items():
        out.append(f"| {k} | {v:.2f} | {v / r50['f32']:.2f} |")
    out += [
        "",
        "`amp` keeps convolutions float32 on CPU (backend-aware default); "
        "`amp_bf16_convs` forces them through amp's bf16 conv rule "
        "(`Policy(backend_aware=False)`), the path GPUs/TPUs take.",
        "",
    ]
    return out


def _conv_section(conv_rows) -> list[str]:
    out = [
        "## Backend-aware: convolutions on this CPU",
        "",
        "3x3 conv, NHWC 16x32x32x128 -> 128 (`jax.jit`, median):",
        "",
        "| form | forward ms | forward+backward ms |",
        "|---|---:|---:|",
    ]
    out += [f"| {n} | {a * 1e3:.2f} | {b * 1e3:.2f} |" for n, a, b in conv_rows]
    out += [
        "",
        "`Policy(backend_aware=True)` (the default) keeps `conv_general_dilated` in float32 "
        "on CPU on the strength of this comparison; compare with the `cnn` table above "
        "(where `hand` runs its convs in bf16).",
        "",
    ]
    return out


def _dw_section(dw_rows) -> list[str]:
    out = [
        "## Weight-gradient dot layout on this CPU",
        "",
        "`dW = x.T @ g` with x, g: [512, 1024] bf16 (`jax.jit`, median). XLA:CPU only runs "
        "bf16 dots in its fast (YNNPACK) kernel when the lhs contracts over its last "
        "dimension; a transpose in front of the dot is folded back into the dot, so amp's "
        "dot rule materialises it with a reshape-transpose-reshape that XLA keeps as a copy.",
        "",
        "| form | ms |",
        "|---|---:|",
    ]
    out += [f"| {n} | {t * 1e3:.2f} |" for n, t in dw_rows]
    out.append("")
    return out


def main(argv: list[str] | None = None) -> str:
    """Runs the benchmark; returns the Markdown report (also printed, and written unless
    ``--no-write``)."""
    p = _parser()
    args = p.parse_args(argv)
    if args.smoke:
        args.quick = args.no_extras = args.no_write = args.no_torch = True
        args.variants = args.variants or "f32,amp"
    explicit_variants = args.variants is not None
    unknown = sorted(set(args.models.split(",")) - set(M.MODELS))
    if unknown:
        p.error(f"--models: unknown {unknown}; valid: {','.join(M.MODELS)}")
    gpu = jax.default_backend() == "gpu"
    big = args.scale == "gpu" or (args.scale == "auto" and gpu)
    here = os.path.dirname(os.path.abspath(__file__))
    args.out = args.out or os.path.join(here, "results", "RESULTS_GPU.md" if gpu else "RESULTS.md")
    args.variants = args.variants or (
        "f32,amp,amp_bf16_stream,hand,hand_cudnn" if gpu else "f32,amp,hand,hand_acc"
    )
    args.rounds = 1 if args.smoke else 5 if args.quick else 10
    warmup = 1 if args.quick else 3
    args.r50_reps = 2
    which = tuple(args.variants.split(","))
    all_res, descs = {}, {}
    for name in args.models.split(","):
        sizes = {"small": True} if args.smoke else M.GPU_SIZES[name] if big else {}
        model = M.MODELS[name](**sizes)
        t0 = time.perf_counter()
        model_which = which
        if name == "gpt_fp8" and not explicit_variants:
            model_which = ("amp", "amp_fp8")
        all_res[name] = bench_model(model, model_which, args.rounds, warmup, args.hlo_dir)
        descs[name] = model.description
        if name == "gpt" and gpu and not args.no_torch:
            all_res[name].update(_torch_peer(big, args.rounds, warmup))
        print(f"# {name} ({time.perf_counter() - t0:.0f} s)", flush=True)
        print("\n".join(model_table(name, all_res[name])), flush=True)
    conv_rows = dw_rows = r50 = None
    if not args.no_extras and not gpu:
        reps = 5 if args.quick else 11
        dw_rows = bench_dw(reps)
        conv_rows = bench_conv(reps)
        if not args.quick:
            t0 = time.perf_counter()
            r50 = bench_resnet50_compile(args.r50_reps)
            print(f"# resnet50 compile ({time.perf_counter() - t0:.0f} s): {r50}", flush=True)
    text = report(args, all_res, descs, conv_rows, dw_rows, r50)
    _report.emit(text + "\n", None if args.no_write else args.out)
    return text


def _torch_peer(big: bool, rounds: int, warmup: int) -> dict:
    """The PyTorch GPT rows (``torch_*``), or none where PyTorch is missing."""
    try:
        from benchmarks import torch_peer
    except ImportError as e:
        print(f"# no PyTorch peer: {e}", flush=True)
        return {}
    if not torch_peer.available():
        return {}
    sizes = {
        **dict(batch=2, seq=256, d=512, layers=4, heads=8, vocab=1024),
        **(M.GPU_SIZES["gpt"] if big else {}),
    }
    return torch_peer.bench_gpt(**sizes, rounds=rounds, warmup=warmup)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick", action="store_true", help="fewer rounds; skip the ResNet-50 compile study"
    )
    p.add_argument(
        "--models",
        default="mlp,gpt,cnn",
        help="comma-separated subset of mlp,gpt,cnn,gpt_fp8 (gpt_fp8: amp fp8 vs amp bf16)",
    )
    p.add_argument(
        "--variants",
        default=None,
        help="comma-separated variants (default: f32,amp,hand,hand_acc on CPU; "
        "f32,amp,amp_bf16_stream,hand,hand_cudnn on GPU; amp,amp_fp8 for gpt_fp8)",
    )
    p.add_argument(
        "--scale",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="model sizes: CPU-sized, or GPU-sized (models.GPU_SIZES); auto: by backend",
    )
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch peer on GPU")
    p.add_argument(
        "--out",
        default=None,
        help="report file (default: benchmarks/results/RESULTS.md, or RESULTS_GPU.md on a GPU)",
    )
    p.add_argument("--no-write", action="store_true", help="print the report, don't write it")
    p.add_argument("--no-extras", action="store_true", help="skip conv / dW / ResNet-50 studies")
    p.add_argument("--hlo-dir", default=None, help="write each variant's optimized HLO here")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny models, f32 and amp, 1 round, no extras, no write (CI)",
    )
    return p


if __name__ == "__main__":
    main()
