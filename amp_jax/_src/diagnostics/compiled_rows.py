"""The rows of a [`compiled_report`][amp_jax.compiled_report]: the compiled programs'
matmuls, convolutions and attention calls grouped by source line, pass and kind and
matched to the operand types of amp's program (with the reason a group differs), and
their collectives paired between the partitioned and the final program."""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from amp_jax._src import compat
from amp_jax._src.diagnostics.hlo import NUMPY_NAMES, HloOp, shape_bytes
from amp_jax._src.diagnostics.measure import unused_eqns
from amp_jax._src.diagnostics.reasons import SourceLines, full_stack, is_backward
from amp_jax._src.jaxprs import iter_eqns

#: planned primitive -> HLO kind
_PRIMITIVE_KINDS = {"dot_general": "matmul", "conv_general_dilated": "convolution"}
_HLO_NAMES = {v: k for k, v in NUMPY_NAMES.items()}


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


_Types = collections.Counter  # "bf16,bf16->f32" -> count


def _types(op: HloOp) -> str:
    return f"{','.join(op.operands)}->{op.result}"


def _show(types: _Types) -> str:
    return " | ".join(k if n == 1 else f"{k} x{n}" for k, n in sorted(types.items())) or "-"


def _operands(types: _Types) -> set[str]:
    return {k.split("->")[0] for k in types}


def _key(where: str) -> str:
    """``file:line``: a source line without its column and function."""
    m = re.match(r"(.*?):(\d+)", where)
    return f"{m.group(1)}:{m.group(2)}" if m else where


def _hlo_name(dtype: Any) -> str:
    name = np.dtype(dtype).name
    return _HLO_NAMES.get(name, name)


# -- the plan --------------------------------------------------------------------------


def planned_by_key(closed: compat.ClosedJaxpr) -> dict[tuple[str, bool, str], _Types]:
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


def reasons_by_key(explanation: Any) -> dict[tuple[str, bool, str], str]:
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


def op_rows(
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


def collective_rows(part: list[HloOp], final: list[HloOp], backend: str) -> list[CompiledRow]:
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
