"""The rule table: how amp binds each primitive.

Every eqn of a rewritten jaxpr is bound through one `EqnRule`, looked
up by primitive name in `TABLE` (`rule_for`), as the eqn's
`Decision` says: the default rule binds the
primitive on operands cast to its color's dtype; higher-order primitives get
the generic rule that rewrites their sub-jaxprs through the context
(``ctx.plan``, ``ctx.rewrite``, ``ctx.evaluate``), with ``scan``,
``shard_map`` and ``custom_jvp_call`` rules of their own; broadcasting elementwise ops read implicitly broadcast operands
before casting them; ``allow`` ops run the low-precision *function* of their
rule, or of the variant the plan chose (float32 where the backend has no
kernel, fp8 under a float8 policy: ``float8.py``). Each rule also answers
`EqnRule.reads_low`: whether it reads an operand only in the compute
dtype, which is what the scan cast hoisting needs to know.

A lowered ``dot_general`` or ``conv_general_dilated`` gets a ``jax.custom_jvp``
whose tangent products take compute-dtype operands (a dot's are ``lowdot``'s
linear dot; a conv's write compute-dtype results), so that under ``jax.grad``
their cotangent products also take compute-dtype operands (JAX's own transpose
rules would multiply a float32 cotangent with a bf16 operand: a mixed, slow,
float32 product), and forward mode works.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from amp_jax._src import casting, compat, lowdot
from amp_jax._src.decision import Color, Decision, Kind, OpClass, Variant
from amp_jax._src.policy import HIGH_DTYPE, is_managed_float

#: ``rule(eqn, invals, compute_dtype, out_dtype) -> list of outputs``: the
#: low-precision function of an ``allow`` primitive ([`register_rule`][amp_jax.register_rule]).
Rule = Callable[[Any, Sequence[Any], np.dtype, np.dtype], list[Any]]


class EqnRule:
    """How amp binds one primitive. The default: bind it with every operand
    cast to the dtype of the eqn's color (`casting.target`)."""

    def evaluate(self, ctx: Any, eqn: Any, d: Decision, env: Any) -> list[Any]:
        """The outputs of ``eqn`` as decided by ``d``, under ``ctx`` (policy,
        backend), reading operands from ``env``."""
        cd = ctx.policy.compute_dtype
        return compat.bind_eqn(
            eqn, [env.read(v, casting.target(casting.dtype_of(v), d.color, cd)) for v in eqn.invars]
        )

    def reads_low(self, ctx: Any, eqn: Any, d: Decision, atom: Any) -> bool:
        """Whether ``evaluate`` reads operand ``atom`` only in the compute dtype."""
        return d.color is Color.LOW

    def no_low_kernel(self, eqn: Any, backend: str) -> bool:
        """Whether ``backend`` has no compute-dtype kernel for ``eqn`` (an allow
        op): planning then keeps it in float32, with that reason."""
        return False


class BroadcastRule(EqnRule):
    """n-ary elementwise ops (``add``, ``mul``, ``max``, ``select_n``, ...).

    Painted low, such an op with an operand held in float32 that it would
    cast down (a parameter, a float32 result) computes in float32 instead,
    the low operands cast up, and casts its result to the compute dtype (as
    ``torch.autocast`` promotes mixed elementwise ops to the widest input):
    whatever broadcast the float32 operand gets, the implicit one of the op or
    one an outer ``jax.vmap`` adds to an unbatched parameter, its transpose
    -- a sum over the batch -- runs in float32. With only low operands it
    reads a size-1-broadcast operand (a bias of shape [1, n] added to
    [b, n]) broadcast *before* the cast, for the same reason."""

    def evaluate(self, ctx: Any, eqn: Any, d: Decision, env: Any) -> list[Any]:
        if d.color is not Color.LOW:
            return super().evaluate(ctx, eqn, d, env)
        cd = ctx.policy.compute_dtype
        if any(_held_wide(env, v, cd) for v in eqn.invars):
            outs = compat.bind_eqn(eqn, [env.read(v, casting.dtype_of(v)) for v in eqn.invars])
            return [casting.lower(o, cd) for o in outs]
        shape = tuple(getattr(eqn.outvars[0].aval, "shape", ()))
        return compat.bind_eqn(
            eqn,
            [
                env.read_broadcast(v, casting.target(casting.dtype_of(v), d.color, cd), shape)
                for v in eqn.invars
            ],
        )

    def reads_low(self, ctx: Any, eqn: Any, d: Decision, atom: Any) -> bool:
        # (an operand wider than the compute dtype makes the op compute in it)
        out_shape = tuple(getattr(eqn.outvars[0].aval, "shape", ()))
        dtype = casting.dtype_of(atom)
        narrow = casting.target(dtype, Color.LOW, ctx.policy.compute_dtype) in (None, dtype)
        return d.color is Color.LOW and tuple(atom.aval.shape) == out_shape and narrow


def _held_wide(env: Any, atom: Any, compute_dtype: np.dtype) -> bool:
    """Whether ``env`` holds variable ``atom`` in a float dtype wider than the
    one a low op reads it in (a float32 value it would cast down)."""
    if isinstance(atom, compat.Literal):
        return False
    low = casting.target(casting.dtype_of(atom), Color.LOW, compute_dtype)
    held = env.read(atom, None).dtype
    return low is not None and np.dtype(held).itemsize > np.dtype(low).itemsize


