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

Ops are matched between the two by their user source line and primitive (the
rewritten program keeps the source info of the op it replaces; the backward
ops of ``jax.grad`` carry the line of their forward op).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import html
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from amp_jax._src import compat, jaxprs
from amp_jax._src.calling import is_dynamic
from amp_jax._src.decision import Color, Decision, Kind, attention_from_stack
from amp_jax._src.jaxprs import iter_eqns
from amp_jax._src.planning import Context, plan
from amp_jax._src.policy import Policy, get_policy, is_managed_float
from amp_jax._src.transform import AmpFunction

#: primitives that move data without arithmetic (0 FLOPs).
_NO_FLOPS = frozenset(
    {
        "reshape",
        "broadcast_in_dim",
        "transpose",
        "convert_element_type",
        "squeeze",
        "expand_dims",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "concatenate",
        "gather",
        "scatter",
        "pad",
        "rev",
        "copy",
        "copy_p",
        "iota",
        "select_n",
        "reduce_precision",
        "stop_gradient",
        "device_put",
        "bitcast_convert_type",
        "sharding_constraint",
        "split",
        "optimization_barrier",
    }
)
#: primitives whose FLOPs are one per *input* element.
_REDUCTIONS = frozenset(
    {
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "argmax",
        "argmin",
        "cumsum",
        "cumprod",
        "cummax",
        "cummin",
        "cumlogsumexp",
        "reduce_and",
        "reduce_or",
    }
)
MATMULS = frozenset({"dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"})


# -- per-eqn measures -----------------------------------------------------------------


def _size(aval: Any) -> int:
    return int(math.prod(getattr(aval, "shape", ())))


def _nbytes(aval: Any) -> int:
    dtype = getattr(aval, "dtype", None)
    try:
        return _size(aval) * np.dtype(dtype).itemsize
    except TypeError:  # key types, tokens
        return 0


def eqn_flops(eqn: Any) -> int:
    """Floating-point operations of one first-order eqn (a multiply-add is 2)."""
    name = eqn.primitive.name
    out = eqn.outvars[0].aval if eqn.outvars else None
    sizes = jaxprs.contraction_and_flops(eqn)
    if sizes is not None:
        return sizes[1]
    if name in _NO_FLOPS or out is None or not is_managed_float(getattr(out, "dtype", None)):
        if name not in _REDUCTIONS:
            return 0
    if name in _REDUCTIONS:
        return _size(eqn.invars[0].aval)
    return _size(out)


def _float_dtypes(atoms: Sequence[Any]) -> list[str]:
    seen: list[str] = []
    for a in atoms:
        d = getattr(a.aval, "dtype", None)
        if is_managed_float(d) and str(np.dtype(d)) not in seen:
            seen.append(str(np.dtype(d)))
    return seen


def ran_in(eqn: Any) -> str:
    """The dtype an eqn computed in: its floating operands' (``a->b`` for a cast)."""
    ins, outs = _float_dtypes(eqn.invars), _float_dtypes(eqn.outvars)
    if eqn.primitive.name == "convert_element_type" and ins and outs and ins != outs:
        return f"{ins[0]}->{outs[0]}"
    return ",".join(ins or outs) or "-"


def _is_float_cast(eqn: Any) -> bool:
    return (
        eqn.primitive.name == "convert_element_type"
        and bool(_float_dtypes(eqn.invars))
        and bool(_float_dtypes(eqn.outvars))
        and _float_dtypes(eqn.invars) != _float_dtypes(eqn.outvars)
    )


def _touches_float(eqn: Any) -> bool:
    return bool(_float_dtypes(eqn.invars) or _float_dtypes(eqn.outvars))


def _full_stack(eqn: Any, outer: tuple[str, ...]) -> str:
    return "/".join(s for s in (*outer, str(eqn.source_info.name_stack)) if s)


def _scope(stack: str) -> str:
    """The user's ``named_scope`` path of a name stack, without JAX's transform names."""
    parts = []
    for part in stack.split("/"):
        # transform names wrap scopes: "transpose(jvp(attn))" -> "attn"
        while "(" in part and part.endswith(")"):
            part = part[part.index("(") + 1 : -1]
        if part:
            parts.append(part)
    return "/".join(parts) or "-"


def _is_backward(stack: str) -> bool:
    return "transpose(" in stack


