"""Float8 matmuls: the allow rule of ``dot_general`` under ``Policy(float8=...)``.

A large, unbatched ``dot_general`` (a dense layer: ``x @ w``) runs with
``float8_e4m3fn`` operands in the forward pass and a ``float8_e5m2`` cotangent
in the two backward products, with dynamic scales computed from the current
tensors (torchao's "tensorwise" recipe, or "rowwise": one scale per row of the
non-contracted dims) and float32 accumulation. Everything else -- batched dots
(attention), small dots, convolutions -- follows the bfloat16 policy.

How a product is written where the GPU has fp8 matmuls (compute capability
8.9 and up):

    s  = 2 ** ceil(log2(amax(|x|) / fp8_max))          # a power of two
    q  = convert(clamp(x / s, -fp8_max, fp8_max), f8)  # quantize
    out = dot_general(qx, qy, preferred_element_type=float32) * (sx * sy)

a dot of the fp8 operands themselves, which XLA runs as an fp8 GEMM
(``__cublas$lt$matmul$f8``, or a Triton GEMM fusion with fp8 operands); a
per-row scale lies along a kept dim, so it also factors out of the product.
(The dequantize-then-dot form below, which XLA's GEMM rewriter was meant to
turn into an fp8 GEMM, ran as a bf16 GEMM of the unrounded values on an H100
with JAX 0.11.2: the fp8 rounding was gone, the gradients equal to bf16's.)

Elsewhere (CPU, older GPUs) the product is emulated:

    xd = convert(q, bf16) * s                          # dequantize (exact)
    out = dot_general(xd, wd, preferred_element_type=float32 or bf16)

Because the scales are powers of two and every fp8 value is a bf16 value, the
dequantized operands are exactly the fp8 values times their scale, so the
emulation computes the same products as the fp8 GEMM (up to accumulation
order; ``tests/test_float8.py`` checks both forms against each other on CPU).

Scales never overflow or divide by zero: an all-zero tensor gets the scale
``2**-126`` (quantizes to zeros); an ``inf``/``nan`` amax gets the scale 1 and
the non-finite entries stay non-finite (NaN: ``float8_e4m3fn`` has no inf), so
loss scaling and ``is_finite`` checks still see the overflow -- never a
silent saturation to a finite value.

Convolutions are not lowered to fp8: XLA has no scaled-fp8 convolution
rewrite, and neither torchao nor Transformer Engine trains convolutions in
fp8; they keep the bfloat16 rule.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from amp_jax._src import compat, jaxprs, rules
from amp_jax._src.decision import Reason, Variant, Why, float8_scope, float8_text
from amp_jax._src.policy import HIGH_DTYPE, is_managed_float
from amp_jax._src.rules import _acc_dtype, _dot_transpose

#: ``Policy(float8=...)`` values.
RECIPES = ("off", "tensorwise", "rowwise")

#: forward operands (weights and activations) and the backward cotangent.
FWD_DTYPE = np.dtype(jnp.float8_e4m3fn)
BWD_DTYPE = np.dtype(jnp.float8_e5m2)

#: fp8 tensor cores multiply 16-deep tiles: shorter contractions stay bf16.
MIN_CONTRACTION = 16

_LOW = np.dtype(jnp.bfloat16)

#: tests only: force the native (True) or emulated (False) products on any backend
NATIVE_OVERRIDE: bool | None = None
_MIN_SCALE = 2.0**-126  # smallest normal float32: 0 / scale stays 0, x / scale stays finite


# -- which dots --------------------------------------------------------------------------


def skip_reason(policy: Any, eqn: Any) -> str | None:
    """Why a lowered ``allow`` eqn runs the bfloat16 rule instead of fp8, or None.

    Only meaningful when ``policy.float8 != "off"`` and the eqn is lowered.
    """
    if eqn.primitive.name != "dot_general":
        return "not a dot_general (convolutions stay bfloat16)"
    if not all(is_managed_float(getattr(v.aval, "dtype", None)) for v in eqn.invars):
        return "non-float operand"
    (_, _), (lb, _) = eqn.params["dimension_numbers"]
    if lb:
        return "batched dot (attention-style): bfloat16, as torchao and Transformer Engine do"
    k, flops = jaxprs.contraction_and_flops(eqn)
    if k < MIN_CONTRACTION:
        return f"contraction {k} < {MIN_CONTRACTION}: too short for fp8"
    if flops < policy.float8_min_flops:
        return f"{flops} FLOPs < Policy.float8_min_flops={policy.float8_min_flops}: too small"
    return None


def applies(ctx: Any, eqn: Any) -> bool:
    """Whether ``eqn`` (lowered by ``ctx``) runs as an fp8 product."""
    return (
        getattr(ctx.policy, "float8", "off") != "off"
        and ctx.vjp_rules
        and ctx.policy.compute_dtype == _LOW
        and skip_reason(ctx.policy, eqn) is None
    )


# -- the variant of the dot rule ---------------------------------------------------------


def reason(ctx: Any, eqn: Any, variant: Variant) -> Reason | None:
    """Why a lowered ``allow`` eqn (planned to run ``variant``) runs in fp8 or
    not under a float8 policy. None when the policy has no float8, or when the
    eqn has an operand that is not a managed float."""
    if getattr(ctx.policy, "float8", "off") == "off":
        return None
    if not all(is_managed_float(getattr(v.aval, "dtype", None)) for v in eqn.invars):
        return None
    if variant is Variant.FLOAT8:
        return Reason(Why.FLOAT8, float8_text(ctx.policy.float8, ctx.backend))
    why = skip_reason(ctx.policy, eqn)
    if why is None and ctx.policy.compute_dtype != _LOW:
        why = f"compute dtype {ctx.policy.compute_dtype.name}: float8 needs a bfloat16 policy"
    why = why or "inside a custom JVP rule (JAX transposes it)"
    return Reason(Why.POLICY_CLASS, f"allow class, the bfloat16 policy's rule; not float8: {why}")


def _variant_rule(ctx: Any) -> Callable:
    return functools.partial(float8_dot_rule, recipe=ctx.policy.float8, backend=ctx.backend)


# -- scales and quantization -------------------------------------------------------------------


def _fp8_max(dtype: np.dtype) -> float:
    return float(jnp.finfo(dtype).max)


def scale_of(x: Any, dtype: Any, axes: tuple[int, ...] | None = None) -> Any:
    """The power-of-two dynamic scale that maps ``x``'s amax into ``dtype``'s range.

    ``axes``: the dims reduced for the amax (``None``: all, a per-tensor
    scalar; else a per-row scale with those dims kept as size 1). Always
    finite and positive: ``2**-126`` for an all-zero tensor, 1 for a
    non-finite amax.
    """
    dtype = np.dtype(dtype)
    a = jnp.abs(x.astype(HIGH_DTYPE))
    amax = jnp.max(a) if axes is None else jnp.max(a, axis=axes, keepdims=True)
    finite = jnp.isfinite(amax)
    ratio = jnp.where(finite, amax, 0.0) / _fp8_max(dtype)
    ratio = jnp.maximum(ratio, _MIN_SCALE)  # a normal float32 in [2**-126, 2**120]
    # the next power of two up, from the bits (exact, unlike exp2(ceil(log2(.)))):
    bits = lax.bitcast_convert_type(ratio, jnp.int32)
    biased_exp = lax.shift_right_logical(bits, jnp.int32(23))
    biased_exp = jnp.where((bits & 0x7FFFFF) == 0, biased_exp, biased_exp + 1)
    scale = lax.bitcast_convert_type(lax.shift_left(biased_exp, jnp.int32(23)), jnp.float32)
    return jnp.where(finite, scale, jnp.ones_like(scale))


def quantize(x: Any, dtype: Any, scale: Any) -> Any:
    """``x / scale`` in fp8 ``dtype``: finite values clamp to its range, inf/nan become NaN."""
    dtype = np.dtype(dtype)
    m = _fp8_max(dtype)
    xs = x.astype(HIGH_DTYPE) / scale
    q = jnp.clip(xs, -m, m)
    q = jnp.where(jnp.isfinite(xs), q, jnp.nan)
    return q.astype(dtype)


def dequantize(q: Any, scale: Any, dtype: Any = _LOW) -> Any:
    """``q * scale`` in ``dtype`` (exact for a power-of-two scale within range)."""
    return q.astype(dtype) * scale.astype(dtype)


def round_trip(x: Any, dtype: Any, axes: tuple[int, ...] | None = None) -> Any:
    """``x`` through fp8 ``dtype`` with a dynamic scale, back in bfloat16."""
    s = scale_of(x, dtype, axes)
    return dequantize(quantize(x, dtype, s), s)


def _kept(ndim: int, contract: Any, batch: Any) -> tuple[int, ...]:
    return tuple(d for d in range(ndim) if d not in (*contract, *batch))


# -- the rule ------------------------------------------------------------------------------------


def _placed(scale: Any, src: tuple[int, ...], dst: tuple[int, ...], ndim: int) -> Any:
    """A per-row ``scale`` (its operand's shape, the dims it was reduced over of
    size 1) as a factor of an ``ndim``-dim product: its dim ``src[i]`` becomes
    the product's dim ``dst[i]``, every other dim size 1."""
    pairs = sorted(zip(dst, src))
    order = tuple(d for _, d in pairs)
    rest = tuple(d for d in range(scale.ndim) if d not in order)
    kept = lax.transpose(scale, order + rest).reshape([scale.shape[d] for d in order])
    shape = [1] * ndim
    for (d, _), n in zip(pairs, kept.shape):
        shape[d] = n
    return kept.reshape(shape)


