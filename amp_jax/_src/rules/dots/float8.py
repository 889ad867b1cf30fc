"""Float8 matmuls: the allow rule of ``dot_general`` under ``Policy(float8=...)``.

A large, unbatched ``dot_general`` (a dense layer: ``x @ w``) runs with
``float8_e4m3fn`` operands in the forward pass and a ``float8_e5m2`` cotangent
in the two backward products, with dynamic power-of-two scales computed from
the current tensors (torchao's "tensorwise" recipe, or "rowwise": one scale per
row of the non-contracted dims) and float32 accumulation. Batched dots
(attention), small dots and convolutions follow the bfloat16 policy.

Where the GPU has fp8 matmuls the product is a dot of the fp8 operands
themselves, its scales applied to the result (XLA runs it as an fp8 GEMM);
elsewhere it is emulated as a dot of the dequantized operands, which multiplies
exactly the same numbers since the scales are powers of two and every fp8 value
is a bfloat16 value. Scales are always finite: non-finite inputs stay
non-finite, never saturate. docs/float8.md has the details.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from amp_jax._src import compat, jaxprs
from amp_jax._src.backends import Backend
from amp_jax._src.context import Context
from amp_jax._src.decision import Decision, Reason, Variant, Why, float8_scope, float8_text
from amp_jax._src.policy import HIGH_DTYPE, Policy, is_managed_float
from amp_jax._src.rules.base import acc_dtype
from amp_jax._src.rules.dots.lowdot import DotDims, dot_transpose

#: ``Policy(float8=...)`` values.
RECIPES = ("off", "tensorwise", "rowwise")

#: forward operands (weights and activations) and the backward cotangent.
FWD_DTYPE = np.dtype(jnp.float8_e4m3fn)
BWD_DTYPE = np.dtype(jnp.float8_e5m2)

#: fp8 tensor cores multiply 16-deep tiles: shorter contractions stay bf16.
MIN_CONTRACTION = 16

_LOW = np.dtype(jnp.bfloat16)

_MIN_SCALE = 2.0**-126  # smallest normal float32: 0 / scale stays 0, x / scale stays finite


# -- which dots --------------------------------------------------------------------------


def skip_reason(policy: Policy, eqn: compat.Eqn) -> str | None:
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
    k, flops = cast(tuple[int, int], jaxprs.contraction_and_flops(eqn))  # (a dot: not None)
    if k < MIN_CONTRACTION:
        return f"contraction {k} < {MIN_CONTRACTION}: too short for fp8"
    if flops < policy.float8_min_flops:
        return f"{flops} FLOPs < Policy.float8_min_flops={policy.float8_min_flops}: too small"
    return None


def applies(policy: Policy, vjp_rules: bool, eqn: compat.Eqn) -> bool:
    """Whether ``eqn``, lowered under ``policy``, runs as an fp8 product
    (``vjp_rules``: outside the custom JVP rules that JAX transposes)."""
    return (
        getattr(policy, "float8", "off") != "off"
        and vjp_rules
        and policy.compute_dtype == _LOW
        and skip_reason(policy, eqn) is None
    )


# -- the variant of the dot rule ---------------------------------------------------------


def reason(policy: Policy, backend: Backend, eqn: compat.Eqn, variant: Variant) -> Reason | None:
    """Why a lowered ``allow`` eqn (planned to run ``variant``) runs in fp8 or
    not under a float8 ``policy`` on ``backend``. None when the policy has no
    float8, or when the eqn has an operand that is not a managed float."""
    if getattr(policy, "float8", "off") == "off":
        return None
    if not all(is_managed_float(getattr(v.aval, "dtype", None)) for v in eqn.invars):
        return None
    if variant is Variant.FLOAT8:
        return Reason(Why.FLOAT8, float8_text(policy.float8, backend))
    why = skip_reason(policy, eqn)
    if why is None and policy.compute_dtype != _LOW:
        why = f"compute dtype {policy.compute_dtype.name}: float8 needs a bfloat16 policy"
    why = why or "inside a custom JVP rule (JAX transposes it)"
    return Reason(Why.POLICY_CLASS, f"allow class, the bfloat16 policy's rule; not float8: {why}")


def variant_rule(ctx: Context, d: Decision) -> Callable[..., list[Any]]:
    """The fp8 rule of ``dot_general`` under ``ctx``'s policy and backend (its
    ``FLOAT8`` variant), of the recipe of the rule of ``Policy.rules`` that
    decided it (``d.rule``), if one did."""
    recipe = d.rule.recipe if d.rule is not None and d.rule.recipe != "off" else ctx.policy.float8
    return functools.partial(float8_dot_rule, recipe=recipe, backend=ctx.backend)


# -- scales and quantization -------------------------------------------------------------------


def _fp8_max(dtype: np.dtype) -> float:
    return float(jnp.finfo(dtype).max)


def scale_of(x: jax.Array, dtype: DTypeLike, axes: tuple[int, ...] | None = None) -> jax.Array:
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


def quantize(x: jax.Array, dtype: DTypeLike, scale: jax.Array) -> jax.Array:
    """``x / scale`` in fp8 ``dtype``: finite values clamp to its range, inf/nan become NaN."""
    dtype = np.dtype(dtype)
    m = _fp8_max(dtype)
    xs = x.astype(HIGH_DTYPE) / scale
    q = jnp.clip(xs, -m, m)
    q = jnp.where(jnp.isfinite(xs), q, jnp.nan)
    return q.astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: DTypeLike = _LOW) -> jax.Array:
    """``q * scale`` in ``dtype`` (exact for a power-of-two scale within range)."""
    return q.astype(dtype) * scale.astype(dtype)


def round_trip(x: jax.Array, dtype: DTypeLike, axes: tuple[int, ...] | None = None) -> jax.Array:
    """``x`` through fp8 ``dtype`` with a dynamic scale, back in bfloat16."""
    s = scale_of(x, dtype, axes)
    return dequantize(quantize(x, dtype, s), s)


def _kept(ndim: int, contract: Sequence[int], batch: Sequence[int]) -> tuple[int, ...]:
    return tuple(d for d in range(ndim) if d not in (*contract, *batch))


# -- the rule ------------------------------------------------------------------------------------


def _placed(scale: jax.Array, src: tuple[int, ...], dst: tuple[int, ...], ndim: int) -> jax.Array:
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


def _native_dot(
    qx: jax.Array,
    sx: jax.Array,
    qy: jax.Array,
    sy: jax.Array,
    dims: lax.DotDimensionNumbers,
    acc: DTypeLike,
    extra: dict[str, Any],
    rowwise: bool,
) -> jax.Array:
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


@dataclasses.dataclass(frozen=True)
class _Dot:
    """The static description of one fp8 ``dot_general`` (hashable: a cache key)."""

    dims: lax.DotDimensionNumbers  # dot_general's dimension_numbers
    acc: np.dtype  # the dtype the products are written in
    out_sharding: Any  # (a sharding, or None)
    recipe: str  # "tensorwise" or "rowwise"
    x_dtype: np.dtype  # the operands' dtypes (their gradients are cast back to them)
    y_dtype: np.dtype
    native: bool = False  # a dot of the fp8 operands (else dequantized, emulated)

    @property
    def rowwise(self) -> bool:
        return self.recipe == "rowwise"

    @property
    def extra(self) -> dict[str, Any]:
        return {} if self.out_sharding is None else {"out_sharding": self.out_sharding}

    def axes(self, reduce_axes: Sequence[int]) -> tuple[int, ...] | None:
        """The amax axes of a scale: ``reduce_axes`` (rowwise) or all (tensorwise)."""
        return tuple(reduce_axes) if self.rowwise else None

    def quantized(
        self, v: jax.Array, dtype: DTypeLike, reduce_axes: Sequence[int]
    ) -> tuple[jax.Array, jax.Array]:
        s = scale_of(v, dtype, self.axes(reduce_axes))
        return quantize(v, dtype, s), s

    def qdq(self, v: jax.Array, dtype: DTypeLike, reduce_axes: Sequence[int]) -> jax.Array:
        return round_trip(v, dtype, self.axes(reduce_axes))


@dataclasses.dataclass(frozen=True)
class _Grid:
    """Operand and cotangent dims of one product, for its two backward products."""

    nx: int
    ny: int
    x_kept: tuple[int, ...]
    y_kept: tuple[int, ...]
    ct_x_kept: tuple[int, ...]  # ct dims: [batch, x kept, y kept]
    ct_y_kept: tuple[int, ...]

    @classmethod
    def of(cls, dims: lax.DotDimensionNumbers, nx: int, ny: int) -> _Grid:
        (xc, yc), (xb, yb) = dims
        nb = len(xb)
        x_kept, y_kept = _kept(nx, xc, xb), _kept(ny, yc, yb)
        ct_x_kept = tuple(range(nb, nb + len(x_kept)))
        ct_y_kept = tuple(range(nb + len(x_kept), nb + len(x_kept) + len(y_kept)))
        return cls(nx, ny, x_kept, y_kept, ct_x_kept, ct_y_kept)


def _product(d: _Dot, x: jax.Array, y: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """The forward product and the fp8 operands with their scales (rowwise: one
    scale per row of the non-contracted dims, amax over the contraction)."""
    (xc, yc), _ = d.dims
    (qx, sx), (qy, sy) = d.quantized(x, FWD_DTYPE, xc), d.quantized(y, FWD_DTYPE, yc)
    if d.native:
        out = _native_dot(qx, sx, qy, sy, d.dims, d.acc, d.extra, d.rowwise)
    else:
        xd, yd = dequantize(qx, sx), dequantize(qy, sy)
        out = lax.dot_general(xd, yd, d.dims, preferred_element_type=d.acc, **d.extra)
    return out, (qx, sx, qy, sy)


def _operand_grads(
    d: _Dot,
    g: _Grid,
    ct_for_dx: jax.Array,
    y_for_dx: jax.Array,
    ct_for_dy: jax.Array,
    x_for_dy: jax.Array,
    acc: DTypeLike,
) -> tuple[jax.Array, jax.Array]:
    """``dx = ct . y`` and ``dy = x . ct``, written in ``acc``."""
    dims = DotDims(d.dims, g.nx, g.ny)
    # (like=: an operand of the result's shape, for explicit-sharding outputs)
    dx = dot_transpose(ct_for_dx, y_for_dx, dims, True, None, acc, like=x_for_dy)
    dy = dot_transpose(ct_for_dy, x_for_dy, dims, False, None, acc, like=y_for_dx)
    return dx, dy


def _native_backward(
    d: _Dot, g: _Grid, res: tuple[jax.Array, ...], ct: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """fp8 GEMMs ``dx = ct . y``, ``dy = x . ct`` with an e5m2 cotangent, their
    scales applied to the results."""
    (xc, yc), (xb, yb) = d.dims
    if d.rowwise:  # each product re-quantizes along its own contraction
        x, y = res
        qct_x, sct_x = d.quantized(ct, BWD_DTYPE, g.ct_y_kept)
        qct_y, sct_y = d.quantized(ct, BWD_DTYPE, g.ct_x_kept)
        qy, sy = d.quantized(y, FWD_DTYPE, g.y_kept)
        qx, sx = d.quantized(x, FWD_DTYPE, g.x_kept)
        ct_b = tuple(range(len(xb)))
        fx = _placed(sct_x, ct_b + g.ct_x_kept, (*xb, *g.x_kept), g.nx)
        fx = fx * _placed(sy, (*yb, *yc), (*xb, *xc), g.nx)
        fy = _placed(sct_y, ct_b + g.ct_y_kept, (*yb, *g.y_kept), g.ny)
        fy = fy * _placed(sx, (*xb, *xc), (*yb, *yc), g.ny)
    else:
        qx, sx, qy, sy = res
        qct_x, sct = d.quantized(ct, BWD_DTYPE, ())
        qct_y, fx, fy = qct_x, sct * sy, sct * sx
    dx, dy = _operand_grads(d, g, qct_x, qy, qct_y, qx, HIGH_DTYPE)
    # written in the policy's matmul output dtype, as the other rules do
    return (dx * fx).astype(d.acc), (dy * fy).astype(d.acc)


def _emulated_backward(
    d: _Dot, g: _Grid, res: tuple[jax.Array, ...], ct: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The backward products of dequantized fp8 operands (an e5m2 cotangent)."""
    if d.rowwise:
        x, y = res
        # dx = ct . y over y's kept dims; dy = x . ct over x's kept dims
        ct_for_dx = d.qdq(ct, BWD_DTYPE, g.ct_y_kept)
        y_for_dx = d.qdq(y, FWD_DTYPE, g.y_kept)
        ct_for_dy = d.qdq(ct, BWD_DTYPE, g.ct_x_kept)
        x_for_dy = d.qdq(x, FWD_DTYPE, g.x_kept)
    else:
        qx, sx, qy, sy = res
        ct_for_dx = ct_for_dy = round_trip(ct, BWD_DTYPE)
        y_for_dx, x_for_dy = dequantize(qy, sy), dequantize(qx, sx)
    return _operand_grads(d, g, ct_for_dx, y_for_dx, ct_for_dy, x_for_dy, d.acc)