# -- decisions --------------------------------------------------------------------------


def _decide(
    ctx: Context,
    jaxpr: Any,
    decisions: Sequence[Decision],
    out: dict,
    inherited: str | None,
    outer: tuple[str, ...] = (),
) -> None:
    """Fills ``out[(source line, primitive)][named_scope path]`` with a Counter
    of the reasons of the plan's decisions (the sub-jaxprs' plans included).

    The scope tells apart the ops of one source line called under different
    ``named_scope`` s (a library layer used twice: one Dense in a
    ``full_precision_scopes`` head, one outside). ``outer`` is the enclosing
    eqns' name stacks, as `jaxprs.iter_eqns` gives them for the rows.
    An eqn bound as written, or a function painted low, gives its own reason
    to everything it holds (``inherited``).
    """
    for eqn, d in zip(jaxpr.eqns, decisions):
        reason = inherited or d.reason.text
        where = (compat.source_line(eqn), eqn.primitive.name)
        out[where][_scope(_full_stack(eqn, outer))][reason] += 1
        if not compat.has_subjaxprs(eqn):
            continue
        inner = (*outer, str(eqn.source_info.name_stack))
        for sub in jaxprs.closed_subjaxprs(eqn):
            if d.kind is Kind.AS_WRITTEN or inherited is not None:
                body = compat.jaxpr_of(sub)
                _decide(ctx, body, [d] * len(body.eqns), out, reason, inner)
            elif d.color is Color.LOW:  # a transparent custom_jvp function: all of it low
                body = compat.jaxpr_of(ctx.prepare(sub))
                _decide(ctx, body, [d] * len(body.eqns), out, reason, inner)
            else:
                sub_plan = plan(ctx, sub)
                _decide(ctx, sub_plan.jaxpr, sub_plan.decisions, out, None, inner)


def _decision_at(by_scope: dict[str, collections.Counter], scope: str) -> collections.Counter:
    """The reasons decided for the ops of one source line at ``scope``: those of
    the innermost decided scope that encloses ``scope`` (amp's own scopes, such
    as ``amp_float8.tensorwise``, nest inside the user's), else all of them."""
    parts = [] if scope == "-" else scope.split("/")

    def encloses(s: str) -> bool:
        d = [] if s == "-" else s.split("/")
        return parts[: len(d)] == d

    inside = [s for s in by_scope if encloses(s)]
    if inside:
        return by_scope[max(inside, key=lambda s: 0 if s == "-" else s.count("/") + 1)]
    return sum(by_scope.values(), collections.Counter())


# -- tracing ---------------------------------------------------------------------------------