def _native_dot(qx, sx, qy, sy, dims, acc, extra, rowwise):
    """``(qx * sx) . (qy * sy)`` as an fp8 GEMM: the dot of the fp8 operands
    themselves (float32 accumulation), its scales applied to the result. A
    per-row scale lies along a kept (or batch) dim, so it factors out of the
    contraction."""
    (xc, yc), (xb, yb) = dims
    out = lax.dot_general(qx, qy, dims, preferred_element_type=HIGH_DTYPE, **extra)
    if rowwise:
        x_kept, y_kept = _kept(qx.ndim, xc, xb), _kept(qy.ndim, yc, yb)
        nb, n = len(xb), out.ndim
        out = out * _placed(sx, (*xb, *x_kept), tuple(range(nb + len(x_kept))), n)
        y_at = tuple(range(nb)) + tuple(range(nb + len(x_kept), n))
        out = out * _placed(sy, (*yb, *y_kept), y_at, n)
    else:
        out = out * (sx * sy)
    return out.astype(acc)


@functools.cache
def _fp8_dot(
    dims: Any,
    acc: Any,
    out_sharding: Any,
    recipe: str,
    x_dtype: np.dtype,
    y_dtype: np.dtype,
    native: bool = False,
) -> Callable:
    (xc, yc), (xb, yb) = dims
    extra = {} if out_sharding is None else {"out_sharding": out_sharding}
    rowwise = recipe == "rowwise"

    def axes(reduce_axes):
        return tuple(reduce_axes) if rowwise else None

    def qdq(v, dtype, reduce_axes):
        return round_trip(v, dtype, axes(reduce_axes))

    def quantized(v, dtype, reduce_axes):
        s = scale_of(v, dtype, axes(reduce_axes))
        return quantize(v, dtype, s), s

    def product(x, y):
        """The forward product and the fp8 operands with their scales (rowwise:
        one scale per row of the non-contracted dims, amax over the contraction)."""
        (qx, sx), (qy, sy) = quantized(x, FWD_DTYPE, xc), quantized(y, FWD_DTYPE, yc)
        if native:
            out = _native_dot(qx, sx, qy, sy, dims, acc, extra, rowwise)
        else:
            xd, yd = dequantize(qx, sx), dequantize(qy, sy)
            out = lax.dot_general(xd, yd, dims, preferred_element_type=acc, **extra)
        return out, (qx, sx, qy, sy)

    def primal(x, y):
        with jax.named_scope(float8_scope(recipe)):
            return product(x, y)[0]

    f = jax.custom_vjp(primal)

    def fwd(x, y):
        with jax.named_scope(float8_scope(recipe)):
            out, quant = product(x, y)
        # rowwise: the backward products re-quantize along their own contractions;
        # tensorwise: fp8 residuals, half the bytes of bf16 ones
        return out, ((x.astype(_LOW), y.astype(_LOW)) if rowwise else quant)

    def bwd(res, ct):
        nx, ny = (res[0].ndim, res[1].ndim) if rowwise else (res[0].ndim, res[2].ndim)
        nb = len(xb)
        x_kept, y_kept = _kept(nx, xc, xb), _kept(ny, yc, yb)
        # ct dims: [batch, x kept, y kept]
        ct_x_kept = tuple(range(nb, nb + len(x_kept)))
        ct_y_kept = tuple(range(nb + len(x_kept), nb + len(x_kept) + len(y_kept)))
        with jax.named_scope(float8_scope(recipe, backward=True)):
            if native:  # fp8 GEMMs: dx = ct . y, dy = x . ct, e5m2 cotangent
                if rowwise:  # each product re-quantizes along its own contraction
                    x, y = res
                    qct_x, sct_x = quantized(ct, BWD_DTYPE, ct_y_kept)
                    qct_y, sct_y = quantized(ct, BWD_DTYPE, ct_x_kept)
                    qy, sy = quantized(y, FWD_DTYPE, y_kept)
                    qx, sx = quantized(x, FWD_DTYPE, x_kept)
                    ct_b = tuple(range(nb))
                    fx = _placed(sct_x, ct_b + ct_x_kept, (*xb, *x_kept), nx)
                    fx = fx * _placed(sy, (*yb, *yc), (*xb, *xc), nx)
                    fy = _placed(sct_y, ct_b + ct_y_kept, (*yb, *y_kept), ny)
                    fy = fy * _placed(sx, (*xb, *xc), (*yb, *yc), ny)
                else:
                    qx, sx, qy, sy = res
                    qct_x, sct = quantized(ct, BWD_DTYPE, ())
                    qct_y, fx, fy = qct_x, sct * sy, sct * sx
                dx = _dot_transpose(qct_x, qy, nx, xc, xb, yc, yb, ny, True, None, HIGH_DTYPE, qx)
                dy = _dot_transpose(qct_y, qx, ny, yc, yb, xc, xb, nx, False, None, HIGH_DTYPE, qy)
                # written in the policy's matmul output dtype, as the other rules do
                dx, dy = (dx * fx).astype(acc), (dy * fy).astype(acc)
                return dx.astype(x_dtype), dy.astype(y_dtype)
            if rowwise:
                x, y = res
                # dx = ct . y over y's kept dims; dy = x . ct over x's kept dims
                ct_for_dx = qdq(ct, BWD_DTYPE, ct_y_kept)
                y_for_dx = qdq(y, FWD_DTYPE, y_kept)
                ct_for_dy = qdq(ct, BWD_DTYPE, ct_x_kept)
                x_for_dy = qdq(x, FWD_DTYPE, x_kept)
            else:
                qx, sx, qy, sy = res
                ct_for_dx = ct_for_dy = round_trip(ct, BWD_DTYPE)
                y_for_dx, x_for_dy = dequantize(qy, sy), dequantize(qx, sx)
            # (like=: an operand of the result's shape, for explicit-sharding outputs)
            dx = _dot_transpose(
                ct_for_dx, y_for_dx, nx, xc, xb, yc, yb, ny, True, None, acc, x_for_dy
            )
            dy = _dot_transpose(
                ct_for_dy, x_for_dy, ny, yc, yb, xc, xb, nx, False, None, acc, y_for_dx
            )
        return dx.astype(x_dtype), dy.astype(y_dtype)

    f.defvjp(fwd, bwd)
    return f


