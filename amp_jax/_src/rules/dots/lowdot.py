"""The tangent product of a lowered ``dot_general``, with the transpose amp wants.

A lowered dot ``dot(cast(x), cast(y))`` gets a ``jax.custom_jvp`` (in
``lowering.py``) whose tangent is ``P(tx, yl) + P(ty, xl)``: ``P(t, o)`` is
`linear_dot_p`, the dot of ``cast(t)`` with the already low ``o``,
linear in ``t`` (and in ``o``). Because a JVP rule is all JAX needs,
forward mode (``jax.jvp``, ``jacfwd``, ``linearize``, Hessian-vector
products) works; because ``P`` has its own transpose rule, the cotangent
products of ``jax.grad`` are what amp wants in the backward pass: the
cotangent rounded to the compute dtype, multiplied with the low operand in
the backend's fast layouts, accumulated in float32. (JAX's own transpose of
a plain dot would multiply a float32 cotangent with a bf16 operand: a mixed,
slow, float32 product.) The transpose, batching and lowering rules all
write ordinary ``dot_general``s; ``P`` itself only appears in jaxprs of
forward-mode code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import jax
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.extend.core.primitives import dot_general_p
from jax.interpreters import ad, batching, mlir
from jax.typing import DTypeLike

from amp_jax._src import casting, compat
from amp_jax._src.backends import Backend, plain_dot

linear_dot_p = Primitive("amp_linear_dot")


def _perm_to(result_dims: list[int]) -> tuple[int, ...]:
    """Permutation taking a result whose axes are ``result_dims`` to sorted order."""
    return tuple(int(i) for i in np.argsort(result_dims))


class DotDims(NamedTuple):
    """A ``dot_general``'s dimension numbers with its operands' ranks: what the
    cotangent of either operand needs (`dot_transpose`).

    Attributes:
      dimension_numbers: ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``.
      lhs_ndim: the rank of the lhs.
      rhs_ndim: the rank of the rhs.
    """

    dimension_numbers: lax.DotDimensionNumbers
    lhs_ndim: int
    rhs_ndim: int

    def side(
        self, lhs: bool
    ) -> tuple[int, Sequence[int], Sequence[int], Sequence[int], Sequence[int]]:
        """``(ndim, contract, batch, other_contract, other_batch)`` of the lhs
        (``lhs``) or the rhs."""
        (lc, rc), (lb, rb) = self.dimension_numbers
        if lhs:
            return self.lhs_ndim, lc, lb, rc, rb
        return self.rhs_ndim, rc, rb, lc, lb


def dot_transpose(
    ct: jax.Array,
    other: jax.Array,
    dims: DotDims,
    wrt_lhs: bool,
    precision: lax.PrecisionLike,
    acc: DTypeLike | None,
    like: compat.ShapedArray | jax.Array | None = None,
    dot: Callable[..., jax.Array] = plain_dot,
) -> jax.Array:
    """Cotangent of one operand ``a`` of the dot ``dims`` (its lhs when
    ``wrt_lhs``) given the ``other`` operand. ``ct`` has dims [batch, lhs kept,
    rhs kept]; ``like``: an operand of the result's shape (explicit-sharding
    outputs); ``dot`` writes the product (a `Backend.dot`).
    """
    ndim, contract, batch, other_contract, other_batch = dims.side(wrt_lhs)
    other_ndim, ct_is_lhs_side = other.ndim, wrt_lhs
    nb = len(batch)
    a_kept = [d for d in range(ndim) if d not in contract and d not in batch]
    o_kept = [d for d in range(other_ndim) if d not in other_contract and d not in other_batch]
    n_lhs_kept = len(a_kept) if ct_is_lhs_side else len(o_kept)
    if ct_is_lhs_side:
        ct_o_kept = list(range(nb + len(a_kept), nb + len(a_kept) + len(o_kept)))
    else:
        ct_o_kept = list(range(nb, nb + n_lhs_kept))
    ct_batch = list(range(nb))
    # Contract ct's "other kept" axes with other's kept axes; batch over batch.
    # The leftover axes of `other` are its contracting dims, which pair with ours.
    o_left_as_a = [contract[list(other_contract).index(d)] for d in sorted(other_contract)]
    # Option 1: dot(ct, other) -> [batch, a_kept, other's leftover]
    dims1 = ((tuple(ct_o_kept), tuple(o_kept)), (tuple(ct_batch), tuple(other_batch)))
    res1 = list(batch) + a_kept + o_left_as_a
    # Option 2: dot(other, ct) -> [batch, other's leftover, a_kept]
    dims2 = ((tuple(o_kept), tuple(ct_o_kept)), (tuple(other_batch), tuple(ct_batch)))
    res2 = list(batch) + o_left_as_a + a_kept
    perm1, perm2 = _perm_to(res1), _perm_to(res2)
    ident = tuple(range(ndim))
    if perm2 == ident and perm1 != ident:
        return dot(other, ct, dims2, precision, acc, _explicit_out(like, res2))
    out = dot(ct, other, dims1, precision, acc, _explicit_out(like, res1))
    return out if perm1 == ident else jax.lax.transpose(out, perm1)


def _explicit_out(
    like: compat.ShapedArray | jax.Array | None, order: Sequence[int]
) -> jax.sharding.Sharding | None:
    return None if like is None else compat.explicit_sharding_in_order(like, order)


def linear_dot(t: jax.Array, o: jax.Array, *, t_is_lhs: bool, **params: Any) -> jax.Array:
    """``dot(cast(t), o)`` (``dot(o, cast(t))`` when not ``t_is_lhs``), ``o`` low.

    ``params``: ``dimension_numbers`` (the dot's dimension numbers, lhs first),
    ``precision``, ``acc`` (the result dtype), ``out_sharding`` (the dot's),
    ``compute_dtype``, ``backend`` (the `Backend` record whose ``dot``
    writes the products).
    """
    return linear_dot_p.bind(t, o, t_is_lhs=t_is_lhs, **params)


def _impl(
    t: jax.Array,
    o: jax.Array,
    *,
    t_is_lhs: bool,
    dimension_numbers: lax.DotDimensionNumbers,
    precision: lax.PrecisionLike,
    acc: DTypeLike | None,
    out_sharding: jax.sharding.Sharding | None,
    compute_dtype: np.dtype,
    backend: Backend,
) -> jax.Array:
    tl = casting.lower(t, compute_dtype)
    a, b = (tl, o) if t_is_lhs else (o, tl)
    return backend.dot(a, b, dimension_numbers, precision, acc, out_sharding)


def _abstract_eval(
    t: compat.ShapedArray,
    o: compat.ShapedArray,
    *,
    t_is_lhs: bool,
    dimension_numbers: lax.DotDimensionNumbers,
    precision: lax.PrecisionLike,
    acc: DTypeLike | None,
    out_sharding: jax.sharding.Sharding | None,
    compute_dtype: np.dtype,
    **_: object,
) -> compat.ShapedArray:
    # (the plain dot's own rule: shapes, shardings, shard_map's varying axes)
    tl = t.update(dtype=np.dtype(compute_dtype), weak_type=False)
    a, b = (tl, o) if t_is_lhs else (o, tl)
    out, _effects = dot_general_p.abstract_eval(
        a,
        b,
        dimension_numbers=dimension_numbers,
        precision=precision,
        preferred_element_type=acc,
        out_sharding=out_sharding,
    )
    return out


def _jvp(
    primals: Sequence[jax.Array], tangents: Sequence[jax.Array | ad.Zero], **params: Any
) -> tuple[jax.Array, jax.Array | ad.Zero]:
    t, o = primals
    dt, do = tangents
    out = linear_dot(t, o, **params)
    parts: list[jax.Array] = []
    if not isinstance(dt, ad.Zero):
        parts.append(linear_dot(dt, o, **params))
    if not isinstance(do, ad.Zero):
        parts.append(linear_dot(t, do, **params))
    if not parts:  # (JAX skips a rule whose tangents are all zero; kept for a direct call)
        return out, ad.Zero(compat.aval_of(out).to_tangent_aval())
    return out, functools.reduce(lambda a, b: a + b, parts)


def _transpose(
    ct: jax.Array | ad.Zero,
    t: Any,
    o: Any,
    *,
    t_is_lhs: bool,
    dimension_numbers: lax.DotDimensionNumbers,
    precision: lax.PrecisionLike,
    acc: DTypeLike | None,
    compute_dtype: np.dtype,
    backend: Backend,
    **_: object,
) -> list[jax.Array | None]:
    dot = backend.dot
    if isinstance(ct, ad.Zero):
        return [None, None]
    ctl = casting.lower(ct, compute_dtype)
    undefined_t = ad.is_undefined_primal(t)
    t_aval = t.aval if undefined_t else t
    o_aval = o.aval if ad.is_undefined_primal(o) else o
    known_t = None if undefined_t else casting.lower(t, compute_dtype)
    known_o = None if ad.is_undefined_primal(o) else o
    lhs, rhs = (known_t, known_o) if t_is_lhs else (known_o, known_t)
    lhs_aval, rhs_aval = (t_aval, o_aval) if t_is_lhs else (o_aval, t_aval)
    dims = DotDims(dimension_numbers, lhs_aval.ndim, rhs_aval.ndim)

    def d_lhs() -> jax.Array:
        return dot_transpose(ctl, cast(jax.Array, rhs), dims, True, precision, acc, lhs_aval, dot)

    def d_rhs() -> jax.Array:
        return dot_transpose(ctl, cast(jax.Array, lhs), dims, False, precision, acc, rhs_aval, dot)

    if t_is_lhs:
        ct_t = d_lhs() if undefined_t else None
        ct_o = d_rhs() if ad.is_undefined_primal(o) else None
    else:
        ct_t = d_rhs() if undefined_t else None
        ct_o = d_lhs() if ad.is_undefined_primal(o) else None
    return [
        None if ct_t is None else ct_t.astype(t_aval.dtype),
        None if ct_o is None else ct_o.astype(o_aval.dtype),
    ]


def _batch(
    args: Sequence[jax.Array],
    bdims: Sequence[int | None],
    *,
    t_is_lhs: bool,
    dimension_numbers: lax.DotDimensionNumbers,
    **params: Any,
) -> tuple[jax.Array, int]:
    """vmap: a batch dim on both operands becomes a dot batch dim; on one
    operand, a kept dim of it (no broadcast of the other operand)."""
    t, o = args
    bt, bo = bdims
    lhs, rhs = (t, o) if t_is_lhs else (o, t)
    bl, br = (bt, bo) if t_is_lhs else (bo, bt)
    (lc, rc), (lb, rb) = dimension_numbers

    def front(x: jax.Array, b: int | None) -> jax.Array:
        return x if b is None else jax.numpy.moveaxis(x, b, 0)

    def shift(ds: Sequence[int], b: int | None) -> tuple[int, ...]:
        return tuple(d + (b is not None) for d in ds)

    lhs, rhs = front(lhs, bl), front(rhs, br)
    lc, lb, rc, rb = shift(lc, bl), shift(lb, bl), shift(rc, br), shift(rb, br)
    if bl is not None and br is not None:
        new_dims = ((lc, rc), ((0, *lb), (0, *rb)))
        out_dim = 0
    elif bl is not None:  # the first kept dim of the lhs
        new_dims = ((lc, rc), (lb, rb))
        out_dim = len(lb)
    else:  # the first kept dim of the rhs
        new_dims = ((lc, rc), (lb, rb))
        out_dim = len(lb) + (lhs.ndim - len(lc) - len(lb))
    t, o = (lhs, rhs) if t_is_lhs else (rhs, lhs)
    params["out_sharding"] = None  # (of the unbatched result; derived again)
    return linear_dot(t, o, t_is_lhs=t_is_lhs, dimension_numbers=new_dims, **params), out_dim


linear_dot_p.def_impl(_impl)
linear_dot_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[linear_dot_p] = _jvp
ad.primitive_transposes[linear_dot_p] = _transpose
batching.primitive_batchers[linear_dot_p] = _batch
mlir.register_lowering(linear_dot_p, mlir.lower_fun(_impl, multiple_results=False))
