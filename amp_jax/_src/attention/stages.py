"""The stages of recognising one attention, from its softmax outwards.

Each stage reads the `Graph` and returns a record for the next, or raises
`NoMatch` (through `Near.need`): the softmax (`softmax_at`), how the
probabilities reach the values matmul (`values_use`, `check_softmax_alone`),
the ops back to the scores matmul (`walk_scores`: scale, mask, bias,
transpose), the operands' layouts (`scores_layout`, `values_layout`,
`order`), k and v before a ``jnp.repeat`` (`unrepeated_kv`) and the mask and
bias (`masks`). ``recognise.py`` runs them in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

from amp_jax._src import compat
from amp_jax._src.attention.graph import (
    FILL_MAX,
    NOT_YET,
    Graph,
    Near,
    NoMatch,
    ancestors,
    is_causal_constant,
    is_float_cast,
    literal_scalar,
    mask_depends_on_values,
    mask_of_bias,
    trace_source,
    unrepeat,
)

_RANDOM = frozenset({"random_bits", "random_seed", "random_wrap", "threefry2x32", "rng_uniform"})
_BETWEEN = frozenset({"mul", "div", "select_n", "convert_element_type"})


@dataclasses.dataclass(frozen=True)
class _Softmax:
    """``exp(S - max(S)) / sum(...)`` over the last axis of the scores ``S``."""

    s_var: Any
    max_src: Any  # S, or what S transposes (the max taken before the transpose)
    chain: tuple[int, ...]  # sub, [stop_gradient], broadcast, [transpose], [max], reduce_max
    i_exp: int
    i_rs: int
    bs: int
    i_div: int
    e_var: Any
    p_var: Any
    axis_ok: bool

    @property
    def eqns(self) -> frozenset[int]:
        return frozenset((*self.chain, self.i_exp, self.i_rs, self.bs, self.i_div))


def softmax_at(g: Graph, i_exp: int) -> _Softmax:
    eqns, need = g.eqns, NOT_YET.need
    e_exp = eqns[i_exp]
    i_sub = g.prod(e_exp.invars[0], "sub")
    s_var, mb = eqns[i_sub].invars
    # the max: [stop_gradient] <- broadcast_in_dim <- [max(-inf, .)] <- reduce_max(S)
    chain = [i_sub]
    j = g.prod(mb)
    if eqns[j].primitive.name == "stop_gradient":
        chain.append(j)
        j = g.prod(eqns[j].invars[0])
    need(eqns[j].primitive.name == "broadcast_in_dim")
    chain.append(j)
    j = g.prod(eqns[j].invars[0])
    max_perm = None
    if eqns[j].primitive.name == "transpose":  # the max taken before S's transpose
        max_perm = tuple(eqns[j].params["permutation"])
        chain.append(j)
        j = g.prod(eqns[j].invars[0])
    if eqns[j].primitive.name == "max":
        chain.append(j)
        a, b = eqns[j].invars
        j = g.prod(a if isinstance(b, compat.Literal) else b)
    need(eqns[j].primitive.name == "reduce_max")
    chain.append(j)
    nd = len(s_var.aval.shape)
    max_src, axes = eqns[j].invars[0], tuple(eqns[j].params["axes"])
    if max_src is s_var:
        axis_ok = max_perm is None and axes == (nd - 1,)
    else:  # S = transpose(max_src, perm) and the max is over S's last axis
        t = g.prod(s_var, "transpose")
        perm_s = tuple(eqns[t].params["permutation"])
        need(eqns[t].invars[0] is max_src)
        axis_ok = axes == (perm_s[-1],)
    # exp -> reduce_sum -> broadcast -> div(exp, .)
    e_var = e_exp.outvars[0]
    uses = g.users(e_var)
    need(len(uses) == 2)
    i_rs = next((u for u in uses if eqns[u].primitive.name == "reduce_sum"), None)
    i_div = next((u for u in uses if eqns[u].primitive.name == "div"), None)
    need(i_rs is not None and i_div is not None)
    axis_ok = axis_ok and tuple(eqns[i_rs].params["axes"]) == (nd - 1,)
    sum_users = g.users(eqns[i_rs].outvars[0])
    need(len(sum_users) == 1 and eqns[sum_users[0]].primitive.name == "broadcast_in_dim")
    (bs,) = sum_users
    need(eqns[i_div].invars[0] is e_var and eqns[i_div].invars[1] is eqns[bs].outvars[0])
    i_rs, i_div = cast(int, i_rs), cast(int, i_div)  # (need: both found)
    return _Softmax(
        s_var, max_src, tuple(chain), i_exp, i_rs, bs, i_div, e_var, eqns[i_div].outvars[0], axis_ok
    )


@dataclasses.dataclass(frozen=True)
class _ValuesUse:
    """How the probabilities reach the values matmul."""

    i_d2: int
    between: tuple[int, ...]  # elementwise ops between P and the matmul (dropout)
    casts: tuple[int, ...]  # float casts of P (part of the attention)
    p_var: Any  # what the values matmul reads
    p_elsewhere: bool  # P is also read by something else


def values_use(g: Graph, sm: _Softmax) -> _ValuesUse:
    """P -> [elementwise ops, e.g. dropout] -> dot_general with the values."""
    eqns = g.eqns
    cur, between, i_d2, p_elsewhere = sm.p_var, [], None, False
    for _ in range(6):
        uses = g.users(cur)
        dots = [u for u in uses if eqns[u].primitive.name == "dot_general"]
        if len(dots) == 1 and (len(uses) > 1 or cur in g.outs):
            i_d2, p_elsewhere = dots[0], True
            break
        if len(uses) != 1 or cur in g.outs:
            break
        name = eqns[uses[0]].primitive.name
        if name == "dot_general":
            i_d2 = uses[0]
            break
        if name not in _BETWEEN:
            break
        between.append(uses[0])
        cur = eqns[uses[0]].outvars[0]
    NOT_YET.need(i_d2 is not None)
    i_d2 = cast(int, i_d2)  # (need: found)
    if all(is_float_cast(eqns[k]) for k in between):
        # P cast to another float dtype (softmax in float32, then the compute dtype,
        # as Flax and hand-written bf16 code do): the fused attention computes P in
        # its own dtype, so the casts are part of it
        return _ValuesUse(i_d2, (), tuple(between), cur, p_elsewhere)
    return _ValuesUse(i_d2, tuple(between), (), sm.p_var, p_elsewhere)


def check_softmax_alone(g: Graph, sm: _Softmax, vu: _ValuesUse, near: Near) -> None:
    """Near misses: the softmax is not the attention's alone, or not over the keys."""
    eqns = g.eqns
    near.need(sm.axis_ok, "softmax not over the key axis")
    if vu.between:
        cur = eqns[vu.between[-1]].outvars[0]
        sides = [v for k in vu.between for v in eqns[k].invars if v is not cur]
        rand = any(
            g.producer.get(a) is not None and eqns[g.producer[a]].primitive.name in _RANDOM
            for a in ancestors(sides, eqns, g.producer)
        )
        ops = ", ".join(eqns[k].primitive.name for k in vu.between)
        near.need(
            False, "dropout on the probabilities" if rand else f"{ops} between softmax and P.V"
        )
    near.need(not vu.p_elsewhere, "the probabilities are also used outside the attention")
    skip = set(sm.eqns) | set(vu.casts)
    chain = sm.chain
    for k in chain[1:-1]:
        g.only_used_by(eqns[k].outvars[0], set(chain) | skip, near, "softmax max used elsewhere")
    g.only_used_by(eqns[chain[-1]].outvars[0], set(chain), near, "softmax max used elsewhere")
    g.only_used_by(sm.e_var, {sm.i_rs, sm.i_div}, near, "softmax exp used elsewhere")
    g.only_used_by(eqns[sm.i_rs].outvars[0], {sm.bs}, near, "softmax sum used elsewhere")
    g.only_used_by(eqns[sm.bs].outvars[0], {sm.i_div}, near, "softmax sum used elsewhere")


