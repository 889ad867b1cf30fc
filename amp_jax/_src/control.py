"""What decides control flow, and what a loop carries: kept out of the compute dtype.

`make_draft` starts a `Draft` of a jaxpr's plan from its painting (``painted.py``) and keeps
in their original precision the eqns that compute what decides control flow
(`decision_seeds`: a while predicate, a ``cond`` index, the loop-carried
values that feed them), what a factorization or solve reads, and what a loop
carries to its next iteration, each traced back through the jaxpr
(`decision_slice`) to the matmuls, which still read compute-dtype operands
but write float32. What decides a loop is found through its carry by a fixed
point over its body (`_loop_reads`), and handed to the plans of the loop's
sub-jaxprs as their `BodyHints`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from amp_jax._src import casting, compat, jaxprs
from amp_jax._src.classify import Classified
from amp_jax._src.context import Context
from amp_jax._src.decision import NO_HINTS, BodyHints, Color, Kind, OpClass, Reason, Why
from amp_jax._src.painted import backend_kept, low_text, painted
from amp_jax._src.policy import SOLVES, is_managed_float


@dataclasses.dataclass
class Draft:
    """A plan being made: classes, colors, the reasons and outputs decided so far."""

    classified: list[Classified]
    colors: list[Color]
    #: eqns kept in their original precision by the painting, with the reason
    kept: dict[int, Reason] = dataclasses.field(default_factory=dict)
    #: low allow eqns whose results decide control flow or a carry: they write float32
    f32_out: set[int] = dataclasses.field(default_factory=set)
    #: {eqn index: {sub-jaxpr param: its hints}} of the higher-order eqns
    bodies: dict[int, dict[str, BodyHints]] = dataclasses.field(default_factory=dict)

    def hint(self, i: int, where: str, hints: BodyHints) -> None:
        """Adds ``hints`` to those of sub-jaxpr ``where`` of eqn ``i``."""
        at = self.bodies.setdefault(i, {})
        at[where] = at.get(where, NO_HINTS) | hints

    @property
    def classes(self) -> list[OpClass | None]:
        return [c.op_class for c in self.classified]

    @property
    def kinds(self) -> list[Kind]:
        return [c.kind for c in self.classified]


def make_draft(ctx: Context, jaxpr: compat.Jaxpr, hints: BodyHints = NO_HINTS) -> Draft:
    """Classes and colors of ``jaxpr``'s eqns, and the hints of their
    sub-jaxprs; ``hints``: what ``jaxpr``'s outputs are to its parent (it is
    a loop body, a while predicate, a cond branch)."""
    classified, colors = painted(ctx, jaxpr)
    draft = Draft(list(classified), list(colors))
    if ctx.identity:
        return draft
    # A while loop's exit test (a convergence test: |z' - z| < tol) and what
    # it reads through the carry are computed in float32, matmuls included:
    # compute-dtype operands put a floor of the compute dtype's rounding
    # under the tested difference, and the loop never stops.
    exits = [jaxpr.outvars[k] for k in hints.exits]
    _keep_slice(ctx, draft, jaxpr, exits, Why.DECIDES_EXIT, keep_matmuls=True)
    # What a factorization or solve reads stays out of the compute dtype back
    # to the matmuls (those next to the solve were kept by _painted).
    _keep_slice(ctx, draft, jaxpr, _solve_operands(jaxpr), Why.FEEDS_SOLVE)
    seeds = decision_seeds(ctx, jaxpr, hints.decides)
    _keep_slice(ctx, draft, jaxpr, seeds, Why.DECIDES_CONTROL)
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name in ("while", "scan"):
            for where, body in _loop_reads(ctx, eqn).bodies:
                draft.hint(i, where, body)
    # A loop-carried float keeps its dtype through the ops that compute the
    # next carry (an EMA, an Euler step, a residual stream): rounding it in
    # every iteration compounds. The matmuls on the way still read
    # compute-dtype operands but write float32, as for decisions.
    outs = jaxpr.outvars
    carried = [outs[k] for k in hints.carries if is_managed_float(casting.dtype_of(outs[k]))]
    for i, k in _keep_slice(ctx, draft, jaxpr, carried, Why.LOOP_CARRY):
        for where in _carry_bodies(jaxpr.eqns[i]):  # a cond's branches compute the carry too
            draft.hint(i, where, BodyHints(carries=frozenset({k})))
    return draft


def decision_seeds(ctx: Context, jaxpr: compat.Jaxpr, decide_outs: Iterable[int]) -> list[Any]:
    """The vars of ``jaxpr`` whose values decide control flow: the outputs at
    ``decide_outs`` (a while predicate, or a loop body's carry that feeds one),
    every ``cond`` index, and the operands of each loop that its decisions
    read (the initial carry and consts: `_loop_reads`)."""
    seeds = [jaxpr.outvars[k] for k in decide_outs]
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            seeds.append(eqn.invars[0])
        elif eqn.primitive.name in ("while", "scan"):
            seeds.extend(eqn.invars[k] for k in _loop_reads(ctx, eqn).operands)
    return seeds


def decision_slice(
    jaxpr: compat.Jaxpr,
    kinds: Sequence[Kind],
    classes: Sequence[OpClass | None],
    colors: Sequence[Color],
    seeds: Iterable[Any],
    stops: list[tuple[int, int]] | None = None,
    keep_matmuls: bool = False,
) -> tuple[set[int], set[int], set[int]]:
    """What the values ``seeds`` are computed from, back to the matmuls.

    Returns ``(kept, f32_out, reached)``: the eqns on the way (to be computed
    in their original precision), the low ``allow`` eqns where the slice stops
    (their operands stay low -- that is where the speed is -- but they write
    float32), and the positions of ``jaxpr.invars`` reached. The slice also
    stops at higher-order eqns (whose outputs keep their original dtype);
    ``stops``, if given, collects ``(eqn index, output position)`` of each.

    With ``keep_matmuls`` the low ``allow`` eqns are kept whole too (operands
    included) and the slice goes on through their operands: what a
    convergence test reads must not carry the compute dtype's rounding.
    """
    todo = collections.deque(v for v in seeds if not isinstance(v, compat.Literal))
    if not todo:  # (most jaxprs decide nothing: no def-use map of a whole program for that)
        return set(), set(), set()
    producer, _ = jaxprs.def_use(jaxpr)
    position = {v: k for k, v in enumerate(jaxpr.invars)}
    kept: set[int] = set()
    f32_out: set[int] = set()
    reached: set[int] = set()
    seen: set[Any] = set()
    while todo:
        v = todo.popleft()
        if v in seen:
            continue
        seen.add(v)
        if v in position:
            reached.add(position[v])
        i = producer.get(v)
        if i is None:
            continue
        if colors[i] is Color.LOW and classes[i] is OpClass.ALLOW and not keep_matmuls:
            f32_out.add(i)
        elif kinds[i] is Kind.NESTED:
            if stops is not None:
                stops.append((i, jaxpr.eqns[i].outvars.index(v)))
        elif kinds[i] is not Kind.AS_WRITTEN and i not in kept:
            kept.add(i)
            todo.extend(a for a in jaxpr.eqns[i].invars if not isinstance(a, compat.Literal))
    return kept, f32_out, reached


def _keep_slice(
    ctx: Context,
    draft: Draft,
    jaxpr: compat.Jaxpr,
    seeds: list[Any],
    why: Why,
    keep_matmuls: bool = False,
) -> list[tuple[int, int]]:
    """Keeps what ``seeds`` are computed from out of the compute dtype (back
    to the matmuls, which write float32, or with ``keep_matmuls`` through
    them, kept whole), recording ``why`` as the reason.
    Returns the (eqn index, output position) of the higher-order eqns reached."""
    stops: list[tuple[int, int]] = []
    kept, f32_out, _ = decision_slice(
        jaxpr, draft.kinds, draft.classes, draft.colors, seeds, stops, keep_matmuls
    )
    for i in kept:
        if draft.colors[i] is Color.LOW:
            draft.colors[i] = Color.ORIG
            _keep(draft, i, why)
        elif backend_kept(draft.classified[i]):  # (``why`` holds on every backend)
            _keep(draft, i, why)
    for i in f32_out:  # (its operands stay low: the reason says both)
        draft.f32_out.add(i)
        _keep(draft, i, why, low_text(ctx, jaxpr.eqns[i]))
    return stops


def _keep(draft: Draft, i: int, why: Why, text: str | None = None) -> None:
    """Records ``why`` for eqn ``i`` unless it was kept for a reason already;
    ``text``: it reads compute-dtype operands for that reason, and writes float32."""
    c = draft.classified[i]
    if i not in draft.kept and not (c.reason is not None and c.reason.keeps_high):
        draft.kept[i] = Reason.kept(why) if text is None else Reason.low_f32_result(why, text)


def _carry_bodies(eqn: compat.Eqn) -> list[str]:
    """The params of ``eqn`` holding the closed sub-jaxprs whose outputs are
    ``eqn``'s outputs (``cond`` branches, a ``jit``'s body); none for loops and
    custom rules."""
    if eqn.primitive.name == "cond":
        return [f"branches[{j}]" for j in range(len(eqn.params["branches"]))]
    if eqn.primitive.name in compat.JIT_NAMES and compat.is_closed_jaxpr(eqn.params["jaxpr"]):
        return ["jaxpr"]
    return []


def _reached_inputs(
    ctx: Context, closed: compat.ClosedJaxpr, outs: Iterable[int], exit: bool
) -> set[int]:
    """Input positions of ``closed`` that its decisions (and outputs ``outs``)
    read; ``exit``: ``outs`` decide when a while loop stops, and reach through
    the matmuls too."""
    jaxpr = compat.jaxpr_of(ctx.prepare(closed))
    classified, colors = painted(ctx, jaxpr)
    kinds = [c.kind for c in classified]
    classes = [c.op_class for c in classified]
    reached = set()
    if exit:
        exits = [jaxpr.outvars[k] for k in outs]
        reached = decision_slice(jaxpr, kinds, classes, colors, exits, None, True)[2]
    seeds = decision_seeds(ctx, jaxpr, outs)
    return reached | decision_slice(jaxpr, kinds, classes, colors, seeds)[2]


def _solve_operands(jaxpr: compat.Jaxpr) -> list[Any]:
    """The operands of ``jaxpr``'s factorizations and solves (`SOLVES`)."""
    return [
        v
        for e in jaxpr.eqns
        if e.primitive.name in SOLVES
        for v in e.invars
        if not isinstance(v, compat.Literal) and is_managed_float(casting.dtype_of(v))
    ]