class ExpandRule(EqnRule):
    """Ops whose derivative adds values: the transpose of ``broadcast_in_dim``
    and ``tile`` (``jnp.tile``, ``jnp.repeat``, ``broadcast_to``, explicit
    bias broadcasts) sums over the copies; of ``gather`` (an embedding lookup,
    indexing with repeated indices), ``sort`` and ``top_k``, it scatter-adds;
    the JVP rules of the selections ``reduce_max``/``reduce_min`` count ties
    and sum the tangents of the chosen elements, those of ``cummax``/``cummin``
    and of overlapping max pooling (``reduce_window_max``/``min``, whose
    transpose is ``select_and_scatter_add``) sum the cotangents of every
    position that chose an element; ``scatter-add`` sums in its forward pass.
    Painted low, such an op reads its float operands in their own dtype
    (float32) and casts its float *results* to the compute dtype, so that
    these sums accumulate in float32, as the implicit broadcasts of
    `BroadcastRule` do; the values are the same (a selection of
    compute-dtype values is exact in float32)."""

    #: the primitives whose derivative sums whatever their shapes
    ALWAYS = frozenset(
        {
            "gather",
            "sort",
            "top_k",
            "reduce_max",
            "reduce_min",
            "cummax",
            "cummin",
            "reduce_window_max",
            "reduce_window_min",
            "scatter-add",
            "scatter_add",
        }
    )

    def evaluate(self, ctx: Any, eqn: Any, d: Decision, env: Any) -> list[Any]:
        if d.color is not Color.LOW or not self.sums_in_transpose(eqn):
            return super().evaluate(ctx, eqn, d, env)
        cd = ctx.policy.compute_dtype
        outs = compat.bind_eqn(eqn, [env.read(v, casting.dtype_of(v)) for v in eqn.invars])
        return [casting.lower(o, cd) for o in outs]

    @classmethod
    def sums_in_transpose(cls, eqn: Any) -> bool:
        if not any(is_managed_float(casting.dtype_of(v)) for v in eqn.invars):
            return False
        if eqn.primitive.name in cls.ALWAYS:
            return True
        x, out = eqn.invars[0].aval, eqn.outvars[0].aval
        return int(np.prod(out.shape)) > int(np.prod(x.shape))

    def reads_low(self, ctx: Any, eqn: Any, d: Decision, atom: Any) -> bool:
        return d.color is Color.LOW and not self.sums_in_transpose(eqn)


class AllowRule(EqnRule):
    """An ``allow`` primitive: painted low, it runs ``fn`` (a `Rule`) on
    its operands as stored, or the function of the variant its decision names
    (`register_variant`); otherwise (kept high, or not in the allow
    class under this policy) it is bound like any other op."""

    def __init__(self, fn: Rule | None = None):
        self.fn = fn
        #: variant -> ``make(ctx) -> Rule``
        self.variants: dict[Variant, Callable[[Any], Rule]] = {}

    def low_fn(self, ctx: Any, eqn: Any) -> Rule:
        """The function of a lowered eqn. Inside custom JVP rules (which JAX
        transposes: no custom_vjp may appear) the plain default."""
        return self.fn if self.fn is not None and ctx.vjp_rules else default_allow_rule

    def evaluate(self, ctx: Any, eqn: Any, d: Decision, env: Any) -> list[Any]:
        if not d.lowered:
            return super().evaluate(ctx, eqn, d, env)
        invals = [env.read(v, None) for v in eqn.invars]
        if d.variant is Variant.FLOAT32:  # no compute-dtype kernel on this backend
            return default_allow_rule(eqn, [v.astype(HIGH_DTYPE) for v in invals], HIGH_DTYPE)
        make = self.variants.get(d.variant)
        fn = make(ctx) if make is not None and ctx.vjp_rules else self.low_fn(ctx, eqn)
        return fn(eqn, invals, ctx.policy.compute_dtype, d.out_dtype)

    def reads_low(self, ctx: Any, eqn: Any, d: Decision, atom: Any) -> bool:
        return d.color is Color.LOW and d.variant is not Variant.FLOAT32


class DotRule(AllowRule):
    """``dot_general``: low-precision forward and backward, with the operand
    layouts each backend runs fast; batched dots stay float32 on XLA:CPU; the
    fp8 products of a float8 policy are its ``FLOAT8`` variant (``float8.py``).

    On XLA:CPU a dot contracts the operand of a ``transpose`` that feeds it
    (``x @ W.T`` with ``W`` stored (out, in), ``jnp.einsum`` spellings), so
    that the weight gradient comes out in ``W``'s own layout. Otherwise the
    gradient is computed (in, out) and transposed back in float32, and the
    transposed weight is copied every step (left to XLA:CPU, the transpose is
    folded into the bf16 dot, which then runs in float32; benchmarks/peers.py).
    """

    def evaluate(self, ctx: Any, eqn: Any, d: Decision, env: Any) -> list[Any]:
        if d.lowered and d.variant is Variant.COMPUTE and _cpu_fast_layouts(ctx.backend):
            fn = self.low_fn(ctx, eqn)
            if _is_dot_rule(fn):
                found = _through_transposes(eqn, env, ctx.policy.compute_dtype)
                invals, dims = found or ([env.read(v, None) for v in eqn.invars], None)
                if hasattr(env, "dots"):
                    env.dots[eqn.outvars[0]] = (eqn, invals, dims, d.out_dtype)
                return fn(eqn, invals, ctx.policy.compute_dtype, d.out_dtype, dims=dims)
        return super().evaluate(ctx, eqn, d, env)

    def low_fn(self, ctx: Any, eqn: Any) -> Rule:
        if not ctx.vjp_rules:
            return default_allow_rule
        return functools.partial(dot_general_rule, backend=ctx.backend)

    def no_low_kernel(self, eqn: Any, backend: str) -> bool:
        floats = all(is_managed_float(casting.dtype_of(v)) for v in eqn.invars)
        return floats and _cpu_batched(eqn, backend)


