"""``compiled_report``: what XLA compiled and ran, against what amp planned.

[`explain`][amp_jax.explain] reads amp's plan and the jaxpr amp hands to XLA;
XLA may still change the element types: a backend without bf16 collectives or
float8 matmuls upcasts them (XLA:CPU's float normalization), a pass removes or
merges an op. This module compiles the program with public JAX API only
(``jax.jit(...).lower(...).compile(compiler_options=...)``) and reads the HLO
text of two programs (hlo.py parses them):

* ``partitioned``: the program compiled with this backend's precision passes
  turned off (``xla_disable_hlo_passes``: float normalization, the operand
  upcaster, change-op-data-type): the element types the SPMD partitioner gave
  each op, which a backend that runs them natively (GPU, TPU) keeps. JAX has
  no public API for the module right after SPMD partitioning; for the FSDP
  step of workloads/sharded.py this program's collectives are those of XLA's
  own dump after its ``spmd-partitioning`` pass (tests/test_compiled_report.py).
  Where the backend cannot compile a type at all (XLA:CPU has no float8 dot),
  the passes for that type stay on and the report says so.
* ``final``: the optimized program this backend runs (``Compiled.as_text()``).

Each matmul and convolution of the amp program (its jaxpr, as ``explain``
walks it) is matched to the HLO ops of the same source line, pass (forward or
backward) and kind; collectives are matched between the two programs by kind
and shape. A row whose compiled element types differ from amp's plan, or an
op XLA removed, is a disagreement, with the reason inferred from the two
programs.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.typing import DTypeLike

from amp_jax._src import compat
from amp_jax._src.diagnostics.explain import explain, unused_eqns
from amp_jax._src.diagnostics.hlo import KINDS, NUMPY_NAMES, HloOp, hlo_ops, shape_bytes
from amp_jax._src.diagnostics.reasons import SourceLines, full_stack, is_backward
from amp_jax._src.diagnostics.tracing import check_grad, flat_call, loss_of, split_fn
from amp_jax._src.jaxprs import iter_eqns
from amp_jax._src.policy import Policy
from amp_jax._src.transform import AmpFunction

#: the low-precision float types XLA may normalize (HLO names)
_NORMALIZED: tuple[str, ...] = (
    "bf16",
    "f16",
    "f8e4m3fn",
    "f8e5m2",
    "f8e4m3fnuz",
    "f8e5m2fnuz",
    "f8e4m3",
)
_NORMALIZED += ("f8e3m4", "f8e8m0fnu", "f4e2m1fn")
#: the XLA passes that change an op's element types for the backend's sake
PRECISION_PASSES: tuple[str, ...] = (
    "operand_upcaster",
    "change-op-data-type",
    *(f"float-normalization-{t}" for t in _NORMALIZED),
)
#: planned primitive -> HLO kind
_PRIMITIVE_KINDS = {"dot_general": "matmul", "conv_general_dilated": "convolution"}
_HLO_NAMES = {v: k for k, v in NUMPY_NAMES.items()}
_UNSUPPORTED = re.compile(r"unsupported (?:operand|result)? ?type (\w+)", re.I)


@dataclasses.dataclass(frozen=True)
class CompiledRow:
    """One group of compiled ops: same source line, pass, kind and element types.

    Attributes:
      where: the user's source line, ``file:line (function)``.
      backward: whether the ops belong to the backward pass of ``jax.grad``.
      kind: ``"matmul"``, ``"convolution"``, ``"attention"`` or ``"collective"``.
      op: the HLO opcode (``dot``, ``all-gather``) or custom-call target
        (``__cublas$lt$matmul$f8``, cuDNN's attention).
      planned: the operand types amp's program gives the ops (``bf16,bf16``),
        ``-`` where amp plans nothing (collectives, a function without a plan).
      partitioned: ``operands->result`` types after SPMD partitioning (what a
        GPU or TPU runs and moves), ``-`` when XLA had removed the op.
      final: the same in the optimized program this backend runs.
      count: how many HLO ops the row groups (after partitioning, else final).
      nbytes: bytes of their results in the final program (for collectives:
        what they move), else after partitioning.
      agrees: whether the ops run as amp planned (a collective: whether the
        final program keeps the partitioned types).
      reason: why not, as far as the two programs tell (empty when it agrees).
      op_name: the JAX name stack of one of the ops (``named_scope`` paths show
        here: a strict check can select rows by it).
    """

    where: str
    backward: bool
    kind: str
    op: str
    planned: str
    partitioned: str
    final: str
    count: int
    nbytes: int
    agrees: bool
    reason: str
    op_name: str


class PrecisionMismatchError(AssertionError):
    """[`compiled_report`][amp_jax.compiled_report]``(strict=...)``: the compiled
    program does not run as amp planned. ``.report`` holds the whole report."""

    def __init__(self, message: str, report: CompiledReport):
        super().__init__(message)
        self.report = report


_Types = collections.Counter  # "bf16,bf16->f32" -> count


def _types(op: HloOp) -> str:
    return f"{','.join(op.operands)}->{op.result}"


def _show(types: _Types) -> str:
    return " | ".join(k if n == 1 else f"{k} x{n}" for k, n in sorted(types.items())) or "-"


def _operands(types: _Types) -> set[str]:
    return {k.split("->")[0] for k in types}


class CompiledReport:
    """What [`compiled_report`][amp_jax.compiled_report] returns.

    ``str(report)`` is an aligned table of the rows, disagreements first.

    Attributes:
      rows: the [`CompiledRow`][amp_jax.CompiledRow] groups: matmuls,
        convolutions and attention first, then collectives.
      backend: the platform XLA compiled for (``cpu``, ``gpu``, ``tpu``).
      kept_passes: the precision passes left on after partitioning because the
        backend cannot compile the types without them (empty on a backend that
        runs every type), with the compiler's message.
      partitioned_text: the HLO text of the program after partitioning.
      final_text: the HLO text of the optimized program.
    """

    def __init__(
        self,
        rows: list[CompiledRow],
        backend: str,
        kept_passes: dict[str, str],
        partitioned_text: str,
        final_text: str,
    ):
        self.rows = rows
        self.backend = backend
        self.kept_passes = kept_passes
        self.partitioned_text = partitioned_text
        self.final_text = final_text

    @property
    def disagreements(self) -> list[CompiledRow]:
        """The rows that do not run as amp planned."""
        return [r for r in self.rows if not r.agrees]

    def collectives(self, stage: str = "final") -> dict[tuple[str, str], list[int]]:
        """``{(kind, element type): [count, bytes]}`` of the collectives of one program.

        Args:
          stage: ``"partitioned"`` or ``"final"``.

        Returns:
          Counts and result bytes by kind and HLO element type (a combined
          collective counts once, under its first result's type; its bytes go
          to each result's type).
        """
        if stage not in ("partitioned", "final"):
            raise ValueError(f"stage must be 'partitioned' or 'final', got {stage!r}.")
        text = self.partitioned_text if stage == "partitioned" else self.final_text
        out: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
        for op in hlo_ops(text):
            if op.kind != "collective":
                continue
            for part in op.shape.split(", "):
                out[op.opcode, part.split("[")[0]][1] += shape_bytes(part)
            out[op.opcode, op.result][0] += 1
        return dict(out)

    def format(self, width: int | None = 120) -> str:
        """The rows as an aligned text table, disagreements first."""
        header = ("source line", "pass", "op", "planned", "partitioned", "final", "n", "reason")
        rows = sorted(self.rows, key=lambda r: (r.agrees, KINDS.index(r.kind), r.where))
        table = [header] + [
            (
                r.where,
                "bwd" if r.backward else "fwd",
                r.op,
                r.planned,
                r.partitioned,
                r.final,
                str(r.count),
                r.reason or "agrees",
            )
            for r in rows
        ]
        widths = [max(len(t[i]) for t in table) for i in range(len(header) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(t, widths)) + "  " + t[-1] for t in table]
        if width is not None:
            lines = [line if len(line) <= width else line[: width - 3] + "..." for line in lines]
        n = len(self.disagreements)
        tail = f"{len(self.rows)} rows on {self.backend}, {n} not as amp planned"
        if self.kept_passes:
            tail += "; kept on after partitioning: " + ", ".join(self.kept_passes)
        return "\n".join([*lines, "", tail])

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        return f"CompiledReport({len(self.rows)} rows, {len(self.disagreements)} disagreements)"


# -- the two programs ------------------------------------------------------------------


def _compile_partitioned(lowered: Any) -> tuple[str, dict[str, str]]:
    """The HLO text of ``lowered`` compiled with `PRECISION_PASSES` off, and the
    passes left on because the backend cannot compile a type without them: those
    of the type the compiler names, else the upcasters, else every one."""
    off = list(PRECISION_PASSES)
    kept: dict[str, str] = {}
    while True:
        try:
            opts = {"xla_disable_hlo_passes": ",".join(off)}
            return lowered.compile(compiler_options=opts).as_text() or "", kept
        except jax.errors.JaxRuntimeError as e:
            if not off:
                raise
            m = _UNSUPPORTED.search(str(e))
            dtype = m.group(1).lower() if m else None
            fix = [p for p in off if dtype and p.endswith(f"-{dtype}")]
            fix += [p for p in ("operand_upcaster", "change-op-data-type") if p in off]
            for p in fix or list(off):
                off.remove(p)
                kept[p] = str(e).strip().splitlines()[0][:160]


def _key(where: str) -> str:
    """``file:line``: a source line without its column and function."""
    m = re.match(r"(.*?):(\d+)", where)
    return f"{m.group(1)}:{m.group(2)}" if m else where


def _hlo_name(dtype: Any) -> str:
    name = np.dtype(dtype).name
    return _HLO_NAMES.get(name, name)


# -- the plan --------------------------------------------------------------------------


def _planned(closed: compat.ClosedJaxpr) -> dict[tuple[str, bool, str], _Types]:
    """``{(file:line, backward, kind): Counter of operand types}`` of the matmuls
    and convolutions of a jaxpr XLA keeps (unused ones are removed)."""
    jaxpr = compat.jaxpr_of(closed)
    unused = unused_eqns(jaxpr)
    lines = SourceLines()
    out: dict[tuple[str, bool, str], _Types] = collections.defaultdict(collections.Counter)
    for eqn, _, _, outer, site in iter_eqns(jaxpr):
        kind = _PRIMITIVE_KINDS.get(eqn.primitive.name)
        if kind is None or id(eqn) in unused:
            continue
        ops = ",".join(_hlo_name(getattr(v.aval, "dtype", None)) for v in eqn.invars)
        key = (_key(lines(site)), is_backward(full_stack(eqn, outer)), kind)
        out[key][ops] += 1
    return out


def _reasons(explanation: Any) -> dict[tuple[str, bool, str], str]:
    """amp's reason of each matmul/convolution group of an explanation, by key."""
    out: dict[tuple[str, bool, str], str] = {}
    for r in explanation.all_rows:
        kind = _PRIMITIVE_KINDS.get(r.primitive)
        if kind is not None and "unused" not in r.reason:
            out.setdefault((_key(r.where), r.backward, kind), r.reason)
    return out


# -- matching --------------------------------------------------------------------------


def _by_key(ops: Sequence[HloOp]) -> dict[tuple[str, bool, str], list[HloOp]]:
    out: dict[tuple[str, bool, str], list[HloOp]] = collections.defaultdict(list)
    for op in ops:
        if op.kind != "collective":
            out[_key(op.where), op.backward, op.kind].append(op)
    return out


def _op_reason(
    kind: str, planned: set[str], part: _Types, final: _Types, backend: str, kept: dict
) -> str:
    """Why the compiled ops of one group differ from amp's plan ('' when they agree)."""
    if planned and not final:
        if part:
            return f"merged or removed by XLA:{backend} after partitioning"
        return (
            f"removed or rewritten by XLA:{backend} before partitioning (folded, or a "
            "small dot made elementwise)"
        )
    if not planned or _operands(final) == planned:
        return ""
    ran = {t for f in final for t in f.split("->")[0].split(",")}
    lost = sorted({t for p in planned for t in p.split(",")} - ran)
    what = f"{'/'.join(NUMPY_NAMES.get(t, t) for t in lost)} {kind}s"
    if not lost:  # some of the group's ops changed, not all
        what = f"some {kind}s of ({' | '.join(sorted(planned))})"
        what += f", which ran as ({' | '.join(sorted(_operands(final) - planned))})"
    if _operands(part) == planned:
        return (
            f"upcast by XLA:{backend} after partitioning: this backend does not run {what} "
            "(its precision passes -- float normalization, operand upcasting -- convert "
            "them); a backend that does runs the partitioned types"
        )
    if any(p.endswith(tuple(lost)) for p in kept):
        why = next(v for p, v in kept.items() if p.endswith(tuple(lost)))
        return f"XLA:{backend} cannot compile {what} ({why}): it upcasts them"
    return f"changed by XLA:{backend} before or during partitioning"


def _op_rows(
    planned: dict[tuple[str, bool, str], _Types],
    reasons: dict[tuple[str, bool, str], str],
    part: list[HloOp],
    final: list[HloOp],
    backend: str,
    kept: dict[str, str],
) -> list[CompiledRow]:
    """One row per (source line, pass, kind) of the planned and compiled
    matmuls, convolutions and attention calls."""
    p_by, f_by = _by_key(part), _by_key(final)
    rows = []
    for key in sorted({*planned, *p_by, *f_by}):
        p_ops, f_ops = p_by.get(key, []), f_by.get(key, [])
        p_types = collections.Counter(_types(o) for o in p_ops)
        f_types = collections.Counter(_types(o) for o in f_ops)
        plan = planned.get(key, collections.Counter())
        reason = _op_reason(key[2], set(plan), p_types, f_types, backend, kept)
        if reason and key in reasons:
            reason += f" (amp: {reasons[key]})"
        any_op = (f_ops or p_ops)[0] if (f_ops or p_ops) else None
        rows.append(
            CompiledRow(
                where=any_op.where if any_op else key[0],
                backward=key[1],
                kind=key[2],
                op="/".join(sorted({o.opcode for o in (*p_ops, *f_ops)})) or "-",
                planned=" | ".join(sorted(plan)) or "-",
                partitioned=_show(p_types),
                final=_show(f_types),
                count=len(p_ops) or len(f_ops) or sum(plan.values()),
                nbytes=sum(o.nbytes for o in (f_ops or p_ops)),
                agrees=not reason,
                reason=reason,
                op_name=any_op.op_name if any_op else "",
            )
        )
    return rows


def _members(ops: Sequence[HloOp]) -> list[tuple[HloOp, str, str]]:
    """``(op, element type, dims)`` of each result of each collective."""
    out = []
    for op in ops:
        if op.kind == "collective":
            for part in op.shape.split(", "):
                dtype, _, dims = part.partition("[")
                out.append((op, dtype, dims))
    return out


def _collective_rows(part: list[HloOp], final: list[HloOp], backend: str) -> list[CompiledRow]:
    """The collectives after partitioning, each paired with the final program's
    collective of its kind and shape; grouped by line, pass, kind and types."""
    free: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for op, dtype, dims in _members(final):
        free[op.opcode, dims].append(dtype)
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for op, dtype, dims in _members(part):
        pool = free.get((op.opcode, dims), [])
        after = pool.pop(pool.index(dtype) if dtype in pool else 0) if pool else "-"
        key = (op.where, op.backward, op.opcode, dtype, after)
        acc = groups.setdefault(key, [0, 0, op.op_name])
        acc[0] += 1
        acc[1] += shape_bytes(f"{after}[{dims}]")
    for (opcode, _dims), pool in free.items():  # collectives the final program adds
        for dtype in pool:
            acc = groups.setdefault(("-", False, opcode, "-", dtype), [0, 0, ""])
            acc[0] += 1
    rows = []
    for (where, backward, opcode, before, after), (n, nbytes, op_name) in groups.items():
        if after == "-":
            reason = f"removed by XLA:{backend} after partitioning"
        elif before == "-":
            reason = f"added by XLA:{backend} after partitioning"
        elif before != after:
            reason = (
                f"upcast by XLA:{backend} after partitioning (its float normalization: this "
                f"backend does not move {NUMPY_NAMES.get(before, before)} {opcode}s); a GPU or "
                f"TPU moves {before}"
            )
        else:
            reason = ""
        rows.append(
            CompiledRow(
                where=where,
                backward=backward,
                kind="collective",
                op=opcode,
                planned="-",
                partitioned=before,
                final=after,
                count=n,
                nbytes=nbytes,
                agrees=not reason,
                reason=reason,
                op_name=op_name,
            )
        )
    return rows


# -- the report ------------------------------------------------------------------------


def compiled_report(
    fn: Callable[..., Any],
    *args: Any,
    policy: Policy | str | DTypeLike | None = None,
    grad: bool | int | tuple[int, ...] = False,
    has_aux: bool = False,
    strict: bool | Callable[[CompiledRow], bool] = False,
    **kwargs: Any,
) -> CompiledReport:
    """What XLA compiled from ``fn(*args, **kwargs)`` under amp, against amp's plan.

    Compiles the program (with ``grad``, its ``value_and_grad``) with
    ``jax.jit(...).lower(...).compile()`` and reports, per matmul, convolution
    and attention call (cuBLASLt float8 GEMMs and cuDNN attention are custom
    calls on a GPU) and per collective, the element types XLA runs at two
    points: after SPMD partitioning (what a GPU or TPU runs and moves) and in
    the final program of this backend. Each matmul and convolution is matched
    to the ops of amp's program with its source line and pass; a group whose
    compiled types differ from amp's, or that XLA removed, is a disagreement
    with the reason the two programs show (an upcast on this backend, a
    removed or merged op, a type the backend cannot compile). Call it under
    ``jax.set_mesh`` with sharded arguments to see a sharded program's
    collectives.

    Args:
      fn: the float32 function (with ``policy``), an [`amp`][amp_jax.amp]
        function, or any function of arrays (``policy=None``: compiled as it
        is, with nothing planned to compare: a training step with amp inside).
      *args: its positional arguments (arrays, possibly sharded).
      policy: the policy (default: ``fn``'s if it is an amp function).
      grad: ``True`` (or argnums) to compile ``jax.value_and_grad`` of ``fn``.
      has_aux: ``fn`` returns ``(loss, aux)``.
      strict: ``True`` raises [`PrecisionMismatchError`][amp_jax.PrecisionMismatchError]
        when any row disagrees; a predicate on [`CompiledRow`][amp_jax.CompiledRow]
        raises for the disagreeing rows it selects (e.g. ``lambda r: r.kind ==
        "matmul"``).
      **kwargs: keyword arguments of ``fn``.

    Returns:
      A [`CompiledReport`][amp_jax.CompiledReport].

    Raises:
      PrecisionMismatchError: with ``strict``, a selected row disagrees.

    Examples:
      >>> import jax.numpy as jnp
      >>> import amp_jax
      >>> def f(w, x):
      ...     return jnp.sum(jnp.tanh(x @ w))
      >>> w, x = jnp.ones((256, 256)), jnp.ones((64, 256))
      >>> rep = amp_jax.compiled_report(f, w, x, policy="bfloat16")
      >>> [(r.op, r.planned, r.agrees) for r in rep.rows]
      [('dot', 'bf16,bf16', True)]
    """
    if not (isinstance(strict, bool) or callable(strict)):
        raise TypeError(f"strict must be a bool or a predicate on CompiledRow, got {strict!r}.")
    g = check_grad(grad)
    planned = policy is not None or isinstance(fn, AmpFunction)
    if planned:
        base, pol = split_fn(fn, policy)
        base = loss_of(base, has_aux, "compiled_report", g is not None)
        run: Callable[..., Any] = AmpFunction(base, pol)
    else:
        run = loss_of(fn, has_aux, "compiled_report", g is not None)
    call, dyn = flat_call(run, args, kwargs, g)
    lowered = jax.jit(call).lower(*dyn)
    final_text = lowered.compile().as_text() or ""
    part_text, kept = _compile_partitioned(lowered)
    plan, reasons = {}, {}
    if planned:
        plan = _planned(jax.make_jaxpr(call)(*dyn))
        reasons = _reasons(explain(base, *args, policy=pol, grad=grad, **kwargs))
    backend = jax.default_backend()
    part, final = hlo_ops(part_text), hlo_ops(final_text)
    rows = _op_rows(plan, reasons, part, final, backend, kept)
    rows += _collective_rows(part, final, backend)
    report = CompiledReport(rows, backend, kept, part_text, final_text)
    _check(report, strict)
    return report


def _check(report: CompiledReport, strict: bool | Callable[[CompiledRow], bool]) -> None:
    if strict is False:
        return
    bad = [r for r in report.disagreements if strict is True or (callable(strict) and strict(r))]
    if bad:
        lines = [
            f"  {r.where} {'bwd' if r.backward else 'fwd'} {r.op}: planned {r.planned}, "
            f"ran {r.final}: {r.reason}"
            for r in bad
        ]
        raise PrecisionMismatchError(
            f"compiled_report(strict=...): {len(bad)} group(s) of ops did not run as amp "
            "planned:\n" + "\n".join(lines) + "\n(report.rows has them all; a predicate as "
            "strict= selects the rows to check)",
            report,
        )