@dataclasses.dataclass(frozen=True)
class _Scores:
    """What lies between the scores matmul and the softmax: at most one mask
    (``select_n``), additive bias (``add``), scale and transpose."""

    d1: int = -1  # the scores matmul
    scale: float | None = None
    pred: Any = None  # the mask's predicate
    pred_pre: bool = False  # read before the transpose
    perm: tuple[int, ...] | None = None
    bias: Any = None
    bias_pre: bool = False
    bias_scale: float = 1.0  # the scale applied after the bias (folded into it)
    skip: frozenset[int] = frozenset()


def walk_scores(g: Graph, sm: _Softmax, near: Near) -> _Scores:
    """Walks back from the softmax's input to the scores matmul."""
    s_users = {sm.chain[0]} | ({sm.chain[-1]} if sm.max_src is sm.s_var else set())
    st = _walk_score(g, sm, near, sm.s_var, s_users, _Scores())
    return dataclasses.replace(st, scale=1.0 if st.scale is None else st.scale)


def _walk_score(
    g: Graph, sm: _Softmax, near: Near, cur: compat.Atom, users: set[int], st: _Scores
) -> _Scores:
    shared = "the scores are also used outside the attention"
    g.only_used_by(cur, users | ({sm.chain[-1]} if cur is sm.max_src else set()), near, shared)
    j = g.prod(cur, near=near, reason="the scores are not computed by a matmul")
    e = g.eqns[j]
    name = e.primitive.name
    st = dataclasses.replace(st, skip=st.skip | {j})
    if name == "select_n" and st.pred is None and len(e.invars) == 3:
        p_atom, on_false, on_true = e.invars
        fill, fusers, skip = on_false, {j}, set(st.skip)
        while True:  # a scalar literal broadcast (possibly twice) to S's shape
            fj = g.prod(fill, "broadcast_in_dim", near, "a mask whose fill is not a constant")
            g.only_used_by(fill, fusers, near, "mask fill used elsewhere")
            skip.add(fj)
            fill, fusers = g.eqns[fj].invars[0], {fj}
            fv = literal_scalar(fill)
            if fv is not None:
                break
        near.need(fv <= FILL_MAX, f"mask fill {fv:g} is above {FILL_MAX:g}: a soft mask")
        st = dataclasses.replace(
            st, pred=p_atom, pred_pre=st.perm is not None, skip=frozenset(skip)
        )
        return _walk_score(g, sm, near, on_true, {j}, st)
    if name in ("mul", "div") and st.scale is None:
        a, b = e.invars
        c = literal_scalar(b)
        if c is None and name == "mul":
            c, a = literal_scalar(a), b
        near.need(c is not None and c != 0.0, f"{name} by a non-constant between QK and softmax")
        c = cast(float, c)  # (need: a constant)
        st = dataclasses.replace(st, scale=c if name == "mul" else 1.0 / c)
        return _walk_score(g, sm, near, a, {j}, st)
    if name == "add" and any(literal_scalar(a) is not None for a in e.invars):
        # a constant added to every score: the softmax does not change
        a, b = e.invars
        return _walk_score(g, sm, near, b if literal_scalar(a) is not None else a, {j}, st)
    if name == "add" and st.bias is None:
        err = None
        for chain_op, other in (e.invars, e.invars[::-1]):
            if isinstance(chain_op, compat.Literal) or isinstance(other, compat.Literal):
                continue
            st2 = dataclasses.replace(
                st,
                bias=other,
                bias_pre=st.perm is not None,
                bias_scale=1.0 if st.scale is None else st.scale,
            )
            try:
                return _walk_score(g, sm, near, chain_op, {j}, st2)
            except NoMatch as x:
                err = err or x
        raise err or NoMatch()
    if name == "transpose" and st.perm is None:
        st = dataclasses.replace(st, perm=tuple(e.params["permutation"]))
        return _walk_score(g, sm, near, e.invars[0], {j}, st)
    if is_float_cast(e):  # scores cast to float32 for the softmax (hand-written bf16)
        return _walk_score(g, sm, near, e.invars[0], {j}, st)
    if name == "dot_general":
        return dataclasses.replace(st, d1=j, skip=st.skip - {j})
    near.need(False, f"{name} between the scores matmul and the softmax")
    raise AssertionError  # (need(False, ...) raises)