class TransposeRule(EqnRule):
    """``transpose``: bound as written, and recorded in ``env.transposes`` for
    the dots that read its result (`DotRule`)."""

    def evaluate(self, ctx: Any, eqn: Any, d: Decision, env: Any) -> list[Any]:
        src = eqn.invars[0]
        if isinstance(src, compat.Literal) or not hasattr(env, "transposes"):
            return super().evaluate(ctx, eqn, d, env)
        perm = tuple(eqn.params["permutation"])
        record = env.dots[src] if src in env.dots and src in env.single_use else None
        swapped = _swapped_dot(ctx, record, perm)
        if swapped is not None:
            want = casting.target(casting.dtype_of(src), d.color, ctx.policy.compute_dtype)
            return [swapped if want is None else casting.cast(swapped, want)]
        env.transposes[eqn.outvars[0]] = (src, perm)
        return super().evaluate(ctx, eqn, d, env)


def _swapped_dot(ctx: Any, record: Any, perm: tuple[int, ...]) -> Any:
    """The transpose ``perm`` of a lowered dot's result (``record``, from
    ``env.dots``; the transpose is its only reader), computed as the same dot with its operands swapped, when
    ``perm`` puts the rhs's kept dims before the lhs's (in order): on XLA:CPU
    the product is then written in the layout its readers want, where the
    transpose of a bf16 dot's result (a per-example matvec ``vmap(lambda v: W
    @ v)``, Equinox's ``Linear``) would make every elementwise op after it
    (and its backward) read a transposed array. None otherwise."""
    if record is None or compat.partitioned_by_mesh():
        return None
    eqn, (a, b), dims, out_dtype = record
    if eqn.params.get("out_sharding") is not None:
        return None
    (ca, cb), (ba, bb) = dims if dims is not None else eqn.params["dimension_numbers"]
    m, n, k = a.ndim - len(ca), b.ndim - len(cb), len(ca)
    if ba or bb or not m or not n or perm != (*range(m, m + n), *range(m)):
        return None
    # (only where the swapped operands need no copy: ``b`` contracting its
    # trailing dims, ``a`` its leading or trailing ones, see ``_dot``)
    if tuple(cb) != tuple(range(n, n + k)) or tuple(ca) not in (
        tuple(range(k)),
        tuple(range(m, m + k)),
    ):
        return None
    swapped = ((tuple(cb), tuple(ca)), ((), ()))
    cd = ctx.policy.compute_dtype
    return dot_general_rule(eqn, [b, a], cd, out_dtype, backend=ctx.backend, dims=swapped)[0]


#: primitive name -> its rule; names without an entry get the fallbacks of
#: `rule_for` (higher-order, allow or plain bind).
TABLE: dict[str, EqnRule] = {}

#: the key of the generic rule of higher-order primitives (`HigherOrderRule`).
HIGHER_ORDER = "<higher-order>"


def rule_for(eqn: Any, op_class: OpClass | None) -> EqnRule:
    """The rule that binds ``eqn`` (of class ``op_class``): its primitive's entry
    in `TABLE`, else the generic rule of higher-order primitives, the
    default ``allow`` rule, or the plain bind."""
    rule = TABLE.get(eqn.primitive.name)
    if rule is not None:
        return rule
    if compat.has_subjaxprs(eqn):
        return TABLE[HIGHER_ORDER]
    return _ALLOW if op_class is OpClass.ALLOW else _BIND


def register_variant(name: str, variant: Variant, make: Callable[[Any], Rule]) -> None:
    """Gives the allow rule of primitive ``name`` a function for ``variant``
    (internal): ``make(ctx)`` returns it; planning decides which eqns run it."""
    rule = TABLE[name]
    assert isinstance(rule, AllowRule), rule
    rule.variants[variant] = make


def register_eqn_rule(names: str | Iterable[str], rule: EqnRule) -> None:
    """Binds every eqn of primitive(s) ``names`` through ``rule`` (internal)."""
    for name in [names] if isinstance(names, str) else names:
        TABLE[name] = rule


def register_rule(primitive_name: str, rule: Rule) -> None:
    """Registers the rule amp uses for an ``allow`` primitive.

    Args:
      primitive_name: the primitive's name, e.g. ``jax.lax.dot_general_p.name``.
      rule: ``rule(eqn, invals, compute_dtype, out_dtype) -> list`` of
        outputs. ``invals`` are the operands in their current dtypes;
        ``eqn.params`` are the original params; ``out_dtype`` is the dtype
        the policy wants the op to write on this backend
        (`Policy.allow_output_dtype`), e.g. its
        ``preferred_element_type``. It runs for eqns of the primitive that
        the policy puts in the ``allow`` class and amp lowers.
    """
    if not isinstance(primitive_name, str):
        raise TypeError(
            f"primitive_name must be a str such as 'dot_general', got {primitive_name!r}."
        )
    if not callable(rule):
        raise TypeError(
            f"rule must be a function rule(eqn, invals, compute_dtype, out_dtype), got {rule!r}."
        )
    current = TABLE.get(primitive_name)
    if current is not None and not isinstance(current, AllowRule):
        raise ValueError(
            f"amp_jax binds {primitive_name!r} with its own structural rule "
            f"({type(current).__name__}); register_rule is for allow primitives "
            "(matmul-like ops that have a low-precision form)."
        )
    TABLE[primitive_name] = AllowRule(rule)


def _acc_dtype(eqn: Any, out_dtype: Any = HIGH_DTYPE) -> Any:
    """The result dtype: ``out_dtype`` unless the user asked for a non-float
    one (integer dots) or a wider one (float64)."""
    pet = eqn.params.get("preferred_element_type")
    if pet is not None and not is_managed_float(pet):
        return pet
    return out_dtype


