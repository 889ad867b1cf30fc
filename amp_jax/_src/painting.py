"""Painting: which eqns of a jaxpr run low, high or as written. Pure functions
of a jaxpr's graph and the classes of its eqns (no tracing, no policy).

``paint`` follows TensorFlow's auto-mixed-precision passes: allow ops are low;
deny ops are high; deny propagates forward through follow ops (and through
clear ops that lead to one); follow/clear ops on a path between two allow ops
are low (follow ops only where the backend computes elementwise ops in the
compute dtype: ``low_follow``; `follows_between` names those it kept); clear
ops next to a low op are low. ``matmuls_around`` finds the matmuls next to
given eqns (a solve's). Planning calls them from ``painted.py``; what decides
control flow, and the loop fixed point, are ``control.py``'s
(`control.decision_slice`).
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Iterable, Sequence

from amp_jax._src import compat, jaxprs
from amp_jax._src.decision import Color, OpClass
from amp_jax._src.policy import is_managed_float

LOW, HIGH, ORIG = Color.LOW, Color.HIGH, Color.ORIG


def _graph(jaxpr: compat.Jaxpr) -> tuple[list[list[int]], list[list[int]]]:
    """Producer/consumer eqn indices over managed-float vars."""
    producer, _ = jaxprs.def_use(jaxpr)
    preds: list[list[int]] = [[] for _ in jaxpr.eqns]
    succs: list[list[int]] = [[] for _ in jaxpr.eqns]
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            # (a token has no dtype)
            if isinstance(v, compat.Literal) or not is_managed_float(
                getattr(v.aval, "dtype", None)
            ):
                continue
            j = producer.get(v)
            if j is not None:
                preds[i].append(j)
                succs[j].append(i)
    return preds, succs


def _reach(starts: Sequence[int], edges: list[list[int]], allowed: set[int]) -> set[int]:
    """Nodes in ``allowed`` reachable from ``starts`` through ``allowed`` nodes."""
    seen: set[int] = set()
    todo = collections.deque(starts)
    while todo:
        i = todo.popleft()
        for j in edges[i]:
            if j in allowed and j not in seen:
                seen.add(j)
                todo.append(j)
    return seen


def _classes(classes: Sequence[OpClass | None]) -> dict[OpClass, set[int]]:
    return {
        c: {i for i, k in enumerate(classes) if k is c}
        for c in (OpClass.ALLOW, OpClass.DENY, OpClass.FOLLOW, OpClass.CLEAR)
    }


def _denied(
    idx: dict[OpClass, set[int]], preds: list[list[int]], succs: list[list[int]]
) -> set[int]:
    """Step 1: deny propagates forward through follow ops, and through clear
    ops only where a follow op is further downstream."""
    deny, follow, clear = idx[OpClass.DENY], idx[OpClass.FOLLOW], idx[OpClass.CLEAR]
    fwd = _reach(sorted(deny), succs, follow | clear)
    deny_follow = fwd & follow
    back_from_follow = _reach(sorted(deny_follow), preds, clear)
    return deny | deny_follow | (fwd & clear & back_from_follow)


def _between(
    idx: dict[OpClass, set[int]], free: set[int], preds: list[list[int]], succs: list[list[int]]
) -> set[int]:
    """The ``free`` eqns on a path between two allow ops through ``free`` eqns."""
    allow = sorted(idx[OpClass.ALLOW])
    return _reach(allow, succs, free) & _reach(allow, preds, free)


def follows_between(classes: Sequence[OpClass | None], jaxpr: compat.Jaxpr) -> set[int]:
    """The follow eqns that step 2 of `paint` makes low with ``low_follow``:
    not denied, on a path between two allow ops through follow/clear ops."""
    preds, succs = _graph(jaxpr)
    idx = _classes(classes)
    free = (idx[OpClass.FOLLOW] | idx[OpClass.CLEAR]) - _denied(idx, preds, succs)
    return _between(idx, free, preds, succs) & idx[OpClass.FOLLOW]


def paint(
    classes: Sequence[OpClass | None],
    jaxpr: compat.Jaxpr,
    *,
    low_follow: bool = True,
    high_clear: Collection[str] = (),
) -> list[Color]:
    """Colors for each eqn, from their classes (None: not painted, as written).

    ``low_follow=False``: follow ops are never painted low (a backend that
    computes low-precision elementwise ops in float32, converting each way:
    XLA:CPU); they keep their original dtypes, and the clear ops next to a
    low op carry the one cast to it. ``high_clear``: the clear primitives
    such a backend computes in float32 too (XLA:CPU's concatenate, gather,
    select_n, ...): never painted low, so that the one cast is made after
    them, not on each of their inputs and back.
    """
    preds, succs = _graph(jaxpr)
    idx = _classes(classes)
    allow, deny = idx[OpClass.ALLOW], idx[OpClass.DENY]
    clear = {i for i in idx[OpClass.CLEAR] if jaxpr.eqns[i].primitive.name not in high_clear}
    # 1. deny propagates forward (`_denied`).
    denied = _denied(idx, preds, succs)
    # 2. follow/clear ops on a path between two allow ops become low.
    free = ((idx[OpClass.FOLLOW] if low_follow else set()) | clear) - denied
    low = allow | _between(idx, free, preds, succs)
    # 3. clear ops connected to a low op through clear ops become low.
    #    Downwards only from ops with low outputs: an allow op accumulates and
    #    returns float32, so a reshape or max of its result stays float32 (a
    #    cast there would only be undone further down).
    free_clear = clear - denied - low
    # Upwards, stop at broadcasts: a parameter broadcast into a low op is cast
    # after the broadcast, so its gradient is reduced in float32, not bf16.
    no_bcast = {i for i in free_clear if jaxpr.eqns[i].primitive.name != "broadcast_in_dim"}
    low |= _reach(sorted(low - allow), succs, free_clear)
    #    Upwards only where every consumer is low too: a transpose feeding a
    #    dot *and* a log stays float32 (the log would get a rounded input).
    up = _reach(sorted(low), preds, no_bcast)
    outs = {v for v in jaxpr.outvars if not isinstance(v, compat.Literal)}
    while True:
        ok = low | up
        drop = {
            i
            for i in up
            if any(j not in ok for j in succs[i]) or any(v in outs for v in jaxpr.eqns[i].outvars)
        }
        if not drop:
            break
        up -= drop
    low |= up
    return [LOW if i in low else HIGH if i in deny else ORIG for i in range(len(classes))]


def matmuls_around(
    jaxpr: compat.Jaxpr, classes: Sequence[OpClass | None], starts: Iterable[int]
) -> set[int]:
    """The ``allow`` eqns nearest to eqns ``starts`` through other ops, both
    ways: those whose results reach them, and those that read their results."""
    starts = list(starts)
    if not starts:
        return set()
    preds, succs = _graph(jaxpr)
    through = {
        i
        for i, c in enumerate(classes)
        if c in (OpClass.FOLLOW, OpClass.CLEAR, OpClass.DENY, OpClass.NEVER)
    }
    found: set[int] = set()
    for edges in (preds, succs):
        todo = collections.deque(starts)
        seen = set(todo)
        while todo:
            i = todo.popleft()
            for j in edges[i]:
                if j in seen:
                    continue
                seen.add(j)
                if classes[j] is OpClass.ALLOW:
                    found.add(j)
                elif j in through:
                    todo.append(j)
    return found
