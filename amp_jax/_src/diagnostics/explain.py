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
import dataclasses
import html
import math
import re
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from jax.extend import core as jex_core
from jax.typing import DTypeLike

from amp_jax._src import compat, jaxprs
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
from amp_jax._src.jaxprs import iter_eqns, open_jaxpr
from amp_jax._src.policy import DEFAULT_ALLOW, Policy, is_managed_float
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
#: the matmuls and convolutions, whose FLOPs the summary also counts apart.
MATMULS = DEFAULT_ALLOW


# -- per-eqn measures -----------------------------------------------------------------


def _size(aval: compat.AbstractValue | None) -> int:
    return int(math.prod(getattr(aval, "shape", ())))


def _nbytes(aval: compat.AbstractValue) -> int:
    dtype = getattr(aval, "dtype", None)
    try:
        return _size(aval) * np.dtype(dtype).itemsize
    except TypeError:  # key types, tokens
        return 0


def _eqn_bytes(eqn: compat.Eqn, memo: dict[Any, int]) -> int:
    """Bytes ``eqn`` reads and writes once (``memo``: by aval, for a whole program)."""
    total = 0
    for v in (*eqn.invars, *eqn.outvars):
        aval = v.aval
        try:
            n = memo[aval]
        except KeyError:
            n = memo[aval] = _nbytes(aval)
        except TypeError:  # an unhashable aval
            n = _nbytes(aval)
        total += n
    return total


def eqn_flops(eqn: compat.Eqn) -> int:
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


def _touches_float(eqn: compat.Eqn) -> bool:
    return bool(float_dtypes(eqn.invars) or float_dtypes(eqn.outvars))


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
      flops_by_dtype: FLOPs of the rewritten program per dtype they ran in (an op
        nothing reads, which XLA removes, neither runs nor moves bytes).
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
      cast_bytes: bytes read and written by the casts amp inserted.
      own_bytes: bytes read and written by the other ops amp adds (the
        barriers that keep a dot's operand layout, the reshapes and transposes
        of its low-precision backward), which the default view folds into the
        row of the op they serve.
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
    cast_bytes: int = 0
    own_bytes: int = 0

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


def _signed(n: int) -> str:
    return ("+" if n >= 0 else "-") + _fmt_num(abs(n))


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


def _fit(table: list[tuple[str, ...]], width: int) -> tuple[list[tuple[str, ...]], int]:
    """Cuts the source line and the scope (if shown) so that a row fits ``width``
    with the reason wrapped; returns the table and the reason's width."""
    has_scope = table[0][1] == "scope"
    table = [(_cut_where(r[0], 30), *r[1:]) for r in table]
    if has_scope:
        table = [(r[0], _cut(r[1], 16, tail=True), *r[2:]) for r in table]
    fixed = sum(max(len(r[i]) for r in table) + 2 for i in range(len(table[0]) - 1))
    return table, max(16, width - fixed)