def default_allow_rule(
    eqn: Any, invals: Sequence[Any], compute_dtype: np.dtype, out_dtype: np.dtype = HIGH_DTYPE
) -> list[Any]:
    vals = [casting.lower(v, compute_dtype) for v in invals]
    params = dict(eqn.params)
    if "preferred_element_type" in params:
        params["preferred_element_type"] = _acc_dtype(eqn, out_dtype)
    return compat.bind_eqn(eqn, vals, params)


# -- dot_general ---------------------------------------------------------------


def _perm_to(result_dims: list[int]) -> tuple[int, ...]:
    """Permutation taking a result whose axes are ``result_dims`` to sorted order."""
    return tuple(int(i) for i in np.argsort(result_dims))


def _dot_transpose(
    ct: Any,
    other: Any,
    ndim: int,
    contract: Sequence[int],
    batch: Sequence[int],
    other_contract: Sequence[int],
    other_batch: Sequence[int],
    other_ndim: int,
    ct_is_lhs_side: bool,
    precision: Any,
    acc: Any,
    like: Any = None,
    cpu_layouts: bool = False,
) -> Any:
    """Cotangent of one dot_general operand ``a`` given ``other``.

    ``a`` has ``ndim`` dims, contracting dims ``contract`` (paired with
    ``other_contract``) and batch dims ``batch``. ``ct`` has dims
    [batch, lhs kept, rhs kept]; ``ct_is_lhs_side`` says whether ``a`` was the lhs.
    """
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
        return _dot(other, ct, dims2, precision, acc, _explicit_out(like, res2), cpu_layouts)
    out = _dot(ct, other, dims1, precision, acc, _explicit_out(like, res1), cpu_layouts)
    return out if perm1 == ident else lax.transpose(out, perm1)


def _explicit_out(like: Any, order: Sequence[int]) -> Any:
    return None if like is None else compat.explicit_sharding_in_order(like, order)


def _split_factor(n: int) -> int:
    for f in (8, 4, 2, 3, 5, 7):
        if n % f == 0 and n > f:
            return f
    return 0


