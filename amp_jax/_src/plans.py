"""The plan record and its printer.

A `Plan` is what amp decided for one (prepared) closed jaxpr: a `Decision`
per eqn (``decision.py``), the fused attentions, the backend's layouts of
lowered dots, and the attentions found. A higher-order eqn's decision holds
the plans of its sub-jaxprs, so a plan is a tree, printed whole by
`format_plan` without tracing. Planning (``planning.py``) makes it; the
interpreter, its rules, ``explain`` and ``dtype_report`` read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from amp_jax._src import compat
from amp_jax._src.attention.match import Match
from amp_jax._src.decision import Decision, Fused, LazyBody, Variant


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """What amp decided for one (prepared) closed jaxpr, eqn by eqn: a tree,
    whose higher-order eqns' decisions hold the plans of their bodies
    (`Decision.bodies`). Compared by identity (one per jaxpr, hints and
    context in a trace)."""

    closed: compat.ClosedJaxpr
    decisions: tuple[Decision, ...]
    #: the fused attentions, by the index of the eqn that computes each one
    fused: dict[int, tuple[Match, str]] = dataclasses.field(default_factory=dict)
    #: the backend's layouts of lowered dots, by eqn index (XLA:CPU: `cpu.DotLayout`)
    layouts: dict[int, Any] = dataclasses.field(default_factory=dict)
    #: (source line of the scores matmul, implementation or None, reason) of
    #: every attention recognised in the jaxpr (``attention/``)
    attentions: tuple[tuple[str, str | None, str], ...] = ()

    @property
    def jaxpr(self) -> Any:
        return compat.jaxpr_of(self.closed)

    def __str__(self) -> str:
        return format_plan(self)


def format_plan(p: Plan) -> str:
    """The plan tree as text: a line per eqn (index, primitive, class, color,
    what an allow op writes, variant and fused part where not the default, the
    reason), under a higher-order eqn the hints of its sub-jaxprs and each
    sub-jaxpr's plan, indented (a body JAX traces later, `LazyBody`, as one
    line), under a dot or transpose the backend's layout record; then the
    attentions found."""
    return "\n".join(_plan_lines(p, ""))


def _plan_lines(p: Plan, indent: str) -> Iterator[str]:
    for i, (eqn, d) in enumerate(zip(p.jaxpr.eqns, p.decisions)):
        what = d.op_class.value if d.op_class is not None else d.kind.value
        out = "" if d.out_dtype is None else f"-> {np.dtype(d.out_dtype).name}"
        extra = [f"variant={d.variant.value}"] if d.variant is not Variant.COMPUTE else []
        extra += [f"fused={d.fused.value}"] if d.fused is not Fused.NO else []
        yield (
            f"{indent}{i:>4} {eqn.primitive.name:<22} {what:<10} {d.color.value:<4} {out:<11} "
            + " ".join([*extra, f"{d.reason.why.value}: {d.reason.text}"])
        )
        hints = dict(d.hints)
        planned = {b.where for b in d.bodies}
        for where, h in d.hints:
            if where not in planned:
                yield f"{indent}{'':>9}{where}: {h}"
        if i in p.layouts:
            yield f"{indent}{'':>9}layout: {p.layouts[i]}"
        for b in d.bodies:
            if isinstance(b.plan, LazyBody):
                yield f"{indent}{'':>9}{b.where}: planned when traced ({b.plan.what})"
                continue
            head = f"{indent}{'':>9}{b.where}:"
            yield f"{head} {hints[b.where]}" if b.where in hints else head
            yield from _plan_lines(b.plan, indent + " " * 9)
    for line, impl, why in p.attentions:
        yield f"{indent}attention at {line}: {impl or 'left as written'} ({why})"


__all__ = ("Plan", "format_plan")