class Explanation:
    """What [`explain`][amp_jax.explain] returns: rows, a summary, text and HTML views.

    ``str(explanation)`` is an aligned text table (``format`` takes options);
    in a notebook the object renders as an HTML table.

    Attributes:
      rows: the [`ExplainRow`][amp_jax.ExplainRow] groups, most FLOPs first; the
        barriers, reshapes and transposes amp adds around an op are counted in
        that op's row.
      all_rows: the same with amp's own ops in rows of their own (what
        ``format(verbose=True)`` shows).
      summary: the [`ExplainSummary`][amp_jax.ExplainSummary].
      policy: the policy that was explained.
    """

    def __init__(
        self,
        rows: list[ExplainRow],
        summary: ExplainSummary,
        policy: Policy,
        all_rows: list[ExplainRow] | None = None,
    ):
        self.rows = rows
        self.all_rows = rows if all_rows is None else all_rows
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
        ops = s.bytes_moved - s.cast_bytes - s.own_bytes - s.bytes_moved_original
        own = f", its barriers and layout copies {_signed(s.own_bytes)}B" if s.own_bytes else ""
        return [
            f"policy {name}: {100 * s.low_flop_share:.1f}% of FLOPs in low precision "
            f"({100 * s.low_matmul_flop_share:.1f}% of matmul/conv FLOPs)",
            f"FLOPs by dtype: {flops}; matmul/conv: {mm}",
            f"bytes moved {_fmt_num(s.bytes_moved)}B vs {_fmt_num(s.bytes_moved_original)}B "
            f"in float32 ({_saved_or_more(s.bytes_saved)}); casts inserted: "
            f"{s.casts_inserted} ({s.casts_run} executed)",
            f"bytes by cause: the casts amp inserted {_signed(s.cast_bytes)}B{own}, "
            f"the ops themselves {_signed(ops)}B",
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
            scopes are shortened and the reason is wrapped onto the lines below
            (None: no limit).
          verbose: show every row's full source path, amp's own scope names,
            its own barriers and layout copies as rows of their own and the
            whole reason on one line, whatever the width.

        Returns:
          An aligned table followed by the summary.
        """
        rows = [r for r in (self.all_rows if verbose else self.rows) if r.flops >= min_flops]
        shown = rows if max_rows is None else rows[:max_rows]
        cols = self._columns(shown)
        table = [self._HEADER, *cols]
        if not verbose:
            table = [_compact(r) for r in table]
            if all(r[1] == "-" for r in table[1:]):  # no named scopes: no column
                table = [(r[0], *r[2:]) for r in table]
        cap = None
        if not verbose and width is not None:
            table, cap = _fit(table, width)
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]
        indent = " " * sum(w + 2 for w in widths)
        lines = []
        for r in table:
            head = "".join(c.ljust(w) + "  " for c, w in zip(r, widths))
            # the whole reason, wrapped under its column where it is wider than ``cap``
            parts = textwrap.wrap(r[-1], cap, break_on_hyphens=False) if cap else [r[-1]]
            lines.append((head + (parts[0] if parts else "")).rstrip())
            lines.extend(indent + part for part in parts[1:])
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


class _Measured(NamedTuple):
    """The floating ops of one program and what they moved."""

    eqns: list[tuple[Any, int, str, Any, int]]  # (eqn, times, name stack, site, bytes once)
    nbytes: int  # bytes read and written, all runs together
    casts: int  # floating casts in the code
    casts_run: int  # floating casts executed
    unused: frozenset[int] = frozenset()  # ids of the eqns nothing reads (`unused_eqns`)


def unused_eqns(jaxpr: compat.ClosedJaxpr | compat.Jaxpr) -> frozenset[int]:
    """The ids of the eqns of ``jaxpr`` and its sub-jaxprs whose results nothing
    reads (no effects either): XLA removes them. A sub-jaxpr of a used eqn has
    all its outputs read; every eqn of an unused one is unused."""
    unused: set[int] = set()
    used: set[int] = set()

    def walk(j: compat.ClosedJaxpr | compat.Jaxpr, alive: bool) -> None:
        needed = {v for v in j.outvars if not isinstance(v, compat.Literal)} if alive else set()
        for eqn in reversed(j.eqns):
            live = alive and (
                bool(eqn.effects)
                or any(not compat.is_drop_var(v) and v in needed for v in eqn.outvars)
            )
            (used if live else unused).add(id(eqn))
            if live:
                needed.update(v for v in eqn.invars if not isinstance(v, compat.Literal))
            for sub in jex_core.jaxprs_in_params(eqn.params):
                walk(open_jaxpr(sub)[0], live)

    walk(jaxpr, True)
    return frozenset(unused - used)


def _measure(jaxpr: compat.ClosedJaxpr) -> _Measured:
    """The floating eqns of ``jaxpr`` with their run counts, bytes moved and casts."""
    eqns, nbytes, casts, casts_run = [], 0, 0, 0
    memo: dict[Any, int] = {}
    unused = unused_eqns(jaxpr)
    for eqn, _, times, outer, site in iter_eqns(jaxpr):
        if not _touches_float(eqn):
            continue
        dead = id(eqn) in unused  # (XLA removes it: it moves nothing, never runs)
        once = 0 if dead else _eqn_bytes(eqn, memo)
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
