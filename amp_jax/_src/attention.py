"""Attention written out in a jaxpr, recognised and run as fused attention.

Under :func:`amp_jax.amp` a model is traced in float32, so attention written
as ``einsum -> scale -> mask -> softmax -> einsum`` (or
``jax.nn.dot_product_attention`` on float32 inputs, which takes its XLA path)
arrives as separate primitives that materialise the ``[B, N, T, S]`` score
and probability arrays. Only amp knows that the inputs will be bf16/f16,
which is what cuDNN's fused flash attention needs. :func:`find` recognises
the pattern in one jaxpr; :meth:`Match.evaluate` replaces it by one call of
``jax.nn.dot_product_attention`` on compute-dtype operands.

Recognised (each part optional except the two matmuls and the softmax):

* ``S = dot_general(q, k)`` contracting one head dim, with 0-2 batch dims
  (batch, heads) and one non-unit free dim for the keys; the queries have
  one non-unit free dim (positions) or two (positions and ``G``, the query
  heads of one kv head: grouped-query attention as a grouped einsum, which is
  how ``jax.nn.dot_product_attention`` writes it, or multi-query attention
  with k and v without a heads dim); then an optional ``transpose``;
* k and v repeated along the heads (``jnp.repeat``: a ``broadcast_in_dim``
  and a ``reshape``): the fused call reads them un-repeated;
* a scale: ``mul``/``div`` by a scalar literal or constant;
* an additive bias: ``add(S, bias)`` (a scale applied after it is folded
  into it); ``bias = jnp.where(mask, 0, fill)`` becomes a mask;
* a mask: ``select_n(pred, fill, S)`` where ``fill`` is a broadcast scalar
  ``<= -1e4`` (``-1e9``, ``-inf``, ``finfo.min``) and ``pred`` is not
  computed from the float values q, k and v come from (a constant, iota
  comparisons, integer tokens, a given boolean or float mask); a constant
  lower-triangular ``pred`` becomes ``is_causal=True``;
* the softmax over the key axis, as ``jax.nn.softmax`` emits it (reduce_max,
  sub, exp, reduce_sum, div, with or without ``stop_gradient``);
* ``dot_general(P, v)`` (or ``(v, P)``) contracting the key axis; v's head
  dim may differ from q's (the smaller one is zero-padded for the call).

The intermediate values must have no other consumers. A softmax between two
matmuls that cannot be taken (dropout or other ops between the softmax and
the second matmul, a softmax over another axis, a soft or value-dependent
mask, the scores or probabilities used elsewhere, an op such as ``tanh``
before the softmax) is a *near miss*: it is left as written and its reason
recorded. :func:`plan` decides per attention (:func:`decide`: policy,
compute dtype, backend, cuDNN's limits) and names the scope its ops are
bound under: ``amp_attention[cudnn]``, ``amp_attention[xla-fused]`` or
``amp_attention[xla: <reason>]``, which ``dtype_report`` and ``explain`` read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from amp_jax._src import compat
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

    def evaluate(self, read: Callable[[Any, Any], Any], dtype: Any, implementation: str) -> Any:
        """The attention output, in ``dtype``, laid out as the second matmul's output."""
        s = self.sizes
        b0, b1, g = s.get("b0", 1), s.get("b1", 1), s.get("G", 1)
        kvh, h, hv = s.get("kvh", b1), s["H"], s["Hv"]

        def canon(atom, order, shape):
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
            implementation=implementation,
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


def _literal_scalar(atom: Any) -> float | None:
    if isinstance(atom, compat.Literal):
        val = np.asarray(compat.literal_value(atom))
        if val.ndim == 0:
            return float(val)
    return None


