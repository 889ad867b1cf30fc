"""Frozen study; its results: benchmarks/results/GPU_STUDIES.md, "Float8: the dequantize-then-dot form ran in bf16" (2026-11-24).

The two ways amp can write an fp8 product, compiled side by side on this backend.

    python -m benchmarks.studies.float8_forms [--hlo-dir DIR]

``native``: a dot of the fp8 operands, scales applied to the result (amp's
form on GPUs with fp8 matmuls). ``emulated``: fp8 round trip, then a bf16 dot
of the dequantized operands (amp's form elsewhere; the form XLA's GEMM
rewriter is meant to recognise). For each: the fp8 GEMMs and bf16 dots in the
optimized HLO of a dense layer's gradient, and the gradient's error against
float32 beside the bfloat16 policy's (an fp8 product that really rounds to fp8
is clearly worse than bf16).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re

import jax
import jax.numpy as jnp

from amp_jax import amp
from amp_jax._src import backends

_F8_DOT = re.compile(r"\bdot\(f8e[45]m[23]\w*\[[^)]*f8e[45]m[23]\w*\[")
_BF16_DOT = re.compile(r"\bdot\(bf16\[")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hlo-dir", default=None)
    args = p.parse_args(argv)
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (1024, 2048))
    w = jax.random.normal(kw, (2048, 2048)) * 0.02

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    ref = jax.jit(jax.grad(loss))(w, x)

    def rel(g):
        return float(jnp.linalg.norm(g - ref) / jnp.linalg.norm(ref))

    e16 = rel(jax.jit(jax.grad(amp(loss, policy="bfloat16")))(w, x))
    print(
        f"{jax.devices()[0].device_kind}, JAX {jax.__version__}; bf16 policy grad error {e16:.2e}"
    )
    print("| form | policy | fp8 GEMMs | bf16 dots | grad error vs f32 |\n|---|---|---:|---:|---:|")
    for form, native in (("native", True), ("emulated", False)):
        for policy in ("float8", "float8_rowwise"):
            record = dataclasses.replace(backends.current(), native_float8_matmul=lambda: native)
            with backends.use(record):
                step = jax.jit(jax.grad(amp(loss, policy=policy)))
                hlo = step.lower(w, x).compile().as_text()
                err = rel(step(w, x))
            if args.hlo_dir:
                os.makedirs(args.hlo_dir, exist_ok=True)
                with open(os.path.join(args.hlo_dir, f"{form}_{policy}.hlo.txt"), "w") as fh:
                    fh.write(hlo)
            n8 = hlo.count("__cublas$lt$matmul$f8") + len(_F8_DOT.findall(hlo))
            n16 = len(_BF16_DOT.findall(hlo))
            print(f"| {form} | {policy} | {n8} | {n16} | {err:.2e} |", flush=True)


if __name__ == "__main__":
    main()