@dataclasses.dataclass(frozen=True)
class LoopReads:
    """What decides a ``while``/``scan`` eqn's control flow, through its carry.

    Attributes:
      operands: the eqn's operand positions whose values decide it.
      bodies: ``(param, hints)`` of its sub-jaxprs: the outputs of the body
        (and of a while's predicate) that decide it, and those the body carries.
    """

    operands: tuple[int, ...]
    bodies: tuple[tuple[str, BodyHints], ...]


def _loop_reads(ctx: Context, eqn: compat.Eqn) -> LoopReads:
    """What decides the control flow of ``while``/``scan`` eqn ``eqn`` (once per eqn)."""

    def make() -> LoopReads:
        p = eqn.params
        is_while = eqn.primitive.name == "while"
        if is_while:
            cn, bn = compat.while_split(p)
            body, n_body_consts, where = p["body_jaxpr"], bn, "body_jaxpr"
            first = _reached_inputs(ctx, p["cond_jaxpr"], [0], exit=True)
            carry = {k - cn for k in first if k >= cn}
            reads = [k for k in first if k < cn]
            carry_at = cn + bn  # carry operands follow the cond and body consts
            n_carry = len(eqn.outvars)
        else:  # scan: consts, carry, xs
            n_consts, n_carry = compat.scan_split(p)
            body, n_body_consts, where, reads = p["jaxpr"], n_consts, "jaxpr", []
            carry, carry_at = set(), n_consts
        body_reads: set[int] = set()
        while True:  # loop-carried: a carry read by a decision is one too
            body_reads = _reached_inputs(ctx, body, sorted(carry), exit=is_while)
            new = carry | {k - n_body_consts for k in body_reads if k >= n_body_consts}
            if not is_while:
                new = {k for k in new if k < n_carry}
            if new == carry:
                break
            carry = new
        decides = frozenset(carry)
        bodies = [
            (
                where,
                BodyHints(decides, decides if is_while else frozenset(), frozenset(range(n_carry))),
            )
        ]
        if is_while:
            bodies.insert(0, ("cond_jaxpr", BodyHints(frozenset({0}), frozenset({0}))))
        consts = [k for k in body_reads if k < n_body_consts]
        if is_while:
            consts = [cn + k for k in consts]
        operands = tuple(sorted({*reads, *consts, *(carry_at + k for k in carry)}))
        return LoopReads(operands, tuple(bodies))

    return ctx.cached("loop_reads", eqn, make)


__all__ = ("Draft", "LoopReads", "decision_seeds", "decision_slice", "make_draft")
