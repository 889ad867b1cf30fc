"""XLA:CPU compiles one LLVM kernel per distinct loop fusion of a step
(benchmarks/results/COMPILE_TIME.md): amp's bf16 train step must not add
kernels of its own beyond the casts a bf16 dot needs. Measured here on the
optimized HLO of ``jax.value_and_grad`` of PyTorch-layout MLPs
(``x @ W.T + b``, weights stored (out, in), as Equinox and PyTorch ports
keep them), with bf16 dots on (tests/conftest.py pins ``AMP_JAX_CPU_BF16``).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _util import BF16, F32, rel

from amp_jax import amp
from benchmarks.compile_time import distinct_kernels as _kernels


def _mlp(params, x, t):
    for i, (w, b) in enumerate(params):
        x = x @ w.T + b
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return jnp.mean((x - t) ** 2)


def _args(widths=(128, 256, 256, 256, 128), batch=64):
    keys = jax.random.split(jax.random.PRNGKey(0), len(widths) + 1)
    params = [
        (jax.random.normal(k, (o, i), F32) / np.sqrt(i), jnp.full((o,), 0.01, F32))
        for k, i, o in zip(keys, widths[:-1], widths[1:])
    ]
    x = jax.random.normal(keys[-1], (batch, widths[0]), F32)
    t = jax.random.normal(keys[-2], (batch, widths[-1]), F32)
    return params, x, t


def _hlo(fn, args):
    return jax.jit(jax.value_and_grad(fn)).lower(*args).compile().as_text()


def test_no_kernel_rounds_a_weight_gradient_to_bf16():
    """A dot that reads its weight through a transpose (``x @ W.T``, XLA:CPU's
    layout plan) casts the weight inside its own custom JVP, like any dot:
    the weight gradient leaves the dot in float32, not rounded to bf16 by
    the transpose of an outside cast (a float32 -> bf16 -> float32 kernel of its own)."""
    args = _args()
    kernels = _kernels(_hlo(amp(_mlp), args))
    round_trips = [k for k in kernels if re.search(r"bf16\[.*convert.*\n.*f32\[.*convert", k)]
    assert not round_trips, round_trips
    _, grads = jax.jit(jax.value_and_grad(amp(_mlp)))(*args)
    for gw, _gb in grads:
        gw = np.asarray(gw)
        in_bf16 = np.mean(gw == gw.astype(ml_dtypes.bfloat16).astype(np.float32))
        assert in_bf16 < 0.5, in_bf16  # (rounded to bf16: every element is)
    # (and the cast of each weight is made once in the jaxpr: the transpose
    # that the dot reads through is bound on the float32 weight, and dead)
    jaxpr = jax.make_jaxpr(jax.value_and_grad(amp(_mlp)))(*args)
    weights = {id(v) for v in jaxpr.jaxpr.invars[0:8:2]}
    casts = [
        e
        for e in jaxpr.jaxpr.eqns
        if e.primitive.name == "convert_element_type"
        and id(e.invars[0]) in weights
        and np.dtype(e.params["new_dtype"]) == BF16
    ]
    assert len(casts) <= 4, casts


def test_amp_adds_only_the_casts_a_bf16_dot_needs():
    """Distinct kernels of amp's step beyond float32's (10 new, one of
    float32's, the relu, now writes bf16): the bf16 casts of the weights
    and the input (4 shapes), of the cotangents read by the input gradients
    (2 widths), and the transposed cotangents read by the weight gradients
    (a bf16 copy per width, and the first layer's copy with its cast fused
    in). The code before 2026-11-29 had 3 more: each weight gradient
    rounded through bf16 (one kernel per weight shape)."""
    args = _args()
    f32 = _kernels(_hlo(_mlp, args))
    low = _kernels(_hlo(amp(_mlp), args))
    assert len(low) - len(f32) <= 9, (len(f32), len(low))


@pytest.mark.parametrize("layers", [2, 4])
def test_the_gradients_match_float32(layers):
    """bf16-fit tolerances: the first layer's weight gradient sums 64 products
    of rounded cotangents of random signs (about 4% from float32 at 2 layers,
    before and after the change; the loss and the last layers are within 0.3%)."""
    args = _args(widths=(128,) + (256,) * (layers - 1) + (128,))
    v32, g32 = jax.jit(jax.value_and_grad(_mlp))(*args)
    v, g = jax.jit(jax.value_and_grad(amp(_mlp)))(*args)
    assert abs(float(v) - float(v32)) <= 2e-2 * abs(float(v32))
    for (gw, gb), (w32, b32) in zip(g, g32):
        assert gw.dtype == F32 and gb.dtype == F32
        assert rel(gw, w32) < 0.1 and rel(gb, b32) < 0.1, (rel(gw, w32), rel(gb, b32))
    (gw, gb), (w32, b32) = g[-1], g32[-1]
    assert rel(gw, w32) < 1e-2 and rel(gb, b32) < 1e-2, (rel(gw, w32), rel(gb, b32))