def materialized_transpose(x: Any, perm: Sequence[int]) -> Any:
    """``lax.transpose(x, perm)`` in a form XLA keeps as a copy.

    XLA folds a plain ``transpose`` that feeds a ``dot`` back into the dot's
    dimension numbers, which on XLA:CPU turns a fast bf16 dot into a slow
    one (see `_dot`). A transpose written as reshape -> transpose ->
    reshape (one dimension split in two) is left alone by the jaxlib 0.10
    simplifier and becomes one copy fusion (measured: benchmarks/RESULTS.md).
    Falls back to a plain transpose when no dimension can be split.
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


def _cpu_fast_layouts(backend: str) -> bool:
    """Whether backward dots get the operand layouts of `_dot` on ``backend``."""
    return backend == "cpu"


def _dot(
    a: Any,
    b: Any,
    dims: Any,
    precision: Any,
    acc: Any,
    out_sharding: Any = None,
    cpu_layouts: bool = False,
) -> Any:
    """A backward-pass dot_general, with operand layouts XLA:CPU runs fast.

    XLA:CPU (jaxlib 0.10) runs a bf16 x bf16 -> f32 dot in its fast kernel only
    when the lhs contracts over its trailing dims and the rhs over its
    leading or trailing dims; otherwise (e.g. the weight gradient ``x.T @ g``,
    which contracts dim 0 of ``x``) it upcasts both operands to f32 and uses
    a slower kernel (benchmarks/RESULTS.md). There, such an operand is
    transposed explicitly with `materialized_transpose` (a memory-bound
    copy of a bf16 array). A dot whose rhs contracts its leading dims comes
    out behind an ``optimization_barrier`` (a transpose of its result must not
    swap its operands, see below).
    Non-bf16 dots are left as they are; batched ones too, but for one case:
    XLA:CPU has no kernel for some batched bf16 x bf16 -> f32 layouts (a rhs
    with several kept dims), and a dot amp lowered can gain batch dims after
    its plan was made (an outer ``vmap`` batching both operands of a linear
    dot: a ``cond`` with a batched predicate broadcasts its weights). Such a
    dot takes its bf16 operands upcast to float32: the same products and
    float32 sums, in the float32 kernel.
    """
    (ca, cb), (ba, bb) = dims
    extra = {} if out_sharding is None else {"out_sharding": out_sharding}
    bf16 = np.dtype(jax.numpy.bfloat16)
    if (ba or bb) and cpu_layouts and np.dtype(a.dtype) == bf16 == np.dtype(b.dtype):
        if acc is None or np.dtype(acc) != bf16:
            a, b = a.astype(HIGH_DTYPE), b.astype(HIGH_DTYPE)
    if (
        ba
        or bb
        or not cpu_layouts
        or np.dtype(a.dtype) != np.dtype(jax.numpy.bfloat16)
        or np.dtype(b.dtype) != np.dtype(jax.numpy.bfloat16)
        or out_sharding is not None
    ):
        return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=acc, **extra)
    ca, cb = tuple(ca), tuple(cb)
    na, nb, k = a.ndim, b.ndim, len(ca)
    if ca != tuple(range(na - k, na)):
        a_kept = [d for d in range(na) if d not in ca]
        a = materialized_transpose(a, (*a_kept, *ca))
        ca = tuple(range(na - k, na))
    elif k:
        # XLA:CPU picks a dot's kernel before its transpose folding runs: a
        # transpose that reaches the lhs afterwards (JAX's own, from a vmap or
        # a transposition of the caller's code) leaves a bf16 x bf16 -> f32 dot
        # that only DotThunk takes, and it has no kernel for it. Each operand
        # behind its own optimization_barrier (no copy; a pair would tie a
        # constant operand to a linear one): no transpose can be folded in.
        # (not under a mesh that partitions the step, as _swapped_dot)
        if not compat.partitioned_by_mesh():
            a, b = lax.optimization_barrier(a), lax.optimization_barrier(b)
    if cb != tuple(range(k)) and cb != tuple(range(nb - k, nb)):
        b_kept = [d for d in range(nb) if d not in cb]
        b = materialized_transpose(b, (*cb, *b_kept))
        cb = tuple(range(k))
    leading = bool(k) and cb == tuple(range(k))
    out_shape = (*a.shape[: na - k], *(b.shape[k:] if leading else b.shape[: nb - k]))
    if k and (k > 1 or nb - k > 1) and not compat.partitioned_by_mesh():
        # XLA canonicalizes a dot with several contracting dims, or a rhs with
        # several kept dims, into one whose rhs has its contraction first: a
        # rhs contracting its trailing dims (the input gradient of an
        # attention projection) is transposed by a copy in every step. Merged
        # by amp, the dims are bitcasts, and a rhs contracting its trailing
        # dim runs in the bf16 kernel as it is.
        a, b, ca, cb = _merged_dims(a, b, k, leading)
    out = lax.dot_general(
        a, b, ((ca, cb), ((), ())), precision=precision, preferred_element_type=acc
    )
    if out.shape != out_shape:
        out = lax.reshape(out, out_shape)
    if leading and out.dtype != a.dtype:
        # XLA's algebraic simplifier rewrites transpose(dot(a, b)) as
        # dot(b, a), after XLA:CPU chose the dot's kernel: with the rhs
        # contracting its leading dims, the swapped lhs would contract them,
        # a dot only DotThunk takes, without a bf16 kernel. The transpose of
        # a caller (``(x @ w).T``) or of JAX's own transpose rule (a backward
        # written with ``jax.vjp`` that amp rewrites: Equinox's checkpointed
        # while loop, diffrax's default adjoint) meets the dot in another
        # jaxpr or as a later eqn. Behind a barrier (kept until after those
        # simplifier passes) the transpose stays a float32 copy. A rhs
        # contracting its trailing dims swaps into a dot that runs: no barrier.
        # A rhs with no kept dims (a matvec) gets one too: batched by a vmap
        # outside amp, it gains kept dims and its result a transpose.
        # Nor for a dot writing bf16 (``allow_outputs="compute"``): XLA:CPU
        # has a kernel for it, and a barrier there would pin the bf16 rounding
        # of the result that XLA otherwise elides with the convert that follows.
        return lax.optimization_barrier(out)
    return out


def _merged_dims(a: Any, b: Any, k: int, leading: bool) -> tuple[Any, Any, Any, Any]:
    """``a`` (contracting its ``k`` trailing dims) and ``b`` (its ``k`` leading
    dims if ``leading``, else its ``k`` trailing ones, in the same order) with
    the contracting dims merged into one and ``b``'s kept dims into one, and the
    new contracting dims: reshapes of contiguous dims (bitcasts), the same
    products summed in the same order."""
    n = int(np.prod(a.shape[a.ndim - k :]))
    m = int(np.prod(b.shape[k:] if leading else b.shape[: b.ndim - k]))
    a = lax.reshape(a, (*a.shape[: a.ndim - k], n))
    if leading:
        return a, lax.reshape(b, (n, m)), (a.ndim - 1,), (0,)
    return a, lax.reshape(b, (m, n)), (a.ndim - 1,), (1,)


def _tangent_sum(out: Any, parts: list[Any]) -> Any:
    """The tangent of a bilinear op: the sum of its products (zeros when no
    operand has a tangent; JAX skips the rule then, this is for safety)."""
    return functools.reduce(lambda a, b: a + b, parts) if parts else jax.numpy.zeros_like(out)


@functools.cache
def _amp_dot(
    dims: Any,
    precision: Any,
    acc: Any,
    out_sharding: Any,
    compute_dtype: np.dtype,
    x_dtype: np.dtype,
    y_dtype: np.dtype,
    cpu_layouts: bool,
) -> Callable:
    (xc, yc), (xb, yb) = dims

    def cast(v: Any) -> Any:
        return casting.lower(v, compute_dtype)

    def primal(x, y):
        return _dot(cast(x), cast(y), dims, precision, acc, out_sharding, cpu_layouts)

    # A custom JVP (not VJP) rule, so forward mode works too: the tangent
    # products are lowdot's linear dots, whose transpose rule writes the
    # cotangent products amp wants (see amp_jax._src.lowdot).
    f = jax.custom_jvp(primal)
    lin = dict(
        dimension_numbers=dims,
        precision=precision,
        acc=acc,
        out_sharding=out_sharding,
        compute_dtype=compute_dtype,
        cpu_layouts=cpu_layouts,
    )

    def jvp(primals, tangents):
        x, y = primals
        tx, ty = tangents
        xl, yl = cast(x), cast(y)
        out = _dot(xl, yl, dims, precision, acc, out_sharding, cpu_layouts)
        # (symbolic zeros: no product for an operand that is not differentiated)
        parts = [
            lowdot.linear_dot(t, o, t_is_lhs=is_lhs, **lin)
            for t, o, is_lhs in ((tx, yl, True), (ty, xl, False))
            if not isinstance(t, SymbolicZero)
        ]
        return out, _tangent_sum(out, parts)

    f.defjvp(jvp, symbolic_zeros=True)
    return f


def _is_dot_rule(fn: Any) -> bool:
    return isinstance(fn, functools.partial) and fn.func is dot_general_rule


def _through_transposes(eqn: Any, env: Any, compute_dtype: Any) -> tuple[list[Any], Any] | None:
    """The operands of dot ``eqn`` with the ``transpose`` eqns that produced
    them undone, and the dimension numbers that contract them the same way;
    None when no operand is such a transpose (or one reorders kept dims, which
    would reorder the result)."""
    (ca, cb), (ba, bb) = eqn.params["dimension_numbers"]
    if eqn.params.get("out_sharding") is not None or compat.partitioned_by_mesh():
        return None
    transposes = getattr(env, "transposes", {})
    out, dims, changed = [], [], False
    for v, c, b in ((eqn.invars[0], ca, ba), (eqn.invars[1], cb, bb)):
        hit = None if isinstance(v, compat.Literal) else transposes.get(v)
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
    if not changed or not all(is_managed_float(v.dtype) for v in out):
        return None
    (nca, nba), (ncb, nbb) = dims
    return out, ((nca, ncb), (nba, nbb))


def _cpu_batched(eqn: Any, backend: str) -> bool:
    """XLA:CPU (jaxlib 0.10) has no kernel for a *batched* bf16 x bf16 -> f32 dot
    (``Unsupported element type for DotThunk``): such dots stay float32 there."""
    (_, _), (xb, _) = eqn.params["dimension_numbers"]
    return bool(xb) and backend == "cpu"


def dot_general_rule(
    eqn: Any,
    invals: Sequence[Any],
    compute_dtype: np.dtype,
    out_dtype: np.dtype = HIGH_DTYPE,
    *,
    backend: str,
    dims: Any = None,
) -> list[Any]:
    """``dims``: dimension numbers that replace ``eqn``'s (for operands read
    through their transposes, `DotRule`)."""
    x, y = invals
    p = eqn.params
    if dims is not None:
        p = {**p, "dimension_numbers": dims}
    if not (is_managed_float(x.dtype) and is_managed_float(y.dtype)):
        return default_allow_rule(eqn, invals, compute_dtype, out_dtype)
    f = _amp_dot(
        p["dimension_numbers"],
        p.get("precision"),
        _acc_dtype(eqn, out_dtype),
        p.get("out_sharding"),
        compute_dtype,
        np.dtype(x.dtype),
        np.dtype(y.dtype),
        _cpu_fast_layouts(backend),
    )
    return [f(x, y)]


# -- conv_general_dilated ------------------------------------------------------


def _freeze(params: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(params.items()))


@functools.cache
def _amp_conv(
    frozen: tuple[tuple[str, Any], ...],
    acc: Any,
    compute_dtype: np.dtype,
) -> Callable:
    params = dict(frozen)
    prim = jax.extend.core.primitives.conv_general_dilated_p

    def conv(x, w, out_dtype):
        return prim.bind(x, w, **{**params, "preferred_element_type": out_dtype})

    def primal(x, w):
        return conv(casting.lower(x, compute_dtype), casting.lower(w, compute_dtype), acc)

    # A custom JVP (so forward mode works): the tangent convolutions take
    # compute-dtype operands and write compute-dtype results, which JAX's conv
    # transpose rules turn into compute-dtype cotangent convolutions (the
    # cotangent rounded to the compute dtype first: the transpose of the cast).
    f = jax.custom_jvp(primal)

    def jvp(primals, tangents):
        x, w = primals
        tx, tw = tangents
        xl, wl = casting.lower(x, compute_dtype), casting.lower(w, compute_dtype)
        out = conv(xl, wl, acc)
        parts = []
        if not isinstance(tx, SymbolicZero):
            parts.append(conv(casting.lower(tx, compute_dtype), wl, None).astype(out.dtype))
        if not isinstance(tw, SymbolicZero):
            parts.append(conv(xl, casting.lower(tw, compute_dtype), None).astype(out.dtype))
        return out, _tangent_sum(out, parts)

    f.defjvp(jvp, symbolic_zeros=True)
    return f


def conv_rule(
    eqn: Any, invals: Sequence[Any], compute_dtype: np.dtype, out_dtype: np.dtype = HIGH_DTYPE
) -> list[Any]:
    x, w = invals
    if not (is_managed_float(x.dtype) and is_managed_float(w.dtype)):
        return default_allow_rule(eqn, invals, compute_dtype, out_dtype)
    params = {k: v for k, v in eqn.params.items() if k != "preferred_element_type"}
    f = _amp_conv(_freeze(params), _acc_dtype(eqn, out_dtype), compute_dtype)
    return [f(x, w)]


#: n-ary elementwise primitives that broadcast size-1 dimensions implicitly.
BROADCASTING = frozenset(
    {
        "add",
        "add_any",
        "sub",
        "mul",
        "div",
        "max",
        "min",
        "atan2",
        "rem",
        "pow",
        "nextafter",
        "select_n",
        "clamp",
        "copysign",
    }
)

register_eqn_rule(BROADCASTING, BroadcastRule())
register_eqn_rule("dot_general", DotRule())
register_eqn_rule("transpose", TransposeRule())
register_eqn_rule("conv_general_dilated", AllowRule(conv_rule))
register_eqn_rule(("broadcast_in_dim", "tile", *ExpandRule.ALWAYS), ExpandRule())
_BIND = EqnRule()
_ALLOW = AllowRule()


# -- the rules of higher-order primitives ----------------------------------------------
#
# Their sub-jaxprs are planned and evaluated by the context (``ctx.plan``,
# ``ctx.rewrite``, ``ctx.evaluate``: ``interpreter.Interpreter``).


class HigherOrderRule(EqnRule):
    """A primitive with sub-jaxprs (``cond``, ``while``, ``remat``, ``pjit``,
    ``custom_vjp_call``, ...): unless the policy keeps it as written (a
    full_precision scope, the float32 policy), its operands keep their dtypes
    and its sub-jaxprs are rewritten with the same policy."""

    def evaluate(self, ctx: Any, eqn: Any, d: Decision, env: Any) -> list[Any]:
        if d.kind is Kind.AS_WRITTEN or d.color is not Color.ORIG:
            return super().evaluate(ctx, eqn, d, env)
        cd = ctx.policy.compute_dtype
        invals = [
            env.read(v, casting.target(casting.dtype_of(v), Color.ORIG, cd)) for v in eqn.invars
        ]
        return self.bind_rewritten(ctx, eqn, invals)

    def bind_rewritten(self, ctx: Any, eqn: Any, invals: list[Any]) -> list[Any]:
        params = ctx.cached(
            "params",
            eqn,
            lambda: compat.map_subjaxprs(
                eqn,
                ctx.rewrite,
                ctx.linear.rewrite,
                functools.partial(_run_bwd, ctx),
            ),
        )
        return compat.bind_eqn(eqn, invals, params)

    def reads_low(self, ctx: Any, eqn: Any, d: Decision, atom: Any) -> bool:
        return False


class ScanRule(HigherOrderRule):
    """``scan``: the casts of scanned-over inputs read only in the compute
    dtype are hoisted out of the loop (`_plan_hoisted_casts`)."""

    def bind_rewritten(self, ctx: Any, eqn: Any, invals: list[Any]) -> list[Any]:
        eqn = ctx.cached("masks", eqn, lambda: _with_constant_masks(eqn, invals))
        hoisted = ctx.cached("hoist", eqn, lambda: _plan_hoisted_casts(ctx, eqn))
        if not hoisted:
            return super().bind_rewritten(ctx, eqn, invals)
        hoist, new_params = hoisted
        cd = ctx.policy.compute_dtype
        invals = [casting.cast(x, cd) if i in hoist else x for i, x in enumerate(invals)]
        return compat.bind_eqn(eqn, invals, new_params)


def _with_constant_masks(eqn: Any, invals: list[Any]) -> Any:
    """``eqn`` (a scan) with its concrete boolean loop constants -- a causal mask
    closed over by the loop body -- made constants of its body, so that the
    body's plan sees their values (a constant causal mask becomes cuDNN's
    ``is_causal``, which skips the masked blocks, instead of a bias it must
    read). The operands stay; the body no longer reads them."""
    n_consts, _ = compat.scan_split(eqn.params)
    known = {
        i: x
        for i, x in enumerate(invals[:n_consts])
        if not isinstance(x, compat.Tracer) and np.dtype(x.dtype) == np.bool_
    }
    if not known:
        return eqn
    body = eqn.params["jaxpr"]
    run = compat.jaxpr_as_fun(body)
    new_body = compat.trace_to_closed_jaxpr(
        lambda *a: run(*[known.get(i, x) for i, x in enumerate(a)]), compat.in_avals(body)
    )
    return eqn.replace(params=compat.scan_params_with_body(eqn, new_body))


class ShardMapRule(HigherOrderRule):
    """``shard_map``: rebuilt as a public ``jax.shard_map`` whose body is
    evaluated under the policy (collectives need the manual-axes context)."""

    def bind_rewritten(self, ctx: Any, eqn: Any, invals: list[Any]) -> list[Any]:
        return ctx.cached("shard_map", eqn, lambda: _shard_map_fn(ctx, eqn))(*invals)


class CustomJvpRule(HigherOrderRule):
    """``custom_jvp_call``: a transparent one (``jax.nn.relu``: only follow
    and clear ops) painted low runs its body in the compute dtype and keeps
    the user's JVP rule (`_custom_jvp_low`)."""

    def evaluate(self, ctx: Any, eqn: Any, d: Decision, env: Any) -> list[Any]:
        if d.color is not Color.LOW:
            return super().evaluate(ctx, eqn, d, env)
        cd = ctx.policy.compute_dtype
        invals = [
            env.read(v, casting.target(casting.dtype_of(v), Color.LOW, cd)) for v in eqn.invars
        ]
        avals = tuple(compat.aval_of(x) for x in invals)
        params = ctx.cached(
            ("custom_jvp_low", avals), eqn, lambda: _custom_jvp_low(ctx, eqn, avals)
        )
        return compat.bind_eqn(eqn, invals, params)

    def reads_low(self, ctx: Any, eqn: Any, d: Decision, atom: Any) -> bool:
        return d.color is Color.LOW


