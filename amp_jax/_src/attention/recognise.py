"""Recognition: the attentions of one jaxpr (`find`), each found in stages.

`find` tries every ``exp`` of the jaxpr as the softmax of an attention and
runs the stages of ``stages.py`` from it (`_match_at`), keeping the matches
that do not overlap and, if asked, the near misses with their reasons.
"""

from __future__ import annotations

from typing import Any, cast

from amp_jax._src import compat, jaxprs
from amp_jax._src.attention import stages
from amp_jax._src.attention.graph import Graph, Near, NoMatch
from amp_jax._src.attention.match import Match, NearMiss


def find(
    jaxpr: compat.Jaxpr, consts: dict[compat.Var, Any], near: list[NearMiss] | None = None
) -> dict[int, Match]:
    """Recognised attentions of ``jaxpr``, keyed by the index of their second matmul.

    ``consts`` maps constvars to their (concrete) values, to recognise a
    constant causal mask. Near misses (a softmax between two matmuls that
    cannot be taken, with the reason) are appended to ``near`` if given.
    """
    producer, consumers = jaxprs.def_use(jaxpr)
    g = Graph(
        jaxpr,
        jaxpr.eqns,
        producer,
        consumers,
        frozenset(v for v in jaxpr.outvars if not isinstance(v, compat.Literal)),
        consts,
    )
    found: dict[int, Match] = {}
    taken: set[int] = set()
    for i, e in enumerate(g.eqns):
        if e.primitive.name != "exp":
            continue
        try:
            m = _match_at(g, i)
        except NoMatch as x:
            if near is not None and x.miss is not None:
                near.append(x.miss)
            continue
        if not (m.skip & taken):
            found[m.d2] = m
            taken |= m.skip
    return found


def _match_at(g: Graph, i_exp: int) -> Match:
    """The attention whose softmax has its ``exp`` at ``i_exp``, found in stages.

    Raises ``NoMatch()`` when it is not attention, ``NoMatch(near miss)``
    when the softmax and both matmuls are there but something else is not.
    """
    sm = stages.softmax_at(g, i_exp)
    vu = stages.values_use(g, sm)
    near = Near(sm.eqns | set(vu.between) | set(vu.casts) | {vu.i_d2}, g.eqns[vu.i_d2])
    stages.check_softmax_alone(g, sm, vu, near)
    st = stages.walk_scores(g, sm, near)
    near = Near(near.eqns | sm.eqns | set(vu.casts) | st.skip | {st.d1}, g.eqns[st.d1])
    sl = stages.scores_layout(g, st, near)
    vl = stages.values_layout(g, sl, vu, near)
    q_order = stages.order(
        sl.q.aval.shape,
        [stages.at(sl.bq, 0), sl.tq_dim, stages.at(sl.bq, 1), sl.g_dim, sl.cq],
        near,
    )
    k_order = stages.order(
        sl.k.aval.shape, [stages.at(sl.bk, 0), sl.tk_dim, stages.at(sl.bk, 1), sl.ck], near
    )
    v_order = stages.order(
        vl.v.aval.shape,
        [stages.at(vl.v_batch, 0), vl.cv, stages.at(vl.v_batch, 1), vl.hv_dim],
        near,
    )
    kv = stages.unrepeated_kv(g, sl, vl, st, vu)
    sizes = {**sl.sizes, "Hv": vl.v.aval.shape[vl.hv_dim]}
    if kv.kvh is not None:
        sizes["kvh"] = kv.kvh
    masks = stages.masks(g, sl, st, (sl.q, kv.k, kv.v), near)
    skip = sm.eqns | set(vu.casts) | st.skip | {st.d1, vu.i_d2} | kv.skip
    return Match(
        d2=vu.i_d2,
        skip=frozenset(skip),
        q=sl.q,
        k=kv.k,
        v=kv.v,
        q_order=q_order,
        k_order=k_order,
        v_order=v_order,
        n_batch=sl.nb,
        sizes=sizes,
        out_roles=vl.out_roles,
        scale=float(cast(float, st.scale)),  # (_scores sets it)
        pred=masks.pred,
        pred_roles=masks.pred_roles,
        causal_const=masks.causal,
        head_dim=int(sizes["H"]),
        source=g.eqns[st.d1],
        bias=masks.bias,
        bias_roles=masks.bias_roles,
        bias_scale=float(st.bias_scale),
        eqns=frozenset(near.eqns | skip),
    )