def find(
    jaxpr: Any, consts: dict[Any, Any], near: list[NearMiss] | None = None
) -> dict[int, Match]:
    """Recognised attentions of ``jaxpr``, keyed by the index of their second matmul.

    ``consts`` maps constvars to their (concrete) values, to recognise a
    constant causal mask. Near misses (a softmax between two matmuls that
    cannot be taken, with the reason) are appended to ``near`` if given.
    """
    eqns = jaxpr.eqns
    producer: dict[Any, int] = {}
    consumers: dict[Any, list[int]] = {}
    for i, e in enumerate(eqns):
        for v in e.outvars:
            producer[v] = i
        for v in e.invars:
            if not isinstance(v, compat.Literal):
                consumers.setdefault(v, []).append(i)
    outs = {v for v in jaxpr.outvars if not isinstance(v, compat.Literal)}
    found: dict[int, Match] = {}
    taken: set[int] = set()
    for i, e in enumerate(eqns):
        if e.primitive.name == "exp":
            try:
                m = _match_at(i, eqns, producer, consumers, outs, consts, jaxpr)
            except _NoMatch as x:
                if near is not None and x.args:
                    near.append(NearMiss(*x.args))
                continue
            except Exception:  # noqa: BLE001 -- a shape the matcher did not foresee:
                continue  # never break the program, leave it as written
            if not (m.skip & taken):
                found[m.d2] = m
                taken |= m.skip
    return found


class _NoMatch(Exception):
    """Not attention; with args ``(reason, eqns, source eqn)``: a near miss."""


_RANDOM = frozenset({"random_bits", "random_seed", "random_wrap", "threefry2x32", "rng_uniform"})
_BETWEEN = frozenset({"mul", "div", "select_n", "convert_element_type"})