register_eqn_rule(HIGHER_ORDER, HigherOrderRule())
register_eqn_rule("scan", ScanRule())
register_eqn_rule(compat.SHARD_MAP_NAMES, ShardMapRule())
register_eqn_rule(compat.CUSTOM_JVP_NAMES, CustomJvpRule())


def _custom_jvp_low(ctx: Any, eqn: Any, low_avals: Sequence[Any]) -> dict[str, Any]:
    """Params to bind a transparent ``custom_jvp_call`` on compute-dtype operands.

    The body is evaluated with every op low. The JVP rule is the user's,
    evaluated in the original dtypes: primals and tangents are cast up, the
    output tangents cast back down to the dtypes of the low primal outputs.
    The primal outputs of the rule are the low body's, so the forward values
    are the same with and without differentiation.
    """
    call_jaxpr, rule_fun, _ = compat.custom_jvp_parts(eqn)
    low = ctx.all_low(ctx.prepare(call_jaxpr))
    orig_avals = [v.aval for v in eqn.invars]

    def primal(*xs):
        return ctx.evaluate(low, xs, cast_outputs=False)

    new_call = compat.trace_to_closed_jaxpr(primal, low_avals)

    def jvp_jaxpr(*zeros):
        jaxpr, consts, out_zeros = compat.call_thunk(rule_fun, *zeros)
        rule = compat.close(jaxpr, consts)
        tan_in = [
            (lo.to_tangent_aval(), hi.to_tangent_aval())
            for lo, hi, z in zip(low_avals, orig_avals, zeros)
            if not z
        ]

        def jvp(*xs):
            prims, tans = xs[: len(low_avals)], xs[len(low_avals) :]
            p_out = primal(*prims)
            up = [casting.cast(x, hi.dtype) for x, hi in zip(prims, orig_avals)]
            up += [casting.cast(t, hi.dtype) for t, (_, hi) in zip(tans, tan_in)]
            t_out = ctx.linear.evaluate(ctx.linear.plan(rule), up)[len(out_zeros) :]
            nz = [p for p, z in zip(p_out, out_zeros) if not z]
            return [
                *p_out,
                *(
                    casting.cast(t, compat.aval_of(p).to_tangent_aval().dtype)
                    for t, p in zip(t_out, nz)
                ),
            ]

        new = compat.trace_to_closed_jaxpr(jvp, [*low_avals, *(lo for lo, _ in tan_in)])
        return compat.jaxpr_of(new), compat.consts_of(new), out_zeros

    return compat.custom_jvp_params(eqn, new_call, compat.memoized_fun(jvp_jaxpr, rule_fun))