@dataclasses.dataclass(frozen=True)
class _ScoresLayout:
    """The roles of the scores matmul's operands and of the scores' dims."""

    q: Any
    k: Any
    cq: int  # contracting dim of q (and k: ck)
    ck: int
    bq: tuple[int, ...]  # batch dims of q (and k: bk)
    bk: tuple[int, ...]
    tq_dim: int
    g_dim: int | None
    tk_dim: int
    sizes: dict  # role -> size: Tq, Tk, H, [G], b0, b1
    s_named: tuple[str, ...]  # roles of S's dims
    pre_named: tuple[str, ...]  # roles of the matmul output's dims (before a transpose)

    @property
    def nb(self) -> int:
        return len(self.bq)


_LAYOUT = "scores matmul layout not recognised"
_LAYOUT2 = "values matmul layout not recognised"


def scores_layout(g: Graph, st: _Scores, near: Near) -> _ScoresLayout:
    d1 = g.eqns[st.d1]
    (ca, cb), (ba, bb) = d1.params["dimension_numbers"]
    near.need(len(ca) == 1 and len(cb) == 1 and len(ba) <= 2, _LAYOUT)
    A, B = d1.invars
    near.need(not isinstance(A, compat.Literal) and not isinstance(B, compat.Literal), _LAYOUT)
    nb = len(ba)
    a_free = [d for d in range(len(A.aval.shape)) if d not in ca and d not in ba]
    b_free = [d for d in range(len(B.aval.shape)) if d not in cb and d not in bb]
    out_roles = (
        [("b", i) for i in range(nb)] + [("A", d) for d in a_free] + [("B", d) for d in b_free]
    )
    s_roles = [out_roles[p] for p in st.perm] if st.perm is not None else out_roles
    key_role = s_roles[-1]
    near.need(key_role[0] in ("A", "B"), _LAYOUT)
    if key_role[0] == "B":
        Q, K, cq, ck, bq, bk, qf, kf, qtag = A, B, ca[0], cb[0], ba, bb, a_free, b_free, "A"
    else:
        Q, K, cq, ck, bq, bk, qf, kf, qtag = B, A, cb[0], ca[0], bb, ba, b_free, a_free, "B"
    qs, ks = Q.aval.shape, K.aval.shape
    q_big = [d for d in qf if qs[d] != 1]
    k_big = [d for d in kf if ks[d] != 1]
    near.need(len(q_big) in (1, 2) and k_big == [key_role[1]], _LAYOUT)
    # the query positions: the free q dim nearest the keys in S; another one is G
    in_s = [r[1] for r in s_roles if r[0] == qtag and r[1] in q_big]
    tq_dim = in_s[-1]
    g_dim = next((d for d in q_big if d != tq_dim), None)
    sizes = {"Tq": qs[tq_dim], "Tk": ks[k_big[0]], "H": qs[cq]}
    near.need(ks[ck] == sizes["H"], _LAYOUT)
    if g_dim is not None:
        sizes["G"] = qs[g_dim]
    for r in range(nb):
        sizes[f"b{r}"] = qs[bq[r]]

    def role_of(rr):
        if rr[0] == "b":
            return f"b{rr[1]}"
        if rr[0] == qtag:
            return "Tq" if rr[1] == tq_dim else "G" if rr[1] == g_dim else "u"
        return "Tk" if rr[1] == k_big[0] else "u"

    s_named = tuple(role_of(r) for r in s_roles)
    near.need(s_named[-1] == "Tk" and "Tq" in s_named, _LAYOUT)
    pre_named = tuple(role_of(r) for r in out_roles)
    return _ScoresLayout(
        Q, K, cq, ck, tuple(bq), tuple(bk), tq_dim, g_dim, k_big[0], sizes, s_named, pre_named
    )