@functools.cache
def _fp8_dot(d: _Dot) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The fp8 product ``d`` as a ``custom_vjp`` of its two operands."""

    def primal(x: jax.Array, y: jax.Array) -> jax.Array:
        with jax.named_scope(float8_scope(d.recipe)):
            return _product(d, x, y)[0]

    def fwd(x: jax.Array, y: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        with jax.named_scope(float8_scope(d.recipe)):
            out, quant = _product(d, x, y)
        # rowwise: the backward products re-quantize along their own contractions;
        # tensorwise: fp8 residuals, half the bytes of bf16 ones
        return out, ((x.astype(_LOW), y.astype(_LOW)) if d.rowwise else quant)

    def bwd(res: tuple[jax.Array, ...], ct: jax.Array) -> tuple[jax.Array, jax.Array]:
        g = _Grid.of(d.dims, res[0].ndim, res[1].ndim if d.rowwise else res[2].ndim)
        with jax.named_scope(float8_scope(d.recipe, backward=True)):
            backward = _native_backward if d.native else _emulated_backward
            dx, dy = backward(d, g, res, ct)
        return dx.astype(d.x_dtype), dy.astype(d.y_dtype)

    f = jax.custom_vjp(primal)
    f.defvjp(fwd, bwd)
    return f


def float8_dot_rule(
    eqn: compat.Eqn,
    invals: Sequence[jax.Array],
    compute_dtype: np.dtype,
    out_dtype: np.dtype = HIGH_DTYPE,
    *,
    recipe: str = "tensorwise",
    backend: Backend,
) -> list[Any]:
    """The fp8 allow rule of ``dot_general`` (same signature as the bf16 rules)."""
    del compute_dtype
    x, y = invals
    p = eqn.params
    native = backend.native_float8_matmul()
    f = _fp8_dot(
        _Dot(
            dims=p["dimension_numbers"],
            acc=acc_dtype(eqn, out_dtype),
            out_sharding=p.get("out_sharding"),
            recipe=recipe,
            x_dtype=np.dtype(x.dtype),
            y_dtype=np.dtype(y.dtype),
            native=native,
        )
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