def _match_at(i_exp, eqns, producer, consumers, outs, consts, jaxpr) -> Match:
    """The attention whose softmax has its ``exp`` at ``i_exp``.

    Raises ``_NoMatch()`` when it is not attention, ``_NoMatch(reason, eqns,
    source)`` when the softmax and both matmuls are there but something else
    is not (a near miss).
    """
    near: dict[str, Any] = {}  # set once the softmax and the values matmul are found

    def need(cond: bool, reason: str | None = None) -> None:
        if not cond:
            if near and reason:
                raise _NoMatch(reason, frozenset(near["eqns"]), near["source"])
            raise _NoMatch

    def prod(atom, name=None, reason=None):
        need(not isinstance(atom, compat.Literal) and atom in producer, reason)
        j = producer[atom]
        need(
            name is None
            or eqns[j].primitive.name in (name if isinstance(name, tuple) else (name,)),
            reason,
        )
        return j

    def only_used_by(var, allowed: set[int], reason=None):
        need(var not in outs and set(consumers.get(var, ())) <= allowed, reason)

    skip: set[int] = set()
    e_exp = eqns[i_exp]
    i_sub = prod(e_exp.invars[0], "sub")
    s_var, mb = eqns[i_sub].invars
    # the max: [stop_gradient] <- broadcast_in_dim <- [max(-inf, .)] <- reduce_max(S)
    chain = [i_sub]
    j = prod(mb)
    if eqns[j].primitive.name == "stop_gradient":
        chain.append(j)
        j = prod(eqns[j].invars[0])
    need(eqns[j].primitive.name == "broadcast_in_dim")
    chain.append(j)
    j = prod(eqns[j].invars[0])
    max_perm = None
    if eqns[j].primitive.name == "transpose":  # the max taken before S's transpose
        max_perm = tuple(eqns[j].params["permutation"])
        chain.append(j)
        j = prod(eqns[j].invars[0])
    if eqns[j].primitive.name == "max":
        chain.append(j)
        a, b = eqns[j].invars
        j = prod(a if isinstance(b, compat.Literal) else b)
    need(eqns[j].primitive.name == "reduce_max")
    chain.append(j)
    nd = len(s_var.aval.shape)
    max_src, axes = eqns[j].invars[0], tuple(eqns[j].params["axes"])
    if max_src is s_var:
        axis_ok = max_perm is None and axes == (nd - 1,)
    else:  # S = transpose(max_src, perm) and the max is over S's last axis
        t = prod(s_var, "transpose")
        perm_s = tuple(eqns[t].params["permutation"])
        need(eqns[t].invars[0] is max_src)
        axis_ok = axes == (perm_s[-1],)
    # exp -> reduce_sum -> broadcast -> div(exp, .)
    e_var = e_exp.outvars[0]
    uses = consumers.get(e_var, [])
    need(len(uses) == 2)
    i_rs = next((u for u in uses if eqns[u].primitive.name == "reduce_sum"), None)
    i_div = next((u for u in uses if eqns[u].primitive.name == "div"), None)
    need(i_rs is not None and i_div is not None)
    axis_ok = axis_ok and tuple(eqns[i_rs].params["axes"]) == (nd - 1,)
    (bs,) = consumers.get(eqns[i_rs].outvars[0], [None])
    need(bs is not None and eqns[bs].primitive.name == "broadcast_in_dim")
    need(eqns[i_div].invars[0] is e_var and eqns[i_div].invars[1] is eqns[bs].outvars[0])
    p_var = eqns[i_div].outvars[0]
    skip.update(chain + [i_exp, i_rs, bs, i_div])

    # P -> [elementwise ops, e.g. dropout] -> dot_general with the values
    cur, between, i_d2, p_elsewhere = p_var, [], None, False
    for _ in range(6):
        uses = consumers.get(cur, [])
        dots = [u for u in uses if eqns[u].primitive.name == "dot_general"]
        if len(dots) == 1 and (len(uses) > 1 or cur in outs):
            i_d2, p_elsewhere = dots[0], True
            break
        if len(uses) != 1 or cur in outs:
            break
        name = eqns[uses[0]].primitive.name
        if name == "dot_general":
            i_d2 = uses[0]
            break
        if name not in _BETWEEN:
            break
        between.append(uses[0])
        cur = eqns[uses[0]].outvars[0]
    need(i_d2 is not None)
    near.update(eqns=set(skip) | set(between) | {i_d2}, source=eqns[i_d2])
    if all(_is_float_cast(eqns[k]) for k in between):
        # P cast to another float dtype (softmax in float32, then the compute dtype,
        # as Flax and hand-written bf16 code do): the fused attention computes P in
        # its own dtype, so the casts are part of it
        skip.update(between)
        between, p_var = [], cur

    # -- from here on, a failure is a near miss (with a reason) --------------------------
    need(axis_ok, "softmax not over the key axis")
    if between:
        sides = [v for k in between for v in eqns[k].invars if v is not cur]
        rand = any(
            producer.get(a) is not None and eqns[producer[a]].primitive.name in _RANDOM
            for a in _ancestors(sides, eqns, producer)
        )
        ops = ", ".join(eqns[k].primitive.name for k in between)
        need(False, "dropout on the probabilities" if rand else f"{ops} between softmax and P.V")
    need(not p_elsewhere, "the probabilities are also used outside the attention")
    for k in chain[1:-1]:
        only_used_by(eqns[k].outvars[0], set(chain) | skip, "softmax max used elsewhere")
    only_used_by(eqns[chain[-1]].outvars[0], set(chain), "softmax max used elsewhere")
    only_used_by(e_var, {i_rs, i_div}, "softmax exp used elsewhere")
    only_used_by(eqns[i_rs].outvars[0], {bs}, "softmax sum used elsewhere")
    only_used_by(eqns[bs].outvars[0], {i_div}, "softmax sum used elsewhere")

    # S <- [select_n mask] <- [add bias] <- [scale] <- [transpose] <- dot_general(q, k)
    s_users = {i_sub} | ({chain[-1]} if max_src is s_var else set())
    st = _walk_scores(s_var, s_users, max_src, chain[-1], eqns, producer, need, prod, only_used_by)
    i_d1, scale, pred, perm = st["d1"], st["scale"], st["pred"], st["perm"]
    skip.update(st["skip"])
    near["eqns"] |= skip | {i_d1}
    near["source"] = eqns[i_d1]
    skip.update({i_d1, i_d2})
    d1 = eqns[i_d1]
    layout = "scores matmul layout not recognised"
    (ca, cb), (ba, bb) = d1.params["dimension_numbers"]
    need(len(ca) == 1 and len(cb) == 1 and len(ba) <= 2, layout)
    A, B = d1.invars
    need(not isinstance(A, compat.Literal) and not isinstance(B, compat.Literal), layout)
    nb = len(ba)
    a_free = [d for d in range(len(A.aval.shape)) if d not in ca and d not in ba]
    b_free = [d for d in range(len(B.aval.shape)) if d not in cb and d not in bb]
    out_roles = (
        [("b", i) for i in range(nb)] + [("A", d) for d in a_free] + [("B", d) for d in b_free]
    )
    s_roles = [out_roles[p] for p in perm] if perm is not None else out_roles
    key_role = s_roles[-1]
    need(key_role[0] in ("A", "B"), layout)
    if key_role[0] == "B":
        Q, K, cq, ck, bq, bk, qf, kf = A, B, ca[0], cb[0], ba, bb, a_free, b_free
        qtag = "A"
    else:
        Q, K, cq, ck, bq, bk, qf, kf = B, A, cb[0], ca[0], bb, ba, b_free, a_free
        qtag = "B"
    qs, ks = Q.aval.shape, K.aval.shape
    q_big = [d for d in qf if qs[d] != 1]
    k_big = [d for d in kf if ks[d] != 1]
    need(len(q_big) in (1, 2) and k_big == [key_role[1]], layout)
    # the query positions: the free q dim nearest the keys in S; another one is G
    in_s = [r[1] for r in s_roles if r[0] == qtag and r[1] in q_big]
    tq_dim = in_s[-1]
    g_dim = next((d for d in q_big if d != tq_dim), None)
    sizes = {"Tq": qs[tq_dim], "Tk": ks[k_big[0]], "H": qs[cq]}
    need(ks[ck] == sizes["H"], layout)
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

    s_named = [role_of(r) for r in s_roles]
    pre_named = [role_of(r) for r in out_roles]
    need(s_named[-1] == "Tk" and "Tq" in s_named, layout)

    # the second matmul: P's key axis against v's
    d2 = eqns[i_d2]
    (c2l, c2r), (b2l, b2r) = d2.params["dimension_numbers"]
    L, R = d2.invars
    need((L is p_var) != (R is p_var), layout)
    p_left = L is p_var
    V = R if p_left else L
    cp, cv = (c2l, c2r) if p_left else (c2r, c2l)
    bp, bv = (b2l, b2r) if p_left else (b2r, b2l)
    layout2 = "values matmul layout not recognised"
    need(len(cp) == 1 and s_named[cp[0]] == "Tk" and len(bp) == nb, layout2)
    need(sorted(s_named[d] for d in bp) == sorted(f"b{r}" for r in range(nb)), layout2)
    vs = V.aval.shape
    v_free = [d for d in range(len(vs)) if d not in cv and d not in bv]
    v_big = [d for d in v_free if vs[d] != 1]
    need(len(v_big) == 1 and vs[cv[0]] == sizes["Tk"], layout2)
    sizes["Hv"] = vs[v_big[0]]
    p_free = [d for d in range(nd) if d not in cp and d not in bp]
    need(
        sorted(s_named[d] for d in p_free if s_named[d] != "u")
        == sorted(["Tq"] + (["G"] if g_dim is not None else [])),
        layout2,
    )
    batch_roles = [s_named[d] for d in bp]
    v_roles = ["Hv" if d == v_big[0] else "u" for d in v_free]
    p_roles = [s_named[d] for d in p_free]
    out_roles2 = batch_roles + (p_roles + v_roles if p_left else v_roles + p_roles)

    # operand orders: [b0, T, b1, (G), H] with the unit dims last
    def order(x_shape, lead):
        lead = [d for d in lead if d is not None]
        rest = [d for d in range(len(x_shape)) if d not in lead]
        need(all(x_shape[d] == 1 for d in rest), layout)
        return tuple(lead + rest)

    def batch(dims, r):
        return dims[r] if nb > r else None

    v_batch = [None] * nb
    for j2, d in enumerate(bv):
        v_batch[int(s_named[bp[j2]][1])] = d
    q_order = order(qs, [batch(bq, 0), tq_dim, batch(bq, 1), g_dim, cq])
    k_order = order(ks, [batch(bk, 0), k_big[0], batch(bk, 1), ck])
    v_order = order(vs, [batch(v_batch, 0), cv[0], batch(v_batch, 1), v_big[0]])

    # k and v repeated along the heads (jnp.repeat): read the kv heads as they are
    if nb == 2 and g_dim is None:
        rk = _unrepeat(K, bk[1], eqns, producer)
        rv = _unrepeat(V, v_batch[1], eqns, producer)
        if rk and rv and rk[1] == rv[1]:
            K, V = rk[0], rv[0]
            sizes["kvh"] = sizes["b1"] // rk[1]
            for (_, _, chain_), used_by in ((rk, i_d1), (rv, i_d2)):
                users = {used_by}  # skip the repeat where only the attention reads it
                for idx in chain_:
                    out = eqns[idx].outvars[0]
                    if out in outs or not set(consumers.get(out, ())) <= users:
                        break
                    skip.add(idx)
                    users = {idx}

    def roles_of(atom, pre):
        names = pre_named if pre else s_named
        return _trace_source(atom, tuple(names), eqns, producer)

    # the mask: a broadcast of a source that depends on no float value
    pred_atom, pred_roles, causal = None, None, False
    bias_atom, bias_roles = None, None
    if st["bias"] is not None:
        bias_atom, bias_roles = roles_of(st["bias"], st["bias_pre"])
        as_mask = _mask_of_bias(bias_atom, eqns, producer)
        if pred is None and as_mask is not None:  # jnp.where(mask, 0, -1e9) added
            pred_atom, pred_roles = _trace_source(as_mask, bias_roles, eqns, producer)
            bias_atom = bias_roles = None
    if pred is not None:
        pred_atom, pred_roles = roles_of(pred, st["pred_pre"])
    if pred_atom is not None:
        need(
            not _mask_depends_on_values(pred_atom, (Q, K, V), eqns, producer),
            "mask computed from the values q, k and v come from",
        )
        causal = _is_causal_constant(pred_atom, pred_roles, eqns, producer, consts, jaxpr)
    return Match(
        d2=i_d2,
        skip=frozenset(skip),
        q=Q,
        k=K,
        v=V,
        q_order=q_order,
        k_order=k_order,
        v_order=v_order,
        n_batch=nb,
        sizes=sizes,
        out_roles=tuple(out_roles2),
        scale=float(scale),
        pred=pred_atom,
        pred_roles=pred_roles,
        causal_const=causal,
        head_dim=int(sizes["H"]),
        source=eqns[i_d1],
        bias=bias_atom,
        bias_roles=bias_roles,
        bias_scale=float(st["bias_scale"]),
        eqns=frozenset(near["eqns"] | skip),
    )


