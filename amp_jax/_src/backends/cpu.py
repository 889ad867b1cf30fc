"""XLA:CPU: which dots it runs in bf16, in which operand layouts, and the
bookkeeping that finds those layouts.

XLA:CPU (jaxlib 0.10) runs a bf16 x bf16 -> f32 dot in its fast kernel only
when the lhs contracts over its trailing dims and the rhs over its leading or
trailing dims; other layouts upcast to f32 in a slower kernel, and some (a
batched dot, a transposed lhs reaching the dot after its kernel was chosen)
have no kernel at all ("Unsupported element type for DotThunk"). Everything
here keeps amp's lowered dots in the layouts that run, and fast
(measured: benchmarks/RESULTS.md).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from amp_jax._src import compat, jaxprs, mesh

#: primitives measured slower in low precision than float32 on XLA:CPU
#: (one of the rows of ``amp_jax.BACKEND_SLOW_IN_LOW_PRECISION``)
SLOW_IN_LOW_PRECISION = frozenset({"conv_general_dilated"})

_BF16 = np.dtype(jax.numpy.bfloat16)
_F32 = np.dtype(np.float32)


def runs_low(eqn: Any) -> bool:
    """Whether XLA:CPU has a compute-dtype kernel for dot ``eqn``: not for a
    *batched* bf16 x bf16 -> f32 dot, which then stays float32."""
    (_, _), (xb, _) = eqn.params["dimension_numbers"]
    return not xb


def _split_factor(n: int) -> int:
    for f in (8, 4, 2, 3, 5, 7):
        if n % f == 0 and n > f:
            return f
    return 0


def materialized_transpose(x: Any, perm: Sequence[int]) -> Any:
    """``lax.transpose(x, perm)`` in a form XLA keeps as a copy.

    XLA folds a plain ``transpose`` that feeds a ``dot`` back into the dot's
    dimension numbers, which on XLA:CPU turns a fast bf16 dot into a slow
    one (see `dot`). A transpose written as reshape -> transpose -> reshape
    (one dimension split in two) is left alone by the simplifier and becomes
    one copy fusion. Falls back to a plain transpose when no dimension can be
    split.
    """
    perm = tuple(int(p) for p in perm)
    if perm == tuple(range(x.ndim)):
        return x
    shape = tuple(x.shape)
    split = next((d for d in perm if _split_factor(shape[d])), None)
    if split is None:
        return lax.transpose(x, perm)
    f = _split_factor(shape[split])
    shape3 = shape[:split] + (shape[split] // f, f) + shape[split + 1 :]
    # dims of the split array: d < split -> d, split -> (split, split+1), d > split -> d+1
    new_perm: list[int] = []
    for d in perm:
        if d < split:
            new_perm.append(d)
        elif d == split:
            new_perm += [split, split + 1]
        else:
            new_perm.append(d + 1)
    out_shape = tuple(shape[d] for d in perm)
    return lax.reshape(lax.transpose(lax.reshape(x, shape3), tuple(new_perm)), out_shape)


def dot(a: Any, b: Any, dims: Any, precision: Any, acc: Any, out_sharding: Any = None) -> Any:
    """A lowered ``dot_general`` with the operand layouts XLA:CPU runs fast.

    An operand contracting other dims than the fast kernel wants is
    transposed explicitly (`materialized_transpose`, a copy of a bf16 array);
    the contracting dims, and the rhs's kept dims, are merged (`_merged_dims`);
    barriers keep XLA from folding a transpose into the dot after its kernel
    was chosen (`_guarded`). Non-bf16 dots are left as they are; batched ones
    too, but that a batched bf16 dot writing float32 (one amp lowered that an
    outer ``vmap`` batched) takes its operands upcast to float32: the same
    products and sums, in a kernel that exists.
    """
    (ca, cb), (ba, bb) = dims
    if (ba or bb) and np.dtype(a.dtype) == _BF16 == np.dtype(b.dtype):
        if acc is None or np.dtype(acc) != _BF16:
            a, b = a.astype(_F32), b.astype(_F32)
    if (
        ba
        or bb
        or np.dtype(a.dtype) != _BF16
        or np.dtype(b.dtype) != _BF16
        or out_sharding is not None
    ):
        extra = {} if out_sharding is None else {"out_sharding": out_sharding}
        return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=acc, **extra)
    ca, cb = tuple(ca), tuple(cb)
    na, nb, k = a.ndim, b.ndim, len(ca)
    if ca != tuple(range(na - k, na)):
        a_kept = [d for d in range(na) if d not in ca]
        a = materialized_transpose(a, (*a_kept, *ca))
        ca = tuple(range(na - k, na))
    elif k and not mesh.partitioned_by_mesh():
        # XLA:CPU picks a dot's kernel before its transpose folding runs: a
        # transpose that reaches the lhs afterwards (JAX's own, from a vmap or
        # a transposition of the caller's code) leaves a dot only DotThunk
        # takes, without a kernel. Each operand behind its own barrier (no
        # copy; a pair would tie a constant operand to a linear one).
        a, b = lax.optimization_barrier(a), lax.optimization_barrier(b)
    if cb != tuple(range(k)) and cb != tuple(range(nb - k, nb)):
        b_kept = [d for d in range(nb) if d not in cb]
        b = materialized_transpose(b, (*cb, *b_kept))
        cb = tuple(range(k))
    leading = bool(k) and cb == tuple(range(k))
    out_shape = (*a.shape[: na - k], *(b.shape[k:] if leading else b.shape[: nb - k]))
    if k and (k > 1 or nb - k > 1) and not mesh.partitioned_by_mesh():
        a, b, ca, cb = _merged_dims(a, b, k, leading)
    out = lax.dot_general(
        a, b, ((ca, cb), ((), ())), precision=precision, preferred_element_type=acc
    )
    if out.shape != out_shape:
        out = lax.reshape(out, out_shape)
    return _guarded(out, a, leading)


def _guarded(out: Any, a: Any, leading: bool) -> Any:
    """``out`` behind a barrier where the rhs contracted its leading dims.

    XLA's algebraic simplifier rewrites transpose(dot(a, b)) as dot(b, a),
    after XLA:CPU chose the dot's kernel: with the rhs contracting its leading
    dims, the swapped lhs would contract them, a dot without a bf16 kernel.
    The transpose of a caller (``(x @ w).T``) or of JAX's own transpose rule
    (a backward written with ``jax.vjp`` that amp rewrites: Equinox's
    checkpointed while loop, diffrax's default adjoint) meets the dot in
    another jaxpr or as a later eqn. Behind a barrier the transpose stays a
    float32 copy. A matvec gets one too: batched by a vmap outside amp, it
    gains kept dims and its result a transpose. Not for a dot writing bf16
    (``allow_outputs="compute"``): XLA:CPU has a kernel for it, and a barrier
    would pin the bf16 rounding that XLA elides with the convert after it.
    """
    if leading and out.dtype != a.dtype:
        return lax.optimization_barrier(out)
    return out


def _merged_dims(a: Any, b: Any, k: int, leading: bool) -> tuple[Any, Any, Any, Any]:
    """``a`` (contracting its ``k`` trailing dims) and ``b`` (its ``k`` leading
    dims if ``leading``, else its ``k`` trailing ones, in the same order) with
    the contracting dims merged into one and ``b``'s kept dims into one, and the
    new contracting dims: reshapes of contiguous dims (bitcasts), the same
    products summed in the same order.

    XLA canonicalizes a dot with several contracting dims, or a rhs with
    several kept dims, into one whose rhs has its contraction first: a rhs
    contracting its trailing dims (the input gradient of an attention
    projection) would be transposed by a copy in every step.
    """
    n = int(np.prod(a.shape[a.ndim - k :]))
    m = int(np.prod(b.shape[k:] if leading else b.shape[: b.ndim - k]))
    a = lax.reshape(a, (*a.shape[: a.ndim - k], n))
    if leading:
        return a, lax.reshape(b, (n, m)), (a.ndim - 1,), (0,)
    return a, lax.reshape(b, (m, n)), (a.ndim - 1,), (1,)


class Layouts:
    """The per-evaluation state of XLA:CPU's dot layouts, for one jaxpr.

    A dot reading a ``transpose`` contracts the transpose's operand directly
    (``x @ W.T`` with ``W`` stored (out, in), ``jnp.einsum`` spellings), so
    that the weight gradient comes out in ``W``'s own layout, not transposed
    back in float32 every step; a ``transpose`` of a lowered dot's result is
    the same dot with its operands swapped (`swapped`).
    """

    def __init__(self, jaxpr: Any):
        self.jaxpr = jaxpr
        #: {var: (operand var, permutation)} of the ``transpose`` eqns evaluated
        self.transposes: dict[Any, tuple[Any, tuple[int, ...]]] = {}
        #: {var: (eqn, operands, dimension numbers, out dtype)} of the lowered dots
        self.dots: dict[Any, tuple[Any, list[Any], Any, Any]] = {}

    @functools.cached_property
    def single_use(self) -> frozenset[Any]:
        """The vars of the jaxpr that exactly one eqn reads, and no output
        (made once, and only when a transpose reads a dot's result)."""
        _, consumers = jaxprs.def_use(self.jaxpr)
        outs = {v for v in self.jaxpr.outvars if not isinstance(v, compat.Literal)}
        return frozenset(v for v, c in consumers.items() if len(c) == 1 and v not in outs)

    def swapped(self, src: Any, perm: tuple[int, ...]) -> tuple[Any, list[Any], Any, Any] | None:
        """For ``transpose(src, perm)`` of a lowered dot's result that only the
        transpose reads: ``(eqn, swapped operands, dims, out dtype)`` of the same
        dot with its operands swapped, when ``perm`` puts the rhs's kept dims
        before the lhs's (in order). On XLA:CPU the product is then written in
        the layout its readers want (a per-example matvec ``vmap(lambda v: W @
        v)``, Equinox's ``Linear``). Only where the swapped operands need no
        copy: ``b`` contracting its trailing dims, ``a`` its leading or
        trailing ones. None otherwise."""
        if src not in self.dots or src not in self.single_use or mesh.partitioned_by_mesh():
            return None
        eqn, (a, b), dims, out_dtype = self.dots[src]
        if eqn.params.get("out_sharding") is not None:
            return None
        (ca, cb), (ba, bb) = dims if dims is not None else eqn.params["dimension_numbers"]
        m, n, k = a.ndim - len(ca), b.ndim - len(cb), len(ca)
        if ba or bb or not m or not n or perm != (*range(m, m + n), *range(m)):
            return None
        if tuple(cb) != tuple(range(n, n + k)) or tuple(ca) not in (
            tuple(range(k)),
            tuple(range(m, m + k)),
        ):
            return None
        return eqn, [b, a], ((tuple(cb), tuple(ca)), ((), ())), out_dtype

    def through_transposes(self, eqn: Any, env: Any, compute_dtype: Any) -> Any:
        """The operands of dot ``eqn`` with the ``transpose`` eqns that produced
        them undone, and the dimension numbers that contract them the same way;
        None when no operand is such a transpose (or one reorders kept dims,
        which would reorder the result)."""
        (ca, cb), (ba, bb) = eqn.params["dimension_numbers"]
        if eqn.params.get("out_sharding") is not None or mesh.partitioned_by_mesh():
            return None
        out, dims, changed = [], [], False
        for v, c, b in ((eqn.invars[0], ca, ba), (eqn.invars[1], cb, bb)):
            hit = None if isinstance(v, compat.Literal) else self.transposes.get(v)
            if hit is not None:
                src, perm = hit
                kept = [perm[d] for d in range(len(perm)) if d not in c and d not in b]
                if kept == sorted(kept) and src in env.vals:
                    # the cast the transpose read, if it read one (a cast made once)
                    cast = env.casts.get((src, np.dtype(compute_dtype)))
                    out.append(env.read(src, None) if cast is None else cast)
                    dims.append((tuple(perm[d] for d in c), tuple(perm[d] for d in b)))
                    changed = True
                    continue
            out.append(env.read(v, None))
            dims.append((tuple(c), tuple(b)))
        if not changed:
            return None
        (nca, nba), (ncb, nbb) = dims
        return out, ((nca, ncb), (nba, nbb))