def _run_bwd(ctx: Any, key: Any, bwd: Any, args: Sequence[Any]) -> Any:
    """A ``custom_vjp`` backward rule ``bwd(*args)`` run under ``ctx``'s policy.

    A rule that recomputes primal values (diffrax's checkpointed adjoint
    re-runs the solver's steps) must see the policy its forward ran under,
    or it recomputes other values -- an adaptive solver accepts other steps
    -- than the forward did (PyTorch's ``custom_bwd`` does the same for
    autocast). Symbolic zeros (in and out) pass through as they are.
    """
    is_val = [isinstance(a, (jax.Array, compat.Tracer)) for a in args]
    vals = [a for a, v in zip(args, is_val) if v]
    others = tuple((i, a) for i, (a, v) in enumerate(zip(args, is_val)) if not v)
    avals = tuple(compat.aval_of(a) for a in vals)

    def make() -> tuple[Any, dict[int, Any], Any]:
        # The rule's output is a pytree (the cotangents; from JAX 0.11 the
        # pair (cotangents, logs)) whose non-array leaves are symbolic zeros.
        zeros: dict[int, Any] = {}
        tree: list[Any] = []

        def traced(*xs):
            it = iter(xs)
            full = [a if not v else next(it) for a, v in zip(args, is_val)]
            leaves, treedef = jax.tree_util.tree_flatten(bwd(*full))
            tree.append(treedef)
            arrays = []
            for i, o in enumerate(leaves):
                if isinstance(o, (jax.Array, compat.Tracer)):
                    arrays.append(o)
                else:
                    zeros[i] = o  # a symbolic zero: no value to compute
            return arrays

        closed = compat.trace_to_closed_jaxpr(traced, avals)
        return ctx.plan(closed), zeros, tree[0]

    zkey = tuple((i, type(a).__name__, str(getattr(a, "aval", ""))) for i, a in others)
    plan_, zeros, treedef = ctx.cached(("bwd", avals, zkey), key, make)
    outs = iter(ctx.evaluate(plan_, vals))
    leaves = [zeros[i] if i in zeros else next(outs) for i in range(treedef.num_leaves)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _shard_map_fn(ctx: Any, eqn: Any) -> Any:
    """The public ``jax.shard_map`` of ``eqn``'s body, evaluated under the policy."""
    plan_ = ctx.plan(compat.shard_map_body(eqn))
    return compat.shard_map_of(eqn, lambda *a: ctx.evaluate(plan_, a))


def _plan_hoisted_casts(ctx: Any, eqn: Any) -> tuple[list[int], dict[str, Any]] | None:
    """For a ``scan`` whose scanned-over inputs are read only in the compute
    dtype (stacked per-layer weights): the indices of those inputs, to be cast
    once outside the loop, and the scan's params with the body retyped.

    Cast inside the body, each layer's low copy of its weights would be a
    new value that the backward pass saves: a stacked copy of all weights.
    Cast outside, the residual is the (already low) input slice. As with
    hand-cast bf16 models and ``torch.autocast``, each layer's weight
    gradient then leaves its matmul rounded to the compute dtype before it is
    cast back to the parameter's dtype. None when nothing can be hoisted
    (the caller then rewrites the body as for any higher-order primitive).
    """
    found = compat.scan_xs(eqn)
    if found is None or ctx.identity:
        return None
    body, xs = found
    body_plan = ctx.plan(body)
    bj = body_plan.jaxpr
    cd = ctx.policy.compute_dtype
    hoist = []
    for i in xs:
        v = bj.invars[i]
        if (
            casting.target(casting.dtype_of(v), Color.LOW, cd)
            in (None, np.dtype(casting.dtype_of(v)))
            or v in bj.outvars
        ):
            continue
        uses = [
            (e, d) for e, d in zip(bj.eqns, body_plan.decisions) if any(v is a for a in e.invars)
        ]
        if uses and all(rule_for(e, d.op_class).reads_low(ctx, e, d, v) for e, d in uses):
            hoist.append(i)
    if not hoist:
        return None
    avals = compat.in_avals(body)
    avals = [a.update(dtype=cd) if i in hoist else a for i, a in enumerate(avals)]
    return hoist, compat.scan_params_with_body(eqn, ctx.rewrite(body, avals))
