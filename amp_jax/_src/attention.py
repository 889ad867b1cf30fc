"""Attention written out in a jaxpr, recognised and run as fused attention.

Under ``amp`` a model is traced in float32, so attention written as
``einsum -> scale -> mask -> softmax -> einsum`` (or float32
``jax.nn.dot_product_attention``, which takes its XLA path) arrives as separate
primitives that materialise the ``[B, N, T, S]`` scores and probabilities.
Only amp knows the inputs will be bf16/f16, which cuDNN's fused flash attention
needs. `find` recognises the pattern in one jaxpr (stage by stage: the softmax,
its values matmul, the ops back to the scores matmul, the operands' layouts, the
mask and bias); `Match.evaluate` replaces it by one call of
``jax.nn.dot_product_attention`` on compute-dtype operands.

Recognised: a scores ``dot_general`` with 0-2 batch dims (grouped-query and
multi-query attention too, and k/v repeated with ``jnp.repeat``), then at most
one each of a scalar scale, an additive bias, a ``select_n`` mask whose fill is
``<= -1e4`` and whose predicate depends on no float value q, k and v come from
(a constant lower-triangular one becomes ``is_causal=True``) and a transpose,
then ``jax.nn.softmax`` over the keys and the values ``dot_general`` (v's head
dim may differ from q's: the smaller is zero-padded). The intermediate values
must have no other consumers. A softmax between two matmuls that cannot be
taken is a *near miss*, left as written with its reason. `plan_attention` decides per
attention (`decide`: policy, compute dtype, and the `Backend` record, which
holds cuDNN's limits and runs its probe) and names
the scope its ops run under (``amp_attention[cudnn]``,
``amp_attention[xla-fused]``, ``amp_attention[xla: <reason>]``), which
``dtype_report`` and ``explain`` read. docs/how-amp-works.md lists the patterns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from amp_jax._src import compat, jaxprs
from amp_jax._src.backends import AttentionImpl, Backend
from amp_jax._src.decision import AttentionPath

_FILL_MAX = -1e4  # a mask fill at or below this is "masked out"


@dataclasses.dataclass(frozen=True)
class Match:
    """One recognised attention: how to build it from the jaxpr's values.

    Roles name the dims: ``b0``/``b1`` the batch dims of the scores matmul
    (batch and heads; ``b1`` the kv heads when queries are grouped), ``Tq``/``Tk``
    query and key positions, ``G`` the query heads of one kv head (grouped-query
    attention written as a grouped einsum), ``H``/``Hv`` the head dims of q/k and
    of v, ``u`` a size-1 dim.
    """

    d2: int  # index of the second matmul (its output is the result)
    skip: frozenset[int]  # eqns replaced (not evaluated)
    q: Any
    k: Any
    v: Any
    q_order: tuple[int, ...]  # q dims in [b0, Tq, b1, G, H] order (present roles only)
    k_order: tuple[int, ...]  # k dims in [b0, Tk, b1, H] order
    v_order: tuple[int, ...]  # v dims in [b0, Tk, b1, Hv] order
    n_batch: int  # 0, 1 or 2 batch roles
    sizes: dict  # role -> size ("kvh": kv heads, fewer than b1 when k/v were repeated)
    out_roles: tuple  # roles of the second matmul's output dims ("u" for size 1)
    scale: float
    pred: Any  # boolean atom (S-shaped or a broadcast source), or None
    pred_roles: tuple | None  # roles of pred's dims
    causal_const: bool  # pred is a constant lower-triangular mask
    head_dim: int
    source: Any  # eqn (for its source info)
    bias: Any = None  # additive bias atom (S-shaped or a broadcast source), or None
    bias_roles: tuple | None = None
    bias_scale: float = 1.0  # the scale applied after the bias (folded into it)
    eqns: frozenset[int] = frozenset()  # every eqn of the pattern (for the named scope)

    @property
    def kind(self) -> str:
        """A short description: ``causal``/``mask``/``bias``, ``gqa``, ``mla``."""
        parts = []
        if self.causal_const:
            parts.append("causal")
        elif self.pred is not None:
            parts.append("mask")
        if self.bias is not None:
            parts.append("bias")
        heads = self.sizes.get("b1", 1) * self.sizes.get("G", 1)
        if self.sizes.get("kvh", self.sizes.get("b1", 1)) != heads:
            parts.append("gqa")
        if self.sizes["H"] != self.sizes["Hv"]:
            parts.append("mla")
        return "+".join(parts) or "plain"

    def evaluate(
        self,
        read: Callable[[compat.Atom, np.dtype | None], jax.Array],
        dtype: np.dtype,
        implementation: str,
    ) -> jax.Array:
        """The attention output, in ``dtype``, laid out as the second matmul's output."""
        s = self.sizes
        b0, b1, g = s.get("b0", 1), s.get("b1", 1), s.get("G", 1)
        kvh, h, hv = s.get("kvh", b1), s["H"], s["Hv"]

        def canon(atom: compat.Atom, order: Sequence[int], shape: tuple[int, ...]) -> jax.Array:
            x = read(atom, dtype)
            if tuple(order) != tuple(range(len(order))):
                x = lax.transpose(x, order)
            return x.reshape(shape)  # unit dims (last) dropped

        q = canon(self.q, self.q_order, (b0, s["Tq"], b1 * g, h))
        k = canon(self.k, self.k_order, (b0, s["Tk"], kvh, h))
        v = canon(self.v, self.v_order, (b0, s["Tk"], kvh, hv))
        # jax.nn.dot_product_attention needs one head dim: zero-pad the smaller
        # (zeros add nothing to q.k; zero columns of v give zero outputs, cut off)
        d = max(h, hv)
        pad = lambda x, n: x if n == d else jnp.pad(x, [(0, 0)] * 3 + [(0, d - n)])  # noqa: E731
        q, k, v = pad(q, h), pad(k, h), pad(v, hv)
        mask = bias = None
        if self.pred is not None and not self.causal_const:
            mask = self._bnts(read(self.pred, None), self.pred_roles)
        if self.bias is not None:
            bias = self._bnts(read(self.bias, None), self.bias_roles)
            if self.bias_scale != 1.0:
                bias = bias * jnp.asarray(self.bias_scale, bias.dtype)
            bias = bias.astype(dtype)
        out = jax.nn.dot_product_attention(
            q,
            k,
            v,
            bias=bias,
            mask=mask,
            scale=self.scale,
            is_causal=self.causal_const,
            implementation=cast(AttentionImpl, implementation),  # (decide's: xla or cudnn)
        )
        if hv != d:
            out = out[..., :hv]
        # [b0, Tq, b1 * G, Hv] -> the second matmul's layout
        five = ("b0", "Tq", "b1", "G", "Hv")
        out = out.reshape(b0, s["Tq"], b1, g, hv)
        target = [r for r in self.out_roles if r != "u"]
        perm = [five.index(r) for r in target] + [i for i, r in enumerate(five) if r not in target]
        if perm != list(range(5)):
            out = lax.transpose(out, perm)
        return out.reshape([1 if r == "u" else s[r] for r in self.out_roles])

    def _bnts(self, x, roles):
        """``x`` (dims labelled by ``roles``) as a [B, N, T, S]-broadcastable array."""
        roles = list(roles)
        want = ["b0", "b1", "G", "Tq", "Tk"]
        keep = [i for i, r in enumerate(roles) if r in want]
        if len(keep) != x.ndim:  # the other dims are units
            x = x.reshape([x.shape[i] for i in keep])
        kept = [roles[i] for i in keep]
        order = sorted(range(len(kept)), key=lambda i: want.index(kept[i]))
        if order != list(range(len(order))):
            x = lax.transpose(x, order)
        present = [kept[i] for i in order]
        x = x.reshape([x.shape[present.index(r)] if r in present else 1 for r in want])
        b1, g = self.sizes.get("b1", 1), self.sizes.get("G", 1)
        if g > 1 and x.shape[1] * x.shape[2] > 1:  # heads b1 x G, merged
            x = jnp.broadcast_to(x, (x.shape[0], b1, g, *x.shape[3:]))
        return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