def _flat_call(fn: Callable[..., Any], args: tuple, kwargs: dict, grad: Any):
    """``(flat function of the dynamic leaves, those leaves)``; with ``grad``, the
    function returns the gradient w.r.t. the floating leaves of ``args[grad...]``."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dyn_mask = [is_dynamic(x) for x in leaves]
    static = [x for x, d in zip(leaves, dyn_mask) if not d]
    dyn = [x for x, d in zip(leaves, dyn_mask) if d]

    def rebuild(dyn_vals):
        it_dyn, it_static = iter(dyn_vals), iter(static)
        full = [next(it_dyn) if d else next(it_static) for d in dyn_mask]
        return jax.tree.unflatten(treedef, full)

    def call(*dyn_vals):
        a, k = rebuild(dyn_vals)
        return fn(*a, **k)

    if grad is None:
        return call, dyn
    argnums = (grad,) if isinstance(grad, int) else tuple(grad)
    # which dynamic leaves belong to the differentiated positional arguments
    owner = []
    for i, a in enumerate(args):
        owner += [i] * len(jax.tree.leaves(a))
    owner += [-1] * (len(leaves) - len(owner))
    dyn_owner = [o for o, d in zip(owner, dyn_mask) if d]
    wrt = [
        j
        for j, (o, x) in enumerate(zip(dyn_owner, dyn))
        if o in argnums and jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
    ]
    if not wrt:
        raise ValueError(
            f"grad={grad!r}: positional argument(s) {argnums} hold no floating "
            "array to differentiate; pass grad=None or the index of the parameters."
        )

    def grad_call(*dyn_vals):
        def of(diff):
            vals = list(dyn_vals)
            for j, v in zip(wrt, diff):
                vals[j] = v
            out = jax.numpy.asarray(call(*vals))
            return out.astype(jax.numpy.float32) if out.ndim == 0 else jax.numpy.sum(out)

        return jax.value_and_grad(of)([dyn_vals[j] for j in wrt])

    return grad_call, dyn


def _check_grad(grad: Any) -> Any:
    if grad is False or grad is None:
        return None
    if grad is True:
        return 0
    if isinstance(grad, int) or (isinstance(grad, tuple) and all(isinstance(g, int) for g in grad)):
        return grad
    raise TypeError(
        f"grad must be a bool, an int or a tuple of ints (argnums), got {grad!r}; "
        "e.g. grad=True differentiates the first argument."
    )


def _split_fn(fn: Callable[..., Any], policy: Any) -> tuple[Callable[..., Any], Policy]:
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}: {fn!r}.")
    if isinstance(fn, AmpFunction):
        return fn.fn, (fn.policy if policy is None else get_policy(policy))
    return fn, get_policy("bfloat16" if policy is None else policy)


def _loss_of(fn: Callable[..., Any], has_aux: Any, caller: str, grad: bool) -> Callable[..., Any]:
    """``fn`` itself, or with ``has_aux=True`` the function returning only the
    first element of ``fn``'s ``(loss, aux)`` output (aux is not analysed);
    differentiating a pair without ``has_aux`` raises an error naming it."""
    if not isinstance(has_aux, bool):
        raise TypeError(f"{caller}: `has_aux` must be a bool, got {has_aux!r}.")
    if not has_aux and not grad:
        return fn

    @functools.wraps(fn)
    def loss_only(*args, **kwargs):
        out = fn(*args, **kwargs)
        pair = isinstance(out, (tuple, list))
        if has_aux and not (pair and len(out) == 2):
            raise TypeError(
                f"{caller}(has_aux=True): the function must return a pair (loss, aux), "
                f"got {type(out).__name__}; pass has_aux=False for a function that "
                "returns the loss alone."
            )
        if not has_aux and pair:
            raise TypeError(
                f"{caller}(grad=...): the function returned a {type(out).__name__} of "
                f"{len(out)}, not a loss; if it returns (loss, aux) as for "
                f"jax.value_and_grad(..., has_aux=True), pass has_aux=True to {caller}."
            )
        return out[0] if has_aux else out

    return loss_only


def _trace_decisions(base: Callable[..., Any], pol: Policy, args: tuple, kwargs: dict) -> dict:
    traced = AmpFunction(base, pol).trace_for_inspection(*args, **kwargs)
    out: dict = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    _decide(traced.ctx, traced.plan.jaxpr, traced.plan.decisions, out, None)
    return out


# -- results -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExplainRow:
    """One group of ops: same source line, scope, pass, primitive, dtype and reason.

    Attributes:
      where: the user's source line, ``file:line:col (function)``.
      scope: the ``jax.named_scope`` path (``-`` when none).
      backward: whether the ops belong to the backward pass of ``jax.grad``.
      primitive: the JAX primitive.
      dtype: the dtype the ops computed in (``a->b`` for a cast).
      reason: why amp chose that dtype.
      count: how many times the ops run (a ``scan`` body counts ``length`` times).
      flops: floating-point operations, all runs together.
      bytes: bytes read and written, all runs together.
    """

    where: str
    scope: str
    backward: bool
    primitive: str
    dtype: str
    reason: str
    count: int
    flops: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class ExplainSummary:
    """Totals of an [`explain`][amp_jax.explain] report.

    Attributes:
      compute_dtype: the policy's low-precision dtype.
      flops_by_dtype: FLOPs of the rewritten program per dtype they ran in.
      matmul_flops_by_dtype: the same for matmuls and convolutions only.
      low_flop_share: share of all floating FLOPs that ran in a dtype narrower
        than float32.
      low_matmul_flop_share: the same share for matmul/convolution FLOPs.
      bytes_moved: bytes read and written by the rewritten program's ops.
      bytes_moved_original: the same for the original program.
      casts_inserted: floating casts in the rewritten program's code minus
        those in the original (each counted once, however often it runs).
      casts_run: floating casts executed, minus the original's (scan bodies
        count ``length`` times).
    """

    compute_dtype: str
    flops_by_dtype: dict[str, int]
    matmul_flops_by_dtype: dict[str, int]
    low_flop_share: float
    low_matmul_flop_share: float
    bytes_moved: int
    bytes_moved_original: int
    casts_inserted: int
    casts_run: int

    @property
    def bytes_saved(self) -> int:
        """``bytes_moved_original - bytes_moved`` (negative when casts cost more)."""
        return self.bytes_moved_original - self.bytes_moved


def _fmt_num(n: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.3g}" if isinstance(n, float) else str(n)


def _saved_or_more(saved: int) -> str:
    if saved < 0:
        return f"moved {_fmt_num(-saved)}B more"
    return f"saved {_fmt_num(saved)}B"


def _short_where(where: str) -> str:
    """``file:line (function)``: a package's path from the package on, no column,
    the function's own name (``loss.<locals>.f`` -> ``f``)."""
    m = re.fullmatch(r"(.*?):(\d+)(?::\d+)?(?: \((.*)\))?", where)
    if m is None:
        return where
    path, line, fn = m.groups()
    if "site-packages/" in path:
        path = path.rsplit("site-packages/", 1)[1]
    elif path.startswith("/") and path.count("/") > 2:
        path = ".../" + "/".join(path.rsplit("/", 2)[-2:])
    return f"{path}:{line}" + (f" ({fn.rsplit('.', 1)[-1]})" if fn else "")


