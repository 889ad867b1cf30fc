"""What [`explain`][amp_jax.explain] returns: `ExplainRow` groups, the `ExplainSummary`
and the `Explanation` that holds them, with its text table and HTML views."""

from __future__ import annotations

import dataclasses
import html
import re
import textwrap
from collections.abc import Sequence

from amp_jax._src.policy import Policy


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
