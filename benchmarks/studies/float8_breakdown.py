"""Frozen study; its results: benchmarks/GPU_STUDIES.md, "Float8 speed" (2026-11-24).

Where an fp8 dense layer's time goes, beside bf16: GEMMs alone, quantization alone, whole layer.

    python -m benchmarks.studies.float8_breakdown [--m 16384 --k 2048 --n 8192]

Each row one jitted function, median device time of 20 calls, and its compile
time: the bf16 GEMM and the fp8 GEMM on ready operands, the dynamic-scale
quantization of one operand (amax + convert) from float32 and from bf16, and
a dense layer's forward + backward under amp's bfloat16 and float8 policies.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

from amp_jax import amp
from amp_jax._src.rules.dots import float8

BF16, F32, E4M3 = jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn
DIMS = (((1,), (0,)), ((), ()))


def timed(f, *args, rounds=20):
    t0 = time.perf_counter()
    c = jax.jit(f).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(3):
        jax.block_until_ready(c(*args))
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(c(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, compile_s


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--n", type=int, default=8192)
    a = p.parse_args(argv)
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (a.m, a.k), F32)
    w = jax.random.normal(kw, (a.k, a.n), F32) * a.k**-0.5
    xb, wb = x.astype(BF16), w.astype(BF16)
    sx, sw = float8.scale_of(x, E4M3), float8.scale_of(w, E4M3)
    qx, qw = float8.quantize(x, E4M3, sx), float8.quantize(w, E4M3, sw)

    def gemm_bf16(x, w):
        return lax.dot_general(x, w, DIMS, preferred_element_type=F32).astype(BF16)

    def gemm_fp8(qx, qw, s):
        return (lax.dot_general(qx, qw, DIMS, preferred_element_type=F32) * s).astype(BF16)

    def quant(x):
        s = float8.scale_of(x, E4M3)
        return float8.quantize(x, E4M3, s), s

    def layer(x, w):
        return jnp.sum(jnp.tanh(x @ w))

    rows = [
        ("bf16 GEMM", gemm_bf16, (xb, wb)),
        ("fp8 GEMM (operands ready, scale applied)", gemm_fp8, (qx, qw, sx * sw)),
        ("quantize x from float32 (amax + convert)", quant, (x,)),
        ("quantize x from bf16", quant, (xb,)),
        ("layer fwd+bwd, amp bfloat16", jax.grad(amp(layer), argnums=(0, 1)), (x, w)),
        (
            "layer fwd+bwd, amp float8",
            jax.grad(amp(layer, policy="float8"), argnums=(0, 1)),
            (x, w),
        ),
        (
            "layer fwd+bwd, amp float8_rowwise",
            jax.grad(amp(layer, policy="float8_rowwise"), argnums=(0, 1)),
            (x, w),
        ),
    ]
    flops = 2 * a.m * a.k * a.n
    print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}, M={a.m} K={a.k} N={a.n}\n")
    print("| what | ms | TFLOP/s (one GEMM's FLOPs) | compile s |\n|---|---:|---:|---:|")
    for name, f, args in rows:
        ms, cs = timed(f, *args)
        print(f"| {name} | {ms:.3f} | {flops / ms / 1e9:.0f} | {cs:.1f} |", flush=True)


if __name__ == "__main__":
    main()