def _user_scope(scope: str) -> str:
    """The user's own named scopes: amp's (``amp_...``) carry the reason, shown apart."""
    parts = [p for p in scope.split("/") if not p.startswith("amp_")]
    return "/".join(parts) or "-"


_SHORT_OPS = {"convert_element_type": "convert", "optimization_barrier": "barrier"}
_SHORT_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}


def _compact(row: tuple[str, ...]) -> tuple[str, ...]:
    """A row for the default view: short path and names, amp's scopes and bytes left out."""
    where, scope, pas, op, dtype, runs, flops, _bytes, reason = row
    if where == "source line":  # the header
        return (where, scope, pas, op, dtype, runs, flops, reason)
    dtype = "->".join(_SHORT_DTYPES.get(d, d) for d in dtype.split("->"))
    op = _SHORT_OPS.get(op, op)
    reason = reason.replace(" class: ", ": ")
    return (_short_where(where), _user_scope(scope), pas, op, dtype, runs, flops, reason)


def _cut_where(where: str, n: int) -> str:
    """The source line within ``n`` characters: the function name goes first."""
    if len(where) > n and " (" in where:
        where = where.split(" (", 1)[0]
    return _cut(where, n, tail=True)


def _cut(text: str, n: int, tail: bool = False) -> str:
    if len(text) <= n:
        return text
    return "..." + text[-(n - 3) :] if tail else text[: n - 3] + "..."


def _fit(table: list[tuple[str, ...]], width: int) -> list[tuple[str, ...]]:
    """Cuts the source line, the scope (if shown) and the reason until a row fits ``width``."""
    has_scope = table[0][1] == "scope"
    table = [(_cut_where(r[0], 30), *r[1:]) for r in table]
    if has_scope:
        table = [(r[0], _cut(r[1], 16, tail=True), *r[2:]) for r in table]
    fixed = sum(max(len(r[i]) for r in table) + 2 for i in range(len(table[0]) - 1))
    cap = max(16, width - fixed)
    return [(*r[:-1], _cut(r[-1], cap)) for r in table]