@dataclasses.dataclass(frozen=True)
class NearMiss:
    """Almost an attention: softmax and both matmuls found, something else is not."""

    reason: str
    eqns: frozenset[int]  # the eqns recognised so far (for the named scope)
    source: Any  # eqn (for its source info)


# -- recognition -------------------------------------------------------------------


def _literal_scalar(atom: compat.Atom) -> float | None:
    if isinstance(atom, compat.Literal):
        val = np.asarray(compat.literal_value(atom))
        if val.ndim == 0:
            return float(val)
    return None


def find(
    jaxpr: compat.Jaxpr, consts: dict[compat.Var, Any], near: list[NearMiss] | None = None
) -> dict[int, Match]:
    """Recognised attentions of ``jaxpr``, keyed by the index of their second matmul.

    ``consts`` maps constvars to their (concrete) values, to recognise a
    constant causal mask. Near misses (a softmax between two matmuls that
    cannot be taken, with the reason) are appended to ``near`` if given.
    """
    producer, consumers = jaxprs.def_use(jaxpr)
    g = _Graph(
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
        except _NoMatch as x:
            if near is not None and x.miss is not None:
                near.append(x.miss)
            continue
        if not (m.skip & taken):
            found[m.d2] = m
            taken |= m.skip
    return found


class _NoMatch(Exception):
    """Not attention; with a `NearMiss` when the softmax and both matmuls are there."""

    def __init__(self, miss: NearMiss | None = None):
        super().__init__(miss.reason if miss is not None else "not attention")
        self.miss = miss


_RANDOM = frozenset({"random_bits", "random_seed", "random_wrap", "threefry2x32", "rng_uniform"})
_BETWEEN = frozenset({"mul", "div", "select_n", "convert_element_type"})


@dataclasses.dataclass(frozen=True)
class _Near:
    """Once the softmax and its values matmul are found: what a near miss names."""

    eqns: frozenset[int]
    source: Any  # eqn (for its source info)

    def need(self, cond: bool, reason: str | None = None) -> None:
        """A near miss with ``reason`` unless ``cond`` (no reason: not attention)."""
        if not cond:
            raise _NoMatch(NearMiss(reason, self.eqns, self.source) if reason else None)


#: before the softmax and its values matmul are found, a failed check is no near miss
_NOT_YET = _Near(frozenset(), None)


@dataclasses.dataclass(frozen=True)
class _Graph:
    """The jaxpr being matched, with its def-use maps."""

    jaxpr: Any
    eqns: Any
    producer: dict[Any, int]
    consumers: dict[Any, list[int]]
    outs: frozenset[Any]
    consts: dict[Any, Any]

    def prod(
        self,
        atom: compat.Atom,
        name: str | tuple[str, ...] | None = None,
        near: _Near = _NOT_YET,
        reason: str | None = None,
    ) -> int:
        """The index of the eqn that computes ``atom`` (of primitive ``name``, if given)."""
        near.need(not isinstance(atom, compat.Literal) and atom in self.producer, reason)
        j = self.producer[atom]
        names = name if isinstance(name, tuple) else (name,)
        near.need(name is None or self.eqns[j].primitive.name in names, reason)
        return j

    def users(self, var: compat.Atom) -> list[int]:
        return self.consumers.get(var, [])

    def only_used_by(self, var: compat.Atom, allowed: set[int], near: _Near, reason: str) -> None:
        near.need(var not in self.outs and set(self.users(var)) <= allowed, reason)


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


def _softmax_at(g: _Graph, i_exp: int) -> _Softmax:
    eqns, need = g.eqns, _NOT_YET.need
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


def _values_use(g: _Graph, sm: _Softmax) -> _ValuesUse:
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
    _NOT_YET.need(i_d2 is not None)
    i_d2 = cast(int, i_d2)  # (need: found)
    if all(_is_float_cast(eqns[k]) for k in between):
        # P cast to another float dtype (softmax in float32, then the compute dtype,
        # as Flax and hand-written bf16 code do): the fused attention computes P in
        # its own dtype, so the casts are part of it
        return _ValuesUse(i_d2, (), tuple(between), cur, p_elsewhere)
    return _ValuesUse(i_d2, tuple(between), (), sm.p_var, p_elsewhere)


def _check_softmax_alone(g: _Graph, sm: _Softmax, vu: _ValuesUse, near: _Near) -> None:
    """Near misses: the softmax is not the attention's alone, or not over the keys."""
    eqns = g.eqns
    near.need(sm.axis_ok, "softmax not over the key axis")
    if vu.between:
        cur = eqns[vu.between[-1]].outvars[0]
        sides = [v for k in vu.between for v in eqns[k].invars if v is not cur]
        rand = any(
            g.producer.get(a) is not None and eqns[g.producer[a]].primitive.name in _RANDOM
            for a in _ancestors(sides, eqns, g.producer)
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


def _walk_scores(g: _Graph, sm: _Softmax, near: _Near) -> _Scores:
    """Walks back from the softmax's input to the scores matmul."""
    s_users = {sm.chain[0]} | ({sm.chain[-1]} if sm.max_src is sm.s_var else set())
    st = _walk_score(g, sm, near, sm.s_var, s_users, _Scores())
    return dataclasses.replace(st, scale=1.0 if st.scale is None else st.scale)


def _walk_score(
    g: _Graph, sm: _Softmax, near: _Near, cur: compat.Atom, users: set[int], st: _Scores
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
            fv = _literal_scalar(fill)
            if fv is not None:
                break
        near.need(fv <= _FILL_MAX, f"mask fill {fv:g} is above {_FILL_MAX:g}: a soft mask")
        st = dataclasses.replace(
            st, pred=p_atom, pred_pre=st.perm is not None, skip=frozenset(skip)
        )
        return _walk_score(g, sm, near, on_true, {j}, st)
    if name in ("mul", "div") and st.scale is None:
        a, b = e.invars
        c = _literal_scalar(b)
        if c is None and name == "mul":
            c, a = _literal_scalar(a), b
        near.need(c is not None and c != 0.0, f"{name} by a non-constant between QK and softmax")
        c = cast(float, c)  # (need: a constant)
        st = dataclasses.replace(st, scale=c if name == "mul" else 1.0 / c)
        return _walk_score(g, sm, near, a, {j}, st)
    if name == "add" and any(_literal_scalar(a) is not None for a in e.invars):
        # a constant added to every score: the softmax does not change
        a, b = e.invars
        return _walk_score(g, sm, near, b if _literal_scalar(a) is not None else a, {j}, st)
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
            except _NoMatch as x:
                err = err or x
        raise err or _NoMatch()
    if name == "transpose" and st.perm is None:
        st = dataclasses.replace(st, perm=tuple(e.params["permutation"]))
        return _walk_score(g, sm, near, e.invars[0], {j}, st)
    if _is_float_cast(e):  # scores cast to float32 for the softmax (hand-written bf16)
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


def _scores_layout(g: _Graph, st: _Scores, near: _Near) -> _ScoresLayout:
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


def _values_layout(g: _Graph, sl: _ScoresLayout, vu: _ValuesUse, near: _Near) -> _ValuesLayout:
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


def _order(x_shape: Sequence[int], lead: list[int | None], near: _Near) -> tuple[int, ...]:
    """An operand's dims in [b0, T, b1, (G), H] order, with its unit dims last."""
    lead_ = [d for d in lead if d is not None]
    rest = [d for d in range(len(x_shape)) if d not in lead_]
    near.need(all(x_shape[d] == 1 for d in rest), _LAYOUT)
    return tuple(lead_ + rest)


def _at(dims: Sequence[Any], r: int) -> Any:
    return dims[r] if len(dims) > r else None


@dataclasses.dataclass(frozen=True)
class _KV:
    """k and v as the fused attention reads them (the kv heads of a ``jnp.repeat``)."""

    k: Any
    v: Any
    kvh: int | None  # kv heads, when fewer than the query heads
    skip: frozenset[int]  # the repeats only the attention reads


def _unrepeated_kv(g: _Graph, sl: _ScoresLayout, vl: _ValuesLayout, st: _Scores, vu) -> _KV:
    """k and v repeated along the heads (jnp.repeat): read the kv heads as they are."""
    if not (sl.nb == 2 and sl.g_dim is None):
        return _KV(sl.k, vl.v, None, frozenset())
    rk = _unrepeat(sl.k, sl.bk[1], g.eqns, g.producer)
    rv = _unrepeat(vl.v, vl.v_batch[1], g.eqns, g.producer)
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


def _masks(g: _Graph, sl: _ScoresLayout, st: _Scores, qkv: tuple, near: _Near) -> _Masks:
    """The mask (a broadcast of a source that depends on no float value) and the bias."""

    def roles_of(atom, pre):
        return _trace_source(atom, sl.pre_named if pre else sl.s_named, g.eqns, g.producer)

    pred_atom = pred_roles = bias_atom = bias_roles = None
    if st.bias is not None:
        bias_atom, bias_roles = roles_of(st.bias, st.bias_pre)
        as_mask = _mask_of_bias(bias_atom, g.eqns, g.producer)
        if st.pred is None and as_mask is not None:  # jnp.where(mask, 0, -1e9) added
            pred_atom, pred_roles = _trace_source(as_mask, bias_roles, g.eqns, g.producer)
            bias_atom = bias_roles = None
    if st.pred is not None:
        pred_atom, pred_roles = roles_of(st.pred, st.pred_pre)
    causal = False
    if pred_atom is not None:
        near.need(
            not _mask_depends_on_values(pred_atom, qkv, g.eqns, g.producer),
            "mask computed from the values q, k and v come from",
        )
        causal = _is_causal_constant(pred_atom, pred_roles, g.eqns, g.producer, g.consts, g.jaxpr)
    return _Masks(pred_atom, pred_roles, causal, bias_atom, bias_roles)


def _match_at(g: _Graph, i_exp: int) -> Match:
    """The attention whose softmax has its ``exp`` at ``i_exp``, found in stages.

    Raises ``_NoMatch()`` when it is not attention, ``_NoMatch(near miss)``
    when the softmax and both matmuls are there but something else is not.
    """
    sm = _softmax_at(g, i_exp)
    vu = _values_use(g, sm)
    near = _Near(sm.eqns | set(vu.between) | set(vu.casts) | {vu.i_d2}, g.eqns[vu.i_d2])
    _check_softmax_alone(g, sm, vu, near)
    st = _walk_scores(g, sm, near)
    near = _Near(near.eqns | sm.eqns | set(vu.casts) | st.skip | {st.d1}, g.eqns[st.d1])
    sl = _scores_layout(g, st, near)
    vl = _values_layout(g, sl, vu, near)
    q_order = _order(
        sl.q.aval.shape, [_at(sl.bq, 0), sl.tq_dim, _at(sl.bq, 1), sl.g_dim, sl.cq], near
    )
    k_order = _order(sl.k.aval.shape, [_at(sl.bk, 0), sl.tk_dim, _at(sl.bk, 1), sl.ck], near)
    v_order = _order(
        vl.v.aval.shape, [_at(vl.v_batch, 0), vl.cv, _at(vl.v_batch, 1), vl.hv_dim], near
    )
    kv = _unrepeated_kv(g, sl, vl, st, vu)
    sizes = {**sl.sizes, "Hv": vl.v.aval.shape[vl.hv_dim]}
    if kv.kvh is not None:
        sizes["kvh"] = kv.kvh
    masks = _masks(g, sl, st, (sl.q, kv.k, kv.v), near)
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


def _is_float_cast(e) -> bool:
    """A ``convert_element_type`` from one floating dtype to another."""
    return e.primitive.name == "convert_element_type" and all(
        jnp.issubdtype(v.aval.dtype, jnp.floating) for v in (e.invars[0], e.outvars[0])
    )


def _trace_source(atom, roles, eqns, producer):
    """``atom`` with dims labelled ``roles``, followed back through broadcasts and
    same-kind converts to its source: (source atom, roles of its dims, "u" for size 1)."""
    roles = list(roles)
    while not isinstance(atom, compat.Literal) and atom in producer:
        e = eqns[producer[atom]]
        src = e.invars[0] if e.invars else None
        if src is None or isinstance(src, compat.Literal):
            break
        if e.primitive.name == "broadcast_in_dim":
            dims = tuple(e.params["broadcast_dimensions"])
            roles = [roles[d] for d in dims]
        elif e.primitive.name == "convert_element_type" and (
            jnp.issubdtype(src.aval.dtype, jnp.floating)
            == jnp.issubdtype(atom.aval.dtype, jnp.floating)
        ):
            pass
        else:
            break
        atom = src
    shape = atom.aval.shape
    return atom, tuple("u" if shape[n] == 1 else r for n, r in enumerate(roles))


def _mask_of_bias(atom, eqns, producer):
    """The boolean mask of a bias ``jnp.where(mask, 0, fill)`` (fill <= -1e4), or None."""
    j = producer.get(atom)
    if j is None or eqns[j].primitive.name != "select_n" or len(eqns[j].invars) != 3:
        return None
    pred, on_false, on_true = eqns[j].invars

    def scalar(a):
        while not isinstance(a, compat.Literal):
            k = producer.get(a)
            if k is None or eqns[k].primitive.name not in (
                "broadcast_in_dim",
                "convert_element_type",
            ):
                return None
            a = eqns[k].invars[0]
        return _literal_scalar(a)

    f, t = scalar(on_false), scalar(on_true)
    if f is not None and t == 0.0 and f <= _FILL_MAX and pred.aval.dtype == np.bool_:
        return pred
    return None


def _unrepeat(x, axis, eqns, producer):
    """``(x_small, repeats, eqns)`` if ``x`` is ``jnp.repeat(x_small, repeats, axis)``
    (a ``broadcast_in_dim`` inserting the repeats after ``axis``, or two, as
    ``broadcast_to(x[:, :, None], ...)`` writes it, then a ``reshape``), else None."""
    j = producer.get(x)
    if axis is None or j is None or eqns[j].primitive.name != "reshape":
        return None
    n, chain = len(x.aval.shape), [j]
    b = small = eqns[j].invars[0]
    if len(b.aval.shape) != n + 1:
        return None
    dims = tuple(range(n + 1))  # where small's dims are in b
    while True:
        i = producer.get(small)
        if i is None or eqns[i].primitive.name != "broadcast_in_dim":
            return None
        chain.append(i)
        src = eqns[i].invars[0]
        if isinstance(src, compat.Literal):
            return None
        dims = tuple(dims[d] for d in eqns[i].params["broadcast_dimensions"])
        small = src
        if len(small.aval.shape) <= n:
            break
    xs, bs, ss = x.aval.shape, b.aval.shape, small.aval.shape
    if len(ss) != n or dims != tuple(d for d in range(n + 1) if d != axis + 1):
        return None
    rep = bs[axis + 1]
    want_b = (*ss[: axis + 1], rep, *ss[axis + 1 :])
    want_x = (*ss[:axis], ss[axis] * rep, *ss[axis + 1 :])
    if tuple(bs) != want_b or tuple(xs) != want_x or rep < 2:
        return None
    return small, rep, tuple(chain)


def _ancestors(atoms, eqns, producer) -> set:
    seen, todo = set(), list(atoms)
    while todo:
        a = todo.pop()
        if isinstance(a, compat.Literal) or a in seen:
            continue
        seen.add(a)
        j = producer.get(a)
        if j is not None:
            todo.extend(eqns[j].invars)
    return seen


def _mask_depends_on_values(pred, operands, eqns, producer) -> bool:
    """Whether ``pred`` is computed from a float value that q, k or v are also
    computed from (a mask derived from the activations, not a given mask).

    The mask's float ancestors are found first: a given mask has none, and
    then q, k and v are not walked back (through every layer before this
    one: a walk per attention would make planning quadratic in the depth)."""
    floats = {
        a
        for a in _ancestors([pred], eqns, producer)
        if jnp.issubdtype(getattr(a.aval, "dtype", np.bool_), jnp.inexact)
    }
    return bool(floats) and _reaches(operands, floats, eqns, producer)


def _reaches(atoms, targets: set, eqns, producer) -> bool:
    """Whether any of ``targets`` is among ``atoms`` or their ancestors (stops at the first)."""
    seen, todo = set(), list(atoms)
    while todo:
        a = todo.pop()
        if isinstance(a, compat.Literal) or a in seen:
            continue
        if a in targets:
            return True
        seen.add(a)
        j = producer.get(a)
        if j is not None:
            todo.extend(eqns[j].invars)
    return False


def _is_causal_constant(atom, roles, eqns, producer, consts, jaxpr) -> bool:
    """Whether ``atom`` is a compile-time constant lower-triangular [Tq, Tk] mask."""
    if roles is None or "Tq" not in roles or "Tk" not in roles:
        return False
    invars = set(jaxpr.invars)
    slice_, todo, seen = [], [atom], set()
    while todo:
        a = todo.pop()
        if isinstance(a, compat.Literal) or a in seen:
            continue
        seen.add(a)
        if a in invars:
            return False
        if a in consts:
            if isinstance(consts[a], compat.Tracer):
                return False
            continue
        j = producer.get(a)
        if j is None:
            return False
        if compat.has_subjaxprs(eqns[j]) or eqns[j].effects:
            return False
        slice_.append(j)
        todo.extend(eqns[j].invars)
    env = dict(consts)
    with jax.ensure_compile_time_eval():
        jaxprs.run_eqns([eqns[j] for j in sorted(set(slice_))], env)
        val = np.asarray(jaxprs.read(env, atom))
    if val.dtype != np.bool_:
        return False
    tq, tk = roles.index("Tq"), roles.index("Tk")
    other = [d for d in range(val.ndim) if d not in (tq, tk)]
    m = np.transpose(val, other + [tq, tk]).reshape(-1, val.shape[tq], val.shape[tk])
    tril = np.tril(np.ones(m.shape[1:], bool))
    return m.shape[1] == m.shape[2] and bool(np.all(m == tril))


# -- the decision -------------------------------------------------------------------


@dataclasses.dataclass
class AttentionPlan:
    """What to do with the attentions of one jaxpr."""

    fused: dict[int, tuple[Match, str]]  # index of the second matmul -> (match, implementation)
    log: list[tuple[str, str | None, str]]  # (source line, implementation or None, reason)
    paths: dict[int, AttentionPath]  # eqn index -> the path of the attention it is part of

    @property
    def skip(self) -> frozenset[int]:
        return frozenset().union(*(m.skip for m, _ in self.fused.values()))


def plan_attention(
    jaxpr: compat.Jaxpr,
    consts: dict[compat.Var, Any],
    *,
    mode: str,
    backend: Backend,
    compute_dtype: np.dtype,
    in_full_precision: Callable[[compat.Eqn], bool] = lambda eqn: False,
) -> AttentionPlan:
    """Which attentions of ``jaxpr`` run fused, and the reasons for all of them.

    ``backend`` is the record planned for: a GPU can be planned on a
    machine without one (cuDNN's own trace-time checks then wait for the GPU).
    """
    out = AttentionPlan({}, [], {})
    if mode == "off":
        return out
    near: list[NearMiss] = []
    for i, match in find(jaxpr, consts, near).items():
        where = compat.source_line(match.source)
        if in_full_precision(match.source) or in_full_precision(jaxpr.eqns[i]):
            impl, reason = None, "in a full_precision scope"
        else:
            impl, reason = decide(match, mode, backend, compute_dtype)
        out.log.append((where, impl, reason))
        if impl is not None:
            out.fused[i] = (match, impl)
        out.paths.update(dict.fromkeys(match.eqns | {i}, AttentionPath(impl, reason)))
    for miss in near:
        out.log.append((compat.source_line(miss.source), None, miss.reason))
        out.paths.update(dict.fromkeys(miss.eqns, AttentionPath(None, miss.reason)))
    return out


def decide(
    match: Match, mode: str, backend: Backend, compute_dtype: np.dtype
) -> tuple[AttentionImpl | None, str]:
    """(implementation or None, reason) for one recognised attention."""
    low = np.dtype(compute_dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
    if mode == "off":
        return None, "attention rewrite off (Policy(attention='off'))"
    if not low:
        return (
            None,
            f"compute dtype {np.dtype(compute_dtype).name}: fused attention needs bf16 or f16",
        )
    if mode == "xla":
        return "xla", "fused attention, XLA implementation (Policy(attention='xla'))"
    if mode == "auto" and not backend.fused_attention:
        return None, f"no fused attention kernel on {backend.name}: left as written"
    d = max(match.sizes["H"], match.sizes["Hv"])  # the smaller one is zero-padded
    needs_even = match.bias is not None or (match.pred is not None and not match.causal_const)
    read = _abstract_read(match, compute_dtype)

    def fused(*operands: jax.Array) -> jax.Array:
        vals = dict(zip((match.q, match.k, match.v), operands))
        return match.evaluate(
            lambda a, dt: vals[a].astype(dt) if a in vals else read(a, dt), compute_dtype, "cudnn"
        )

    def probe() -> None:
        operands = [read(a, compute_dtype) for a in (match.q, match.k, match.v)]
        jax.eval_shape(fused, *operands)
        jax.eval_shape(
            jax.grad(lambda *o: jnp.sum(fused(*o).astype(jnp.float32)), argnums=(0, 1, 2)),
            *operands,
        )

    return backend.attention(d, match.sizes["Tq"], match.sizes["Tk"], needs_even, probe)


def _abstract_read(
    match: Match, dtype: np.dtype
) -> Callable[[compat.Atom, np.dtype | None], jax.Array]:
    """A ``read`` that gives zeros of each operand's shape (for ``eval_shape``)."""

    def read(atom: compat.Atom, want: np.dtype | None) -> jax.Array:
        aval = cast(compat.ShapedArray, atom.aval)
        return jnp.zeros(aval.shape, want if want is not None else aval.dtype)

    return read


__all__: Sequence[str] = ("AttentionPlan", "Match", "NearMiss", "decide", "find", "plan_attention")