def _walk_scores(s_var, s_users, max_src, i_max, eqns, producer, need, prod, only_used_by):
    """Walks back from the softmax's input to the scores matmul, through at most
    one mask (``select_n``), additive bias (``add``), scale and transpose."""
    shared = "the scores are also used outside the attention"

    def walk(cur, users, st):
        only_used_by(cur, users | ({i_max} if cur is max_src else set()), shared)
        j = prod(cur, reason="the scores are not computed by a matmul")
        e = eqns[j]
        name = e.primitive.name
        st = dict(st, skip=st["skip"] | {j})
        if name == "select_n" and st["pred"] is None and len(e.invars) == 3:
            p_atom, on_false, on_true = e.invars
            fill, fusers = on_false, {j}
            while True:  # a scalar literal broadcast (possibly twice) to S's shape
                fj = prod(fill, "broadcast_in_dim", "a mask whose fill is not a constant")
                only_used_by(fill, fusers, "mask fill used elsewhere")
                st["skip"] = st["skip"] | {fj}
                fill, fusers = eqns[fj].invars[0], {fj}
                fv = _literal_scalar(fill)
                if fv is not None:
                    break
            need(fv <= _FILL_MAX, f"mask fill {fv:g} is above {_FILL_MAX:g}: a soft mask")
            st.update(pred=p_atom, pred_pre=st["perm"] is not None)
            return walk(on_true, {j}, st)
        if name in ("mul", "div") and st["scale"] is None:
            a, b = e.invars
            c = _literal_scalar(b)
            if c is None and name == "mul":
                c, a = _literal_scalar(a), b
            need(c is not None and c != 0.0, f"{name} by a non-constant between QK and softmax")
            st["scale"] = c if name == "mul" else 1.0 / c
            return walk(a, {j}, st)
        if name == "add" and any(_literal_scalar(a) is not None for a in e.invars):
            # a constant added to every score: the softmax does not change
            a, b = e.invars
            return walk(b if _literal_scalar(a) is not None else a, {j}, st)
        if name == "add" and st["bias"] is None:
            err = None
            for chain_op, other in (e.invars, e.invars[::-1]):
                if isinstance(chain_op, compat.Literal) or isinstance(other, compat.Literal):
                    continue
                st2 = dict(st, bias=other, bias_pre=st["perm"] is not None)
                st2["bias_scale"] = 1.0 if st["scale"] is None else st["scale"]
                try:
                    return walk(chain_op, {j}, st2)
                except _NoMatch as x:
                    err = err or x
            raise err or _NoMatch
        if name == "transpose" and st["perm"] is None:
            st["perm"] = tuple(e.params["permutation"])
            return walk(e.invars[0], {j}, st)
        if _is_float_cast(e):  # scores cast to float32 for the softmax (hand-written bf16)
            return walk(e.invars[0], {j}, st)
        if name == "dot_general":
            return dict(st, d1=j, skip=st["skip"] - {j})
        need(False, f"{name} between the scores matmul and the softmax")

    st0 = dict(scale=None, pred=None, pred_pre=False, perm=None, bias=None, bias_pre=False)
    st = walk(s_var, s_users, dict(st0, bias_scale=1.0, skip=frozenset()))
    st["scale"] = 1.0 if st["scale"] is None else st["scale"]
    return st


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
    computed from (a mask derived from the activations, not a given mask)."""
    shared = _ancestors([pred], eqns, producer) & _ancestors(operands, eqns, producer)
    return any(jnp.issubdtype(getattr(a.aval, "dtype", np.bool_), jnp.inexact) for a in shared)


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
        for j in sorted(set(slice_)):
            e = eqns[j]
            vals = [
                compat.literal_value(v) if isinstance(v, compat.Literal) else env[v]
                for v in e.invars
            ]
            for v, o in zip(e.outvars, compat.bind_eqn(e, vals)):
                env[v] = o
        val = (
            np.asarray(env[atom]) if not isinstance(atom, compat.Literal) else np.asarray(atom.val)
        )
    if val.dtype != np.bool_:
        return False
    tq, tk = roles.index("Tq"), roles.index("Tk")
    other = [d for d in range(val.ndim) if d not in (tq, tk)]
    m = np.transpose(val, other + [tq, tk]).reshape(-1, val.shape[tq], val.shape[tk])
    tril = np.tril(np.ones(m.shape[1:], bool))
    return m.shape[1] == m.shape[2] and bool(np.all(m == tril))


# -- the decision -------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    """What to do with the attentions of one jaxpr."""

    fused: dict[int, tuple[Match, str]]  # index of the second matmul -> (match, implementation)
    log: list[tuple[str, str | None, str]]  # (source line, implementation or None, reason)
    paths: dict[int, AttentionPath]  # eqn index -> the path of the attention it is part of

    @property
    def skip(self) -> frozenset[int]:
        return frozenset().union(*(m.skip for m, _ in self.fused.values()))


def plan(
    jaxpr: Any,
    consts: dict[Any, Any],
    *,
    mode: str,
    backend: str,
    compute_dtype: Any,
    in_full_precision: Callable[[Any], bool] = lambda eqn: False,
) -> Plan:
    """Which attentions of ``jaxpr`` run fused, and the reasons for all of them.

    ``backend`` is the platform planned for: ``"gpu"`` can be planned on a
    machine without one (cuDNN's own trace-time checks then wait for the GPU).
    """
    out = Plan({}, [], {})
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


def decide(match: Match, mode: str, backend: str, compute_dtype: Any) -> tuple[str | None, str]:
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
    if mode == "auto" and backend != "gpu":
        return None, f"no fused attention kernel on {backend}: left as written"
    h, hv = match.sizes["H"], match.sizes["Hv"]
    d = max(h, hv)  # the smaller one is zero-padded
    limit = _cudnn_head_dim_limit()
    if d % 8 or d > limit:
        return None, f"head dim {d}: cuDNN needs a multiple of 8 and at most {limit}"
    tq, tk = match.sizes["Tq"], match.sizes["Tk"]
    if (match.bias is not None or (match.pred is not None and not match.causal_const)) and (
        tq % 2 or tk % 2
    ):
        return None, (
            f"odd length (Tq={tq}, Tk={tk}) with a mask or bias: cuDNN's backward needs even ones"
        )
    if not _have_cudnn():
        if backend == "gpu":  # planned for a GPU on a machine without one
            return "cudnn", "cuDNN flash attention (planned without a GPU: cuDNN checks not run)"
        return None, f"no cuDNN on {backend}: left as written"
    read = _abstract_read(match, compute_dtype)

    def fused(*operands):
        vals = dict(zip((match.q, match.k, match.v), operands))
        return match.evaluate(
            lambda a, dt: vals[a].astype(dt) if a in vals else read(a, dt), compute_dtype, "cudnn"
        )

    operands = [read(a, compute_dtype) for a in (match.q, match.k, match.v)]
    try:  # cuDNN's own checks (layout, lengths, versions) run at trace time, some only
        # when differentiated (a mask turned into a bias needs even lengths then)
        jax.eval_shape(fused, *operands)
        jax.eval_shape(
            jax.grad(lambda *o: jnp.sum(fused(*o).astype(jnp.float32)), argnums=(0, 1, 2)),
            *operands,
        )
    except Exception as e:  # noqa: BLE001 -- any refusal means: leave it as written
        return None, f"cuDNN refused it: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return "cudnn", "cuDNN flash attention"


def _have_cudnn() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except Exception:  # noqa: BLE001
        return False


def _abstract_read(match: Match, dtype: Any) -> Callable[[Any, Any], Any]:
    """A ``read`` that gives zeros of each operand's shape (for ``eval_shape``)."""

    def read(atom, want):
        aval = atom.aval
        return jnp.zeros(aval.shape, want if want is not None else aval.dtype)

    return read


def _cudnn_head_dim_limit() -> int:
    try:
        kind = jax.devices()[0].device_kind
    except Exception:  # no device info: the conservative (Ampere backward) bound
        return 128
    return 256 if any(s in kind for s in ("H100", "H200", "H800", "GH200", "B200", "B100")) else 128


__all__: Sequence[str] = ("Match", "NearMiss", "Plan", "decide", "find", "plan")