class Explanation:
    """What [`explain`][amp_jax.explain] returns: rows, a summary, text and HTML views.

    ``str(explanation)`` is an aligned text table (``format`` takes options);
    in a notebook the object renders as an HTML table.

    Attributes:
      rows: the [`ExplainRow`][amp_jax.ExplainRow] groups, most FLOPs first.
      summary: the [`ExplainSummary`][amp_jax.ExplainSummary].
      policy: the policy that was explained.
    """

    def __init__(self, rows: list[ExplainRow], summary: ExplainSummary, policy: Policy):
        self.rows = rows
        self.summary = summary
        self.policy = policy

    def _columns(self, rows: Sequence[ExplainRow]) -> list[tuple[str, ...]]:
        return [
            (
                r.where,
                r.scope,
                "bwd" if r.backward else "fwd",
                r.primitive,
                r.dtype,
                str(r.count),
                _fmt_num(r.flops),
                _fmt_num(r.bytes),
                r.reason,
            )
            for r in rows
        ]

    _HEADER = ("source line", "scope", "pass", "op", "ran in", "runs", "FLOPs", "bytes", "reason")

    def summary_lines(self) -> list[str]:
        s = self.summary
        flops = ", ".join(f"{k} {_fmt_num(v)}" for k, v in s.flops_by_dtype.items()) or "none"
        mm = ", ".join(f"{k} {_fmt_num(v)}" for k, v in s.matmul_flops_by_dtype.items()) or "none"
        name = s.compute_dtype
        if getattr(self.policy, "float8", "off") != "off":
            name += f" + float8 {self.policy.float8} (large dense matmuls; see the reasons)"
        return [
            f"policy {name}: {100 * s.low_flop_share:.1f}% of FLOPs in low precision "
            f"({100 * s.low_matmul_flop_share:.1f}% of matmul/conv FLOPs)",
            f"FLOPs by dtype: {flops}; matmul/conv: {mm}",
            f"bytes moved {_fmt_num(s.bytes_moved)}B vs {_fmt_num(s.bytes_moved_original)}B "
            f"in float32 ({_saved_or_more(s.bytes_saved)}); casts inserted: "
            f"{s.casts_inserted} ({s.casts_run} executed)",
        ]

    def format(
        self,
        max_rows: int | None = 40,
        *,
        min_flops: int = 0,
        width: int | None = 120,
        verbose: bool = False,
    ) -> str:
        """The report as text.

        Args:
          max_rows: show at most this many rows (most FLOPs first); None for all.
          min_flops: hide rows with fewer FLOPs (casts have 0).
          width: fit each row in this many characters: long source paths and
            scopes are shortened and the reason is cut (None: no limit).
          verbose: show every row's full source path, amp's own scope names and
            the whole reason, whatever the width.

        Returns:
          An aligned table followed by the summary.
        """
        rows = [r for r in self.rows if r.flops >= min_flops]
        shown = rows if max_rows is None else rows[:max_rows]
        cols = self._columns(shown)
        table = [self._HEADER, *cols]
        if not verbose:
            table = [_compact(r) for r in table]
            if all(r[1] == "-" for r in table[1:]):  # no named scopes: no column
                table = [(r[0], *r[2:]) for r in table]
        if not verbose and width is not None:
            table = _fit(table, width)
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
        if len(shown) < len(rows):
            lines.append(
                f"... {len(rows) - len(shown)} more rows (format(max_rows=None) shows all)"
            )
        return "\n".join([*lines, "", *self.summary_lines()])

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        return (
            f"Explanation({len(self.rows)} rows, policy={self.policy.compute_dtype.name!r}, "
            f"low_flop_share={self.summary.low_flop_share:.3f})"
        )

    def _repr_html_(self) -> str:
        esc = html.escape
        head = "".join(f"<th style='text-align:left'>{esc(h)}</th>" for h in self._HEADER)
        body = []
        for r, cols in zip(self.rows, self._columns(self.rows)):
            low = (
                r.dtype in ("bfloat16", "float16")
                or r.dtype.endswith("->bfloat16")
                or r.dtype.endswith("->float16")
            )
            style = " style='background:#e8f4ea'" if low else ""
            body.append(f"<tr{style}>" + "".join(f"<td>{esc(c)}</td>" for c in cols) + "</tr>")
        summary = "".join(f"<li>{esc(line)}</li>" for line in self.summary_lines())
        return (
            f"<div><ul>{summary}</ul><table><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table></div>"
        )


def _measure(jaxpr: Any) -> tuple[list[tuple[Any, int]], int, int, int]:
    """(float eqns with their run counts, bytes moved, float casts, float casts run)."""
    eqns, nbytes, casts, casts_run = [], 0, 0, 0
    for eqn, _, times, outer in iter_eqns(jaxpr):
        if not _touches_float(eqn):
            continue
        eqns.append((eqn, times, _full_stack(eqn, outer)))
        nbytes += times * sum(_nbytes(v.aval) for v in (*eqn.invars, *eqn.outvars))
        if _is_float_cast(eqn):
            casts += 1
            casts_run += times
    return eqns, nbytes, casts, casts_run


