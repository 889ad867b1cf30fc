"""Painting: which eqns of a jaxpr run low, high or as written. Pure functions
of a jaxpr's graph and the classes of its eqns (no tracing, no policy).

``paint`` follows TensorFlow's auto-mixed-precision passes: allow ops are low;
deny ops are high; deny propagates forward through follow ops (and through
clear ops that lead to one); follow/clear ops on a path between two allow ops
are low; clear ops next to a low op are low. ``matmuls_around`` finds the
matmuls next to given eqns (a solve's). Planning calls them from
``painted.py``; what decides control flow, and the loop fixed point, are
``control.py``'s (`control.decision_slice`).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

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


def paint(classes: Sequence[OpClass | None], jaxpr: compat.Jaxpr) -> list[Color]:
    """Colors for each eqn, from their classes (None: not painted, as written)."""
    preds, succs = _graph(jaxpr)
    idx = {
        c: {i for i, k in enumerate(classes) if k is c}
        for c in (OpClass.ALLOW, OpClass.DENY, OpClass.FOLLOW, OpClass.CLEAR)
    }
    allow, deny = idx[OpClass.ALLOW], idx[OpClass.DENY]
    follow, clear = idx[OpClass.FOLLOW], idx[OpClass.CLEAR]
    # 1. deny propagates forward through follow ops, and through clear ops
    #    only where a follow op is further downstream.
    fwd = _reach(sorted(deny), succs, follow | clear)
    deny_follow = fwd & follow
    back_from_follow = _reach(sorted(deny_follow), preds, clear)
    denied = deny | deny_follow | (fwd & clear & back_from_follow)
    # 2. follow/clear ops on a path between two allow ops become low.
    free = (follow | clear) - denied
    down = _reach(sorted(allow), succs, free)
    up = _reach(sorted(allow), preds, free)
    low = allow | (down & up)
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