@dataclasses.dataclass(frozen=True)
class _ValuesLayout:
    """The roles of the values matmul's operand ``v`` and of its output's dims."""

    v: Any
    cv: int  # v's contracting dim (the keys)
    v_batch: tuple[int | None, ...]  # v's dim of each batch role b0, b1
    hv_dim: int
    out_roles: tuple[str, ...]


def values_layout(g: Graph, sl: _ScoresLayout, vu: _ValuesUse, near: Near) -> _ValuesLayout:
    """The second matmul: P's key axis against v's."""
    d2, s_named, nb = g.eqns[vu.i_d2], sl.s_named, sl.nb
    (c2l, c2r), (b2l, b2r) = d2.params["dimension_numbers"]
    L, R = d2.invars
    near.need((L is vu.p_var) != (R is vu.p_var), _LAYOUT)
    p_left = L is vu.p_var
    V = R if p_left else L
    cp, cv = (c2l, c2r) if p_left else (c2r, c2l)
    bp, bv = (b2l, b2r) if p_left else (b2r, b2l)
    near.need(len(cp) == 1 and s_named[cp[0]] == "Tk" and len(bp) == nb, _LAYOUT2)
    near.need(sorted(s_named[d] for d in bp) == sorted(f"b{r}" for r in range(nb)), _LAYOUT2)
    vs = V.aval.shape
    v_free = [d for d in range(len(vs)) if d not in cv and d not in bv]
    v_big = [d for d in v_free if vs[d] != 1]
    near.need(len(v_big) == 1 and vs[cv[0]] == sl.sizes["Tk"], _LAYOUT2)
    p_free = [d for d in range(len(s_named)) if d not in cp and d not in bp]
    near.need(
        sorted(s_named[d] for d in p_free if s_named[d] != "u")
        == sorted(["Tq"] + (["G"] if sl.g_dim is not None else [])),
        _LAYOUT2,
    )
    batch_roles = [s_named[d] for d in bp]
    v_roles = ["Hv" if d == v_big[0] else "u" for d in v_free]
    p_roles = [s_named[d] for d in p_free]
    out_roles = batch_roles + (p_roles + v_roles if p_left else v_roles + p_roles)
    v_batch: list[int | None] = [None] * nb
    for j2, d in enumerate(bv):
        v_batch[int(s_named[bp[j2]][1])] = d
    return _ValuesLayout(V, cv[0], tuple(v_batch), v_big[0], tuple(out_roles))


