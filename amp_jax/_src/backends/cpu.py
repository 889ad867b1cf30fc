"""XLA:CPU: which dots it runs in bf16, in which operand layouts, and the
plan-time choice of those layouts (`plan_layouts`).

XLA:CPU (jaxlib 0.10 to 0.12) runs a bf16 x bf16 -> f32 dot in its fast kernel only
when the lhs contracts over its trailing dims and the rhs over its leading or
trailing dims; other layouts upcast to f32 in a slower kernel, and some (a
batched dot, a transposed lhs reaching the dot after its kernel was chosen)
have no kernel at all ("Unsupported element type for DotThunk"). Everything
here keeps amp's lowered dots in the layouts that run, and fast
(measured: benchmarks/results/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

import jax
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from amp_jax._src import compat, jaxprs, mesh

#: primitives measured slower in low precision than float32 on XLA:CPU
#: (one of the rows of ``amp_jax.BACKEND_SLOW_IN_LOW_PRECISION``)
SLOW_IN_LOW_PRECISION = frozenset({"conv_general_dilated"})

#: why ``follow`` ops stay float32 on XLA:CPU (`Backend.low_elementwise`): its
#: float normalization rewrites every bfloat16 (and float16) elementwise op as
#: convert -> float32 op -> convert, measured in the optimized HLO of
#: benchmarks/compile_time.py (mlp: 162 converts with bf16 elementwise ops, 12 without)
ELEMENTWISE_IN_F32 = (
    "XLA:CPU computes {dtype} elementwise ops in float32 (a convert each way): kept as written"
)

#: the clear (numerically neutral) primitives XLA:CPU computes in float32 when
#: given bfloat16 operands, as it does elementwise ops: its float normalization
#: converts each input up and the result back down (only layout ops, reshape,
#: transpose, broadcast, slice, stay bfloat16). With `ELEMENTWISE_IN_F32` they are
#: not painted low: the dot that reads one casts its float32 result once, where a
#: low concatenate of N casts was N casts, N round trips and a cast (jax-md's
#: EnergyGraphNet: benchmarks/results/REAL_MODELS.md)
CLEAR_IN_F32 = frozenset(
    {
        "concatenate",
        "gather",
        "pad",
        "dynamic_slice",
        "dynamic_update_slice",
        "rev",
        "select_n",
        "max",
        "min",
        "scatter",
        "cummax",
        "cummin",
        "sort",
        "reduce_window_max",
        "reduce_window_min",
    }
)

_BF16 = np.dtype(jax.numpy.bfloat16)
_F32 = np.dtype(np.float32)


def runs_low(eqn: compat.Eqn) -> bool:
    """Whether XLA:CPU has a compute-dtype kernel for dot ``eqn``: not for a
    *batched* bf16 x bf16 -> f32 dot, which then stays float32."""
    (_, _), (xb, _) = eqn.params["dimension_numbers"]
    return not xb


def _split_factor(n: int) -> int:
    for f in (8, 4, 2, 3, 5, 7):
        if n % f == 0 and n > f:
            return f
    return 0


def materialized_transpose(x: jax.Array, perm: Sequence[int]) -> jax.Array:
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


def dot(
    a: jax.Array,
    b: jax.Array,
    dims: lax.DotDimensionNumbers,
    precision: lax.PrecisionLike,
    acc: DTypeLike | None,
    out_sharding: jax.sharding.Sharding | None = None,
) -> jax.Array:
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


def _guarded(out: jax.Array, a: jax.Array, leading: bool) -> jax.Array:
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


def _merged_dims(
    a: jax.Array, b: jax.Array, k: int, leading: bool
) -> tuple[jax.Array, jax.Array, tuple[int], tuple[int]]:
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


@dataclasses.dataclass(frozen=True, repr=False)
class DotLayout:
    """How XLA:CPU writes one eqn of a plan as a lowered dot (`plan_layouts`).

    Attributes:
      dot: the index of the ``dot_general`` eqn whose product this is.
      through: for the lhs and the rhs, the index of the ``transpose`` eqn
        whose operand is contracted directly, or None (the operand as written).
      dims: the dimension numbers that contract the operands read.
      swapped: the record of a ``transpose`` of the dot's result: the same dot
        with its lhs and rhs swapped.
      operands: the vars read as lhs and rhs.
      out_dtype: the dtype the dot writes.
      eqn: the dot eqn.
    """

    dot: int
    through: tuple[int | None, ...]
    dims: lax.DotDimensionNumbers
    swapped: bool
    #: (the eqn of this record binds a lowered dot; `ReadThrough` does not)
    binds_dot: ClassVar[bool] = True
    operands: tuple[Any, ...] = dataclasses.field(compare=False)  # (Atom: None in tests)
    out_dtype: np.dtype | None = dataclasses.field(default=None, compare=False)
    eqn: Any = dataclasses.field(default=None, compare=False)  # an Eqn (None in tests)

    def __repr__(self) -> str:
        via = [
            f"{s} via transpose {t}" for s, t in zip(("lhs", "rhs"), self.through) if t is not None
        ]
        head = f"dot {self.dot}" + (" swapped" if self.swapped else "")
        return f"DotLayout({', '.join([head, *via])}, dims={self.dims})"


@dataclasses.dataclass(frozen=True)
class ReadThrough:
    """A ``transpose`` eqn whose result only lowered dots read, each through
    it (their `DotLayout.through`): bound on its operand as stored, not cast.
    The dots cast that operand themselves, inside their custom JVP, so that
    its gradient leaves them in float32; a cast made for the transpose would
    be a second cast of the same value (dead, but in the jaxpr).

    Attributes:
      dots: the indices of the dot eqns that read it.
      eqns: those eqns (empty in tests).
    """

    dots: tuple[int, ...]
    eqns: tuple[Any, ...] = dataclasses.field(default=(), compare=False, repr=False)
    binds_dot: ClassVar[bool] = False


def plan_layouts(
    jaxpr: compat.Jaxpr, lowered: Mapping[int, np.dtype], skip: Collection[int] = ()
) -> dict[int, DotLayout | ReadThrough]:
    """XLA:CPU's layout choices for the lowered dots of ``jaxpr``, by eqn index.

    A dot reading a ``transpose`` contracts the transpose's operand directly
    (``x @ W.T`` with ``W`` stored (out, in), ``jnp.einsum`` spellings), so
    that the weight gradient comes out in ``W``'s own layout, not transposed
    back in float32 every step; a ``transpose`` of a lowered dot's result is
    the same dot with its operands swapped (`_swapped`).

    Args:
      jaxpr: the planned jaxpr.
      lowered: ``{index: dtype it writes}`` of the dot eqns amp's dot rule
        lowers to the compute dtype (operands: floats amp manages).
      skip: the eqns no rule evaluates (computed by a fused attention).
    """
    transposes: dict[compat.Var, tuple[int, compat.Var, tuple[int, ...]]] = {}
    dots: dict[compat.Atom, DotLayout] = {}
    out: dict[int, DotLayout | ReadThrough] = {}
    single_use: frozenset[compat.Var] | None = None
    for i, eqn in enumerate(jaxpr.eqns):
        if i in skip:
            continue
        if i in lowered:
            lay = _through_transposes(i, eqn, transposes, lowered[i])
            dots[eqn.outvars[0]] = lay
            if lay.through != (None, None):
                out[i] = lay
        elif eqn.primitive.name == "transpose" and not isinstance(eqn.invars[0], compat.Literal):
            src, perm = eqn.invars[0], tuple(eqn.params["permutation"])
            swapped = None
            if src in dots:
                single_use = _single_use(jaxpr) if single_use is None else single_use
                swapped = _swapped(dots[src], perm) if src in single_use else None
            if swapped is None:
                transposes[eqn.outvars[0]] = (i, src, perm)
            else:
                out[i] = swapped
    return _read_through(jaxpr, out)


def _read_through(
    jaxpr: compat.Jaxpr, out: dict[int, DotLayout | ReadThrough]
) -> dict[int, DotLayout | ReadThrough]:
    """``out`` with a `ReadThrough` record for each ``transpose`` eqn that
    only the dots of ``out`` read, through it."""
    through = {
        t
        for lay in out.values()
        if isinstance(lay, DotLayout)
        for t in lay.through
        if t is not None
    }
    if not through:
        return out
    _, consumers = jaxprs.def_use(jaxpr)
    outs = {v for v in jaxpr.outvars if not isinstance(v, compat.Literal)}
    for t in sorted(through - set(out)):
        v = jaxpr.eqns[t].outvars[0]
        readers = sorted(set(consumers.get(v, ())))
        if v in outs or not readers:
            continue
        if all(isinstance(r := out.get(c), DotLayout) and t in r.through for c in readers):
            out[t] = ReadThrough(tuple(readers), tuple(jaxpr.eqns[c] for c in readers))
    return out


def _single_use(jaxpr: compat.Jaxpr) -> frozenset[compat.Var]:
    """The vars of ``jaxpr`` that exactly one eqn reads, and no output."""
    _, consumers = jaxprs.def_use(jaxpr)
    outs = {v for v in jaxpr.outvars if not isinstance(v, compat.Literal)}
    return frozenset(v for v, c in consumers.items() if len(c) == 1 and v not in outs)


def _swapped(lay: DotLayout, perm: tuple[int, ...]) -> DotLayout | None:
    """For ``transpose(dot, perm)`` of a lowered dot that only the transpose
    reads: the same dot with its operands swapped, when ``perm`` puts the
    rhs's kept dims before the lhs's (in order). On XLA:CPU the product is
    then written in the layout its readers want (a per-example matvec
    ``vmap(lambda v: W @ v)``, Equinox's ``Linear``). Only where the swapped
    operands need no copy: ``b`` contracting its trailing dims, ``a`` its
    leading or trailing ones. None otherwise."""
    if lay.eqn.params.get("out_sharding") is not None:
        return None
    a, b = (v.aval for v in lay.operands)
    (ca, cb), (ba, bb) = lay.dims
    m, n, k = a.ndim - len(ca), b.ndim - len(cb), len(ca)
    if ba or bb or not m or not n or perm != (*range(m, m + n), *range(m)):
        return None
    if tuple(cb) != tuple(range(n, n + k)) or tuple(ca) not in (
        tuple(range(k)),
        tuple(range(m, m + k)),
    ):
        return None
    return DotLayout(
        lay.dot,
        lay.through[::-1],
        ((tuple(cb), tuple(ca)), ((), ())),
        True,
        lay.operands[::-1],
        lay.out_dtype,
        lay.eqn,
    )


def _through_transposes(
    i: int,
    eqn: compat.Eqn,
    transposes: Mapping[compat.Var, tuple[int, compat.Var, tuple[int, ...]]],
    out_dtype: np.dtype,
) -> DotLayout:
    """Dot eqn ``i`` with the ``transpose`` eqns that produced its operands
    undone, and the dimension numbers that contract them the same way (none
    undone where one reorders kept dims, which would reorder the result)."""
    dims = eqn.params["dimension_numbers"]
    plain = DotLayout(i, (None, None), dims, False, tuple(eqn.invars), out_dtype, eqn)
    if eqn.params.get("out_sharding") is not None:
        return plain
    (ca, cb), (ba, bb) = dims
    read: list[compat.Atom]
    through: list[int | None]
    new: list[tuple[tuple[int, ...], tuple[int, ...]]]
    read, through, new = [], [], []
    for v, c, b in ((eqn.invars[0], ca, ba), (eqn.invars[1], cb, bb)):
        hit = None if isinstance(v, compat.Literal) else transposes.get(v)
        if hit is not None:
            t, src, perm = hit
            kept = [perm[d] for d in range(len(perm)) if d not in c and d not in b]
            if kept == sorted(kept):
                read.append(src)
                through.append(t)
                new.append((tuple(perm[d] for d in c), tuple(perm[d] for d in b)))
                continue
        read.append(v)
        through.append(None)
        new.append((tuple(c), tuple(b)))
    if through == [None, None]:
        return plain
    (nca, nba), (ncb, nbb) = new
    return DotLayout(
        i, tuple(through), ((nca, ncb), (nba, nbb)), False, tuple(read), out_dtype, eqn
    )
