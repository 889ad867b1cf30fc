"""``explain``: what amp did to every op of a program, and why.

Two views of one call are joined:

* the *decisions*: the `Plan` that [`amp`][amp_jax.amp]
  evaluates, one typed `Decision` per op with
  the reason recorded where it was made (sub-jaxprs' plans included), gives
  each op's reason: explain shows it and decides nothing itself;
* the *result*: the jaxpr of the rewritten program (``jax.make_jaxpr`` of the
  amp function, or of its gradient), walked with `iter_eqns` like
  [`dtype_report`][amp_jax.dtype_report], gives the dtype every op ran in, its FLOPs and the
  bytes it moved; the same walk of the original program gives the casts amp
  inserted and the bytes it saved.

Ops are matched between the two by their user source line and primitive
(reasons.py: the rewritten program keeps the source info of the op it
replaces; the backward ops of ``jax.grad`` carry the line of their forward op).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from jax.typing import DTypeLike

from amp_jax._src import compat
from amp_jax._src.diagnostics.explanation import ExplainRow, ExplainSummary, Explanation
from amp_jax._src.diagnostics.measure import MATMULS, eqn_bytes, eqn_flops, unused_eqns
from amp_jax._src.diagnostics.reasons import (
    Decisions,
    SourceLines,
    decisions_of,
    float_dtypes,
    full_stack,
    is_backward,
    is_float_cast,
    line_in_scope,
    ran_in,
    row_reason,
    scope_of,
)
from amp_jax._src.diagnostics.tracing import (
    check_grad,
    loss_of,
    model_as_argument,
    program,
    split_fn,
)
from amp_jax._src.jaxprs import iter_eqns
from amp_jax._src.policy import Policy
from amp_jax._src.transform import AmpFunction


def _touches_float(eqn: compat.Eqn) -> bool:
    return bool(float_dtypes(eqn.invars) or float_dtypes(eqn.outvars))


class _Measured(NamedTuple):
    """The floating ops of one program and what they moved."""

    eqns: list[tuple[Any, int, str, Any, int]]  # (eqn, times, name stack, site, bytes once)
    nbytes: int  # bytes read and written, all runs together
    casts: int  # floating casts in the code
    casts_run: int  # floating casts executed
    unused: frozenset[int] = frozenset()  # ids of the eqns nothing reads (`unused_eqns`)


def _measure(jaxpr: compat.ClosedJaxpr) -> _Measured:
    """The floating eqns of ``jaxpr`` with their run counts, bytes moved and casts."""
    eqns, nbytes, casts, casts_run = [], 0, 0, 0
    memo: dict[Any, int] = {}
    unused = unused_eqns(jaxpr)
    for eqn, _, times, outer, site in iter_eqns(jaxpr):
        if not _touches_float(eqn):
            continue
        dead = id(eqn) in unused  # (XLA removes it: it moves nothing, never runs)
        once = 0 if dead else eqn_bytes(eqn, memo)
        eqns.append((eqn, times, full_stack(eqn, outer), site, once))
        nbytes += times * once
        if is_float_cast(eqn):
            casts += 1
            casts_run += 0 if dead else times
    return _Measured(eqns, nbytes, casts, casts_run, unused)


#: ops amp adds around the op they serve (a dot's operand barriers, its backward's
#: layout copies): beyond the original program's count at a line, folded into that op's row
_SERVING = frozenset(
    {"optimization_barrier", "reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims"}
)


def _cast_keys(m: _Measured) -> collections.Counter[tuple[Any, ...]]:
    """The floating casts of a measured program, and its ops of the kinds amp
    adds around an op (`_SERVING`), by (source line, primitive, backward) for those."""
    lines = SourceLines()
    out: collections.Counter[tuple[Any, ...]] = collections.Counter(
        (lines(site), e.primitive.name) for e, _, _, site, _ in m.eqns if is_float_cast(e)
    )
    out.update(
        (lines(site), e.primitive.name, is_backward(stack))
        for e, _, stack, site, _ in m.eqns
        if e.primitive.name in _SERVING
    )
    return out


#: what an `ExplainRow` groups by: where, scope, backward, primitive, dtype, reason
_RowKey = tuple[str, str, bool, str, str, str]


class _Grouped(NamedTuple):
    rows: list[ExplainRow]  # amp's own ops folded into the row of the op they serve
    all_rows: list[ExplainRow]  # amp's own ops in rows of their own
    flops_by: collections.Counter
    mm_by: collections.Counter
    cast_bytes: int  # bytes of the casts amp inserted
    own_bytes: int  # bytes of the other ops amp added


def _group(
    new: _Measured, orig_keys: collections.Counter, decisions: Decisions, compute_dtype: str
) -> _Grouped:
    """The rows of the rewritten program ``new``: its ops grouped by source
    line, scope, pass, primitive, dtype and reason, most FLOPs first
    (``orig_keys``: the original program's casts and data movement, by
    `_cast_keys`, tell amp's apart)."""
    lines = SourceLines()
    every: dict[_RowKey, list[int]] = {}  # each op in its own group
    shown: dict[_RowKey, list[int]] = {}  # amp's own ops in the group of the op they serve
    flops_by: collections.Counter = collections.Counter()
    mm_by: collections.Counter = collections.Counter()
    seen: collections.Counter = collections.Counter()
    own_seen: collections.Counter = collections.Counter()
    derived: dict[str, str] = {}
    pending: list[tuple[_RowKey, int, int, int]] = []  # amp's own ops before the op they serve
    last: _RowKey | None = None  # the group of the last op they could serve
    cast_bytes = own_bytes = 0

    def add(
        groups: dict[_RowKey, list[int]], key: _RowKey, count: int, flops: int, nbytes: int
    ) -> None:
        acc = groups.setdefault(key, [0, 0, 0])
        acc[0] += count
        acc[1] += flops
        acc[2] += nbytes

    for eqn, times, stack, site, once in new.eqns:
        dtype = ran_in(eqn)
        flops = 0 if id(eqn) in new.unused else times * eqn_flops(eqn)  # (XLA removes it)
        nbytes = times * once
        line = lines(site)
        backward = is_backward(stack)
        name = eqn.primitive.name
        if line == "-":  # amp's own evaluation (a custom_jvp run low): its scope's line
            line = line_in_scope(decisions, name, scope_of(stack)) or line
        reason = row_reason(
            decisions,
            eqn,
            stack,
            orig_keys,
            seen,
            line,
            derived,
            compute_dtype=compute_dtype,
            dead=id(eqn) in new.unused,
        )
        key: _RowKey = (line, scope_of(stack), backward, name, dtype, reason)
        add(every, key, times, flops, nbytes)
        if reason == "cast inserted by amp":
            cast_bytes += nbytes
        own = False
        if name in _SERVING:
            own_seen[line, name, backward] += 1
            own = own_seen[line, name, backward] > orig_keys.get((line, name, backward), 0)
        if own:
            own_bytes += nbytes
            pending.append((key, times, flops, nbytes))
            continue
        add(shown, key, times, flops, nbytes)
        if not is_float_cast(eqn):  # (a cast amp makes for the op is a row of its own)
            for k, c, f, b in pending:  # amp's own ops before it, same line and pass
                _fold(shown, k, c, f, b, key if k[0] == line and k[2] == backward else last)
            pending, last = [], key
        if flops:
            flops_by[dtype] += flops
            if name in MATMULS:
                mm_by[dtype] += flops
    for k, c, f, b in pending:  # served by no op after them
        _fold(shown, k, c, f, b, last)
    return _Grouped(_rows(shown), _rows(every), flops_by, mm_by, cast_bytes, own_bytes)


def _fold(
    shown: dict[_RowKey, list[int]],
    own: _RowKey,
    count: int,
    flops: int,
    nbytes: int,
    into: _RowKey | None,
) -> None:
    """Adds one of amp's own ops to the group ``into`` (an op of its source line and
    pass), else to a group of its own."""
    if into is not None and (into[0], into[2]) == (own[0], own[2]):
        acc = shown.setdefault(into, [0, 0, 0])
    else:
        acc = shown.setdefault(own, [0, 0, 0])
        acc[0] += count
    acc[1] += flops
    acc[2] += nbytes


def _rows(groups: dict[_RowKey, list[int]]) -> list[ExplainRow]:
    rows = [ExplainRow(*k, count=c, flops=f, bytes=b) for k, (c, f, b) in groups.items()]
    rows.sort(key=lambda r: (-r.flops, -r.bytes, r.where, r.primitive))
    return rows


def _low_share(by: collections.Counter) -> float:
    """The share of ``by``'s FLOPs that ran in a dtype narrower than float32."""
    total = sum(by.values())
    low = sum(v for k, v in by.items() if np.dtype(k.split(",")[0]).itemsize < 4)
    return low / total if total else 0.0


def _summary(
    policy: Policy,
    grouped: _Grouped,
    new: _Measured,
    old: _Measured,
) -> ExplainSummary:
    flops_by, mm_by = grouped.flops_by, grouped.mm_by
    return ExplainSummary(
        compute_dtype=policy.compute_dtype.name,
        flops_by_dtype=dict(flops_by.most_common()),
        matmul_flops_by_dtype=dict(mm_by.most_common()),
        low_flop_share=_low_share(flops_by),
        low_matmul_flop_share=_low_share(mm_by),
        bytes_moved=new.nbytes,
        bytes_moved_original=old.nbytes,
        casts_inserted=new.casts - old.casts,
        casts_run=new.casts_run - old.casts_run,
        cast_bytes=grouped.cast_bytes,
        own_bytes=grouped.own_bytes,
    )


def explain(
    fn: Callable[..., Any],
    *args: Any,
    policy: Policy | str | DTypeLike | None = None,
    grad: bool | int | tuple[int, ...] = False,
    has_aux: bool = False,
    **kwargs: Any,
) -> Explanation:
    """What low precision did to every op of ``fn(*args, **kwargs)``, and why.

    Traces the program [`amp`][amp_jax.amp] runs (the forward pass, or with ``grad``
    also the backward pass of ``jax.grad``), and reports one row per group of
    ops -- same source line, ``named_scope``, pass, primitive, dtype and
    reason -- with the dtype the ops ran in, the reason amp chose it (op
    class, painting, a ``full_precision`` scope, a policy override, the
    backend-aware choice, a cast amp inserted), their FLOPs and the bytes they
    moved; and a summary: the share of FLOPs in low precision, the bytes
    saved against the original program, the casts inserted. Control flow is
    walked into (``scan``, ``while``, ``cond``, ``checkpoint``,
    ``custom_jvp``/``custom_vjp``); the ops of a ``scan`` body count
    ``length`` times, those of a ``while`` body once, every ``cond`` branch
    once.

    Args:
      fn: the float32 function, or an [`amp`][amp_jax.amp]-wrapped one (whose policy is
        used unless ``policy`` is given). Flax ``apply`` functions and
        Equinox modules (non-array leaves are static) work as arguments; a
        module as ``fn`` is traced as ``amp(model)`` traces it.
      *args: its positional arguments (arrays or ``jax.ShapeDtypeStruct``).
      policy: the policy to explain (default: ``fn``'s if it is an amp
        function, else ``"bfloat16"``).
      grad: ``True`` (or the argnums, an int or a tuple of ints) to explain
        ``jax.value_and_grad`` of ``fn`` w.r.t. those arguments (a non-scalar
        output is summed); the training step's backward pass then shows too.
      has_aux: as in ``jax.value_and_grad``: ``fn`` returns ``(loss, aux)``;
        the loss is explained, ``aux`` (new batch statistics, metrics, strings)
        is not.
      **kwargs: keyword arguments of ``fn``.

    Returns:
      An [`Explanation`][amp_jax.Explanation]: ``print`` it in a terminal, show it in a
      notebook; ``.rows`` and ``.summary`` hold the data.

    Raises:
      TypeError: ``fn`` is not callable or ``grad`` is not a bool/int/tuple.

    Examples:
      >>> import jax.numpy as jnp
      >>> import amp_jax
      >>> def f(w, x):
      ...     return jnp.sum(jnp.exp(x @ w))
      >>> policy = amp_jax.Policy(allow_outputs="float32")  # (GPUs write bf16 by default)
      >>> ex = amp_jax.explain(f, jnp.ones((8, 8)), jnp.ones((4, 8)), policy=policy)
      >>> [(r.primitive, r.dtype) for r in ex.rows if r.primitive in ("dot_general", "exp")]
      [('dot_general', 'bfloat16'), ('exp', 'float32')]
      >>> ex.summary.low_matmul_flop_share
      1.0
      >>> ex.summary.casts_inserted
      2
    """
    base, pol = split_fn(fn, policy)
    base, args, g = model_as_argument(base, args, check_grad(grad))
    base = loss_of(base, has_aux, "explain", g is not None)
    # the original program first, kept only as its totals and casts: its eqns
    # are not alive while amp's program is traced (fewer objects to collect)
    old = _measure(compat.jaxpr_of(program(base, args, kwargs, g)[0]))
    orig_casts = _cast_keys(old)
    old = old._replace(eqns=[])
    run = AmpFunction(base, pol)
    new = _measure(compat.jaxpr_of(program(run, args, kwargs, g)[0]))
    # (the plan amp made while tracing the program, when it kept it: not traced twice)
    traces = run.traces()
    decisions = decisions_of(base, pol, args, kwargs, traces[-1] if len(traces) == 1 else None)
    grouped = _group(new, orig_casts, decisions, pol.compute_dtype.name)
    summary = _summary(pol, grouped, new, old)
    return Explanation(grouped.rows, summary, pol, grouped.all_rows)