def order(x_shape: Sequence[int], lead: list[int | None], near: Near) -> tuple[int, ...]:
    """An operand's dims in [b0, T, b1, (G), H] order, with its unit dims last."""
    lead_ = [d for d in lead if d is not None]
    rest = [d for d in range(len(x_shape)) if d not in lead_]
    near.need(all(x_shape[d] == 1 for d in rest), _LAYOUT)
    return tuple(lead_ + rest)


def at(dims: Sequence[Any], r: int) -> Any:
    return dims[r] if len(dims) > r else None


@dataclasses.dataclass(frozen=True)
class _KV:
    """k and v as the fused attention reads them (the kv heads of a ``jnp.repeat``)."""

    k: Any
    v: Any
    kvh: int | None  # kv heads, when fewer than the query heads
    skip: frozenset[int]  # the repeats only the attention reads


def unrepeated_kv(g: Graph, sl: _ScoresLayout, vl: _ValuesLayout, st: _Scores, vu) -> _KV:
    """k and v repeated along the heads (jnp.repeat): read the kv heads as they are."""
    if not (sl.nb == 2 and sl.g_dim is None):
        return _KV(sl.k, vl.v, None, frozenset())
    rk = unrepeat(sl.k, sl.bk[1], g.eqns, g.producer)
    rv = unrepeat(vl.v, vl.v_batch[1], g.eqns, g.producer)
    if not (rk and rv and rk[1] == rv[1]):
        return _KV(sl.k, vl.v, None, frozenset())
    skip: set[int] = set()
    for (_, _, chain_), used_by in ((rk, st.d1), (rv, vu.i_d2)):
        users = {used_by}  # skip the repeat where only the attention reads it
        for idx in chain_:
            out = g.eqns[idx].outvars[0]
            if out in g.outs or not set(g.users(out)) <= users:
                break
            skip.add(idx)
            users = {idx}
    return _KV(rk[0], rv[0], sl.sizes["b1"] // rk[1], frozenset(skip))


@dataclasses.dataclass(frozen=True)
class _Masks:
    pred: Any = None
    pred_roles: tuple | None = None
    causal: bool = False
    bias: Any = None
    bias_roles: tuple | None = None


def masks(g: Graph, sl: _ScoresLayout, st: _Scores, qkv: tuple, near: Near) -> _Masks:
    """The mask (a broadcast of a source that depends on no float value) and the bias."""

    def roles_of(atom, pre):
        return trace_source(atom, sl.pre_named if pre else sl.s_named, g.eqns, g.producer)

    pred_atom = pred_roles = bias_atom = bias_roles = None
    if st.bias is not None:
        bias_atom, bias_roles = roles_of(st.bias, st.bias_pre)
        as_mask = mask_of_bias(bias_atom, g.eqns, g.producer)
        if st.pred is None and as_mask is not None:  # jnp.where(mask, 0, -1e9) added
            pred_atom, pred_roles = trace_source(as_mask, bias_roles, g.eqns, g.producer)
            bias_atom = bias_roles = None
    if st.pred is not None:
        pred_atom, pred_roles = roles_of(st.pred, st.pred_pre)
    causal = False
    if pred_atom is not None:
        near.need(
            not mask_depends_on_values(pred_atom, qkv, g.eqns, g.producer),
            "mask computed from the values q, k and v come from",
        )
        causal = is_causal_constant(pred_atom, pred_roles, g.eqns, g.producer, g.consts, g.jaxpr)
    return _Masks(pred_atom, pred_roles, causal, bias_atom, bias_roles)