def float8_dot_rule(
    eqn: Any,
    invals: Any,
    compute_dtype: np.dtype,
    out_dtype: np.dtype = HIGH_DTYPE,
    *,
    recipe: str = "tensorwise",
    backend: str = "cpu",
) -> list[Any]:
    """The fp8 allow rule of ``dot_general`` (same signature as the bf16 rules)."""
    del compute_dtype
    x, y = invals
    p = eqn.params
    f = _fp8_dot(
        p["dimension_numbers"],
        _acc_dtype(eqn, out_dtype),
        p.get("out_sharding"),
        recipe,
        np.dtype(x.dtype),
        np.dtype(y.dtype),
        NATIVE_OVERRIDE if NATIVE_OVERRIDE is not None else compat.native_float8_matmul(backend),
    )
    try:
        return [f(x, y)]
    except TypeError as e:  # JAX's refusal of forward mode through a custom_vjp
        if "forward-mode" not in str(e):
            raise
        raise TypeError(FORWARD_MODE_REFUSAL) from e


#: the error of forward-mode differentiation through a float8 matmul
FORWARD_MODE_REFUSAL = (
    "amp: forward-mode differentiation (jax.jvp, jax.jacfwd, jax.linearize, "
    "Hessian-vector products) cannot go through a float8 matmul: its backward "
    "quantizes the cotangent with a scale computed from the cotangent itself, "
    "which is not linear, so no tangent rule can stand for it. Use "
    "policy='bfloat16' for forward-mode code (or wrap this matmul in "
    "amp_jax.full_precision); reverse mode (jax.grad) works."
)


rules.register_variant("dot_general", Variant.FLOAT8, _variant_rule)