def _row_reason(
    decisions: dict, eqn: Any, stack: str, orig_keys: collections.Counter, seen: collections.Counter
) -> str:
    key = (compat.source_line(eqn), eqn.primitive.name)
    found = _decision_at(decisions[key], _scope(stack)) if key in decisions else None
    if _is_float_cast(eqn):
        seen[key] += 1
        if seen[key] > orig_keys.get(key, 0):
            return "cast inserted by amp"
        return "cast in the original program"
    path = attention_from_stack(stack)  # the path each attention took (attention.py)
    attention = path.text if path is not None else None
    if path is not None and path.impl is not None:  # run fused: amp wrote these ops
        reason = path.text
    elif found:
        reason = found.most_common(1)[0][0]
    else:
        line = [c for (w, _), by in decisions.items() if w == key[0] for c in by.values()]
        merged = sum(line, collections.Counter())
        reason = (
            f"derived by JAX from this line's ops ({merged.most_common(1)[0][0]})"
            if merged
            else "no amp decision (added by a JAX transformation, or outside the amp function)"
        )
    if attention and reason != attention:  # left as written: the dtype reason, and why
        reason = f"{reason}; {attention}"
    if _is_backward(stack) and found:
        return f"backward of: {reason}"
    return reason


def explain(
    fn: Callable[..., Any],
    *args: Any,
    policy: Policy | str | Any = None,
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
        Equinox modules (non-array leaves are static) work as arguments.
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
    base, pol = _split_fn(fn, policy)
    g = _check_grad(grad)
    base = _loss_of(base, has_aux, "explain", g is not None)
    decisions = _trace_decisions(base, pol, args, kwargs)
    amp_fn = AmpFunction(base, pol)
    run, dyn = _flat_call(amp_fn, args, kwargs, g)
    orig, _ = _flat_call(base, args, kwargs, g)
    new_jaxpr = compat.jaxpr_of(jax.make_jaxpr(run)(*dyn))
    old_jaxpr = compat.jaxpr_of(jax.make_jaxpr(orig)(*dyn))
    new_eqns, new_bytes, new_casts, new_casts_run = _measure(new_jaxpr)
    old_eqns, old_bytes, old_casts, old_casts_run = _measure(old_jaxpr)
    orig_cast_keys = collections.Counter(
        (compat.source_line(e), e.primitive.name) for e, _, _ in old_eqns if _is_float_cast(e)
    )

    groups: dict[tuple, list[int]] = {}
    flops_by: collections.Counter = collections.Counter()
    mm_by: collections.Counter = collections.Counter()
    seen: collections.Counter = collections.Counter()
    for eqn, times, stack in new_eqns:
        dtype = ran_in(eqn)
        flops = times * eqn_flops(eqn)
        nbytes = times * sum(_nbytes(v.aval) for v in (*eqn.invars, *eqn.outvars))
        key = (
            compat.source_line(eqn),
            _scope(stack),
            _is_backward(stack),
            eqn.primitive.name,
            dtype,
            _row_reason(decisions, eqn, stack, orig_cast_keys, seen),
        )
        acc = groups.setdefault(key, [0, 0, 0])
        acc[0] += times
        acc[1] += flops
        acc[2] += nbytes
        if flops:
            flops_by[dtype] += flops
            if eqn.primitive.name in MATMULS:
                mm_by[dtype] += flops
    rows = [ExplainRow(*k, count=c, flops=f, bytes=b) for k, (c, f, b) in groups.items()]
    rows.sort(key=lambda r: (-r.flops, -r.bytes, r.where, r.primitive))

    def low_share(by: collections.Counter) -> float:
        total = sum(by.values())
        low = sum(v for k, v in by.items() if np.dtype(k.split(",")[0]).itemsize < 4)
        return low / total if total else 0.0

    summary = ExplainSummary(
        compute_dtype=pol.compute_dtype.name,
        flops_by_dtype=dict(flops_by.most_common()),
        matmul_flops_by_dtype=dict(mm_by.most_common()),
        low_flop_share=low_share(flops_by),
        low_matmul_flop_share=low_share(mm_by),
        bytes_moved=new_bytes,
        bytes_moved_original=old_bytes,
        casts_inserted=new_casts - old_casts,
        casts_run=new_casts_run - old_casts_run,
    )
    return Explanation(rows, summary, pol)
