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
  (batch, heads) and one non-unit free dim per operand (query and key
  positions; size-1 free dims, as in ``jax.nn.dot_product_attention``'s
  grouped layout, are allowed), then an optional ``transpose``;
* a scale: ``mul``/``div`` by a scalar literal or constant;
* a mask: ``select_n(pred, fill, S)`` where ``fill`` is a broadcast scalar
  ``<= -1e4`` (``-1e9``, ``-inf``, ``finfo.min``) and ``pred`` is not
  computed from the float values q, k and v come from (a constant, iota
  comparisons, integer tokens, a given boolean or float mask); a constant
  lower-triangular ``pred`` becomes ``is_causal=True``;
* the softmax over the key axis, as ``jax.nn.softmax`` emits it (reduce_max,
  sub, exp, reduce_sum, div, with or without ``stop_gradient``);
* ``dot_general(P, v)`` (or ``(v, P)``) contracting the key axis.

The intermediate values must have no other consumers. Anything else
(dropout between softmax and the second matmul, a softmax over another axis,
an additive bias, a mask computed from float values) is left as it is.
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

_FILL_MAX = -1e4  # a mask fill at or below this is "masked out"


@dataclasses.dataclass(frozen=True)
class Match:
    """One recognised attention: how to build it from the jaxpr's values."""

    d2: int  # index of the second matmul (its output is the result)
    skip: frozenset[int]  # eqns replaced (not evaluated)
    q: Any
    k: Any
    v: Any
    q_order: tuple[int, ...]  # q dims in [b0, T, b1, H] order (present roles only)
    k_order: tuple[int, ...]
    v_order: tuple[int, ...]
    n_batch: int  # 0, 1 or 2 batch roles
    sizes: dict  # role -> size
    out_roles: tuple  # roles of the second matmul's output dims ("u" for size 1)
    scale: float
    pred: Any  # boolean atom (S-shaped or a broadcast source), or None
    pred_roles: tuple | None  # roles of pred's dims
    causal_const: bool  # pred is a constant lower-triangular mask
    head_dim: int
    source: Any  # eqn (for its source info)

    def evaluate(self, read: Callable[[Any, Any], Any], dtype: Any, implementation: str) -> Any:
        """The attention output, in ``dtype``, laid out as the second matmul's output."""
        b0, b1 = self.sizes.get("b0", 1), self.sizes.get("b1", 1)

        def canon(atom, order, seq, head):
            x = read(atom, dtype)
            if tuple(order) != tuple(range(len(order))):
                x = lax.transpose(x, order)
            return x.reshape(b0, self.sizes[seq], b1, self.sizes[head])  # unit dims (last) dropped

        q = canon(self.q, self.q_order, "Tq", "H")
        k = canon(self.k, self.k_order, "Tk", "H")
        v = canon(self.v, self.v_order, "Tk", "Hv")
        mask = None
        if self.pred is not None and not self.causal_const:
            mask = self._mask(read(self.pred, None))
        out = jax.nn.dot_product_attention(
            q,
            k,
            v,
            mask=mask,
            scale=self.scale,
            is_causal=self.causal_const,
            implementation=implementation,
        )
        # [B, Tq, N, Hv] -> the second matmul's layout
        present = [r for r in ("b0", "Tq", "b1", "Hv") if r in self.sizes]
        out = out.reshape([self.sizes[r] for r in present])
        target = [r for r in self.out_roles if r != "u"]
        perm = [present.index(r) for r in target]
        if perm != list(range(len(perm))):
            out = lax.transpose(out, perm)
        return out.reshape([1 if r == "u" else self.sizes[r] for r in self.out_roles])

    def _mask(self, pred):
        """``pred`` (dims labelled by ``pred_roles``) as a [B, N, T, S]-broadcastable mask."""
        roles = list(self.pred_roles)
        want = ["b0", "b1", "Tq", "Tk"]
        keep = [i for i, r in enumerate(roles) if r in want]
        if len(keep) != pred.ndim:  # the other dims are units
            pred = pred.reshape([pred.shape[i] for i in keep])
        kept = [roles[i] for i in keep]
        order = sorted(range(len(kept)), key=lambda i: want.index(kept[i]))
        if order != list(range(len(order))):
            pred = lax.transpose(pred, order)
        present = [kept[i] for i in order]
        return pred.reshape([pred.shape[present.index(r)] if r in present else 1 for r in want])


# -- recognition -------------------------------------------------------------------


def _literal_scalar(atom: Any) -> float | None:
    if isinstance(atom, compat.Literal):
        val = np.asarray(compat.literal_value(atom))
        if val.ndim == 0:
            return float(val)
    return None


def find(jaxpr: Any, consts: dict[Any, Any]) -> dict[int, Match]:
    """Recognised attentions of ``jaxpr``, keyed by the index of their second matmul.

    ``consts`` maps constvars to their (concrete) values, to recognise a
    constant causal mask.
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
    for i, e in enumerate(eqns):
        if e.primitive.name == "exp":
            try:
                m = _match_at(i, eqns, producer, consumers, outs, consts, jaxpr)
            except _NoMatch:
                continue
            if m is not None and not (m.skip & set().union(*(x.skip for x in found.values()))):
                found[m.d2] = m
    return found


class _NoMatch(Exception):
    pass


def _need(cond: bool) -> None:
    if not cond:
        raise _NoMatch


def _match_at(i_exp, eqns, producer, consumers, outs, consts, jaxpr) -> Match | None:
    def prod(atom, name=None):
        _need(not isinstance(atom, compat.Literal) and atom in producer)
        j = producer[atom]
        _need(
            name is None or eqns[j].primitive.name in (name if isinstance(name, tuple) else (name,))
        )
        return j

    def only_used_by(var, allowed: set[int]):
        _need(var not in outs and set(consumers.get(var, ())) <= allowed)

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
    _need(eqns[j].primitive.name == "broadcast_in_dim")
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
    _need(eqns[j].primitive.name == "reduce_max")
    chain.append(j)
    nd = len(s_var.aval.shape)
    max_src, axes = eqns[j].invars[0], tuple(eqns[j].params["axes"])
    if max_src is s_var:
        _need(max_perm is None and axes == (nd - 1,))
    else:  # S = transpose(max_src, perm) and the max is over S's last axis
        t = prod(s_var, "transpose")
        perm_s = tuple(eqns[t].params["permutation"])
        _need(eqns[t].invars[0] is max_src and axes == (perm_s[-1],))
    # exp -> reduce_sum -> broadcast -> div(exp, .)
    e_var = e_exp.outvars[0]
    uses = consumers.get(e_var, [])
    _need(len(uses) == 2)
    i_rs = next((u for u in uses if eqns[u].primitive.name == "reduce_sum"), None)
    i_div = next((u for u in uses if eqns[u].primitive.name == "div"), None)
    _need(i_rs is not None and i_div is not None)
    _need(tuple(eqns[i_rs].params["axes"]) == (nd - 1,))
    (bs,) = consumers.get(eqns[i_rs].outvars[0], [None])
    _need(bs is not None and eqns[bs].primitive.name == "broadcast_in_dim")
    _need(eqns[i_div].invars[0] is e_var and eqns[i_div].invars[1] is eqns[bs].outvars[0])
    p_var = eqns[i_div].outvars[0]
    skip.update(chain + [i_exp, i_rs, bs, i_div])
    for k in chain[1:-1]:
        only_used_by(eqns[k].outvars[0], set(chain) | skip)
    only_used_by(eqns[chain[-1]].outvars[0], set(chain))
    only_used_by(e_var, {i_rs, i_div})
    only_used_by(eqns[i_rs].outvars[0], {bs})
    only_used_by(eqns[bs].outvars[0], {i_div})
    p_uses = consumers.get(p_var, [])
    _need(len(p_uses) == 1 and p_var not in outs)
    i_d2 = p_uses[0]
    _need(eqns[i_d2].primitive.name == "dot_general")

    # S <- [select_n mask] <- [scale] <- [transpose] <- dot_general(q, k)
    scale, pred, perm = 1.0, None, None
    s_users = {i_sub} | ({chain[-1]} if max_src is s_var else set())
    cur = s_var
    while True:
        only_used_by(cur, s_users | ({chain[-1]} if cur is max_src else set()))
        j = prod(cur)
        e = eqns[j]
        name = e.primitive.name
        if name == "select_n" and pred is None and len(e.invars) == 3:
            p_atom, on_false, on_true = e.invars
            fill, users = on_false, {j}
            while True:  # a scalar literal broadcast (possibly twice) to S's shape
                fj = prod(fill, "broadcast_in_dim")
                only_used_by(fill, users)
                skip.add(fj)
                fill, users = eqns[fj].invars[0], {fj}
                fv = _literal_scalar(fill)
                if fv is not None:
                    break
            _need(fv <= _FILL_MAX)
            pred = p_atom
            nxt = on_true
        elif name in ("mul", "div") and scale == 1.0:
            a, b = e.invars
            c = _literal_scalar(b)
            if c is None and name == "mul":
                c, a = _literal_scalar(a), b
            _need(c is not None and c != 0.0)
            scale = c if name == "mul" else 1.0 / c
            nxt = a
        elif name == "transpose" and perm is None:
            perm = tuple(e.params["permutation"])
            nxt = e.invars[0]
        elif name == "dot_general":
            break
        else:
            raise _NoMatch
        skip.add(j)
        s_users = {j}
        cur = nxt
    i_d1 = j
    skip.update({i_d1, i_d2})
    d1 = eqns[i_d1]
    (ca, cb), (ba, bb) = d1.params["dimension_numbers"]
    _need(len(ca) == 1 and len(cb) == 1 and len(ba) <= 2)
    A, B = d1.invars
    _need(not isinstance(A, compat.Literal) and not isinstance(B, compat.Literal))
    nb = len(ba)
    a_free = [d for d in range(len(A.aval.shape)) if d not in ca and d not in ba]
    b_free = [d for d in range(len(B.aval.shape)) if d not in cb and d not in bb]
    out_roles = (
        [("b", i) for i in range(nb)] + [("A", d) for d in a_free] + [("B", d) for d in b_free]
    )
    s_roles = [out_roles[p] for p in perm] if perm is not None else out_roles
    key_role = s_roles[-1]
    _need(key_role[0] in ("A", "B"))
    if key_role[0] == "B":
        Q, K, cq, ck, bq, bk, qf, kf = A, B, ca[0], cb[0], ba, bb, a_free, b_free
        qtag = "A"
    else:
        Q, K, cq, ck, bq, bk, qf, kf = B, A, cb[0], ca[0], bb, ba, b_free, a_free
        qtag = "B"
    qs, ks = Q.aval.shape, K.aval.shape
    q_big = [d for d in qf if qs[d] != 1]
    k_big = [d for d in kf if ks[d] != 1]
    _need(len(q_big) == 1 and k_big == [key_role[1]])
    sizes = {"Tq": qs[q_big[0]], "Tk": ks[k_big[0]], "H": qs[cq]}
    _need(ks[ck] == sizes["H"])
    for r in range(nb):
        sizes[f"b{r}"] = qs[bq[r]]

    def role_of(rr):
        if rr[0] == "b":
            return f"b{rr[1]}"
        if rr[0] == qtag:
            return "Tq" if rr[1] == q_big[0] else "u"
        return "Tk" if rr[1] == k_big[0] else "u"

    s_named = [role_of(r) for r in s_roles]
    _need(s_named[-1] == "Tk" and "Tq" in s_named)

    # the second matmul: P's key axis against v's
    d2 = eqns[i_d2]
    (c2l, c2r), (b2l, b2r) = d2.params["dimension_numbers"]
    L, R = d2.invars
    _need((L is p_var) != (R is p_var))
    p_left = L is p_var
    V = R if p_left else L
    cp, cv = (c2l, c2r) if p_left else (c2r, c2l)
    bp, bv = (b2l, b2r) if p_left else (b2r, b2l)
    _need(len(cp) == 1 and s_named[cp[0]] == "Tk" and len(bp) == nb)
    _need(sorted(s_named[d] for d in bp) == sorted(f"b{r}" for r in range(nb)))
    vs = V.aval.shape
    v_free = [d for d in range(len(vs)) if d not in cv and d not in bv]
    v_big = [d for d in v_free if vs[d] != 1]
    _need(len(v_big) == 1 and vs[cv[0]] == sizes["Tk"])
    sizes["Hv"] = vs[v_big[0]]
    p_free = [d for d in range(nd) if d not in cp and d not in bp]
    _need([s_named[d] for d in p_free if s_named[d] != "u"] == ["Tq"])
    batch_roles = [s_named[d] for d in bp]
    if p_left:
        out_roles2 = (
            batch_roles
            + [s_named[d] for d in p_free]
            + ["Hv" if d == v_big[0] else "u" for d in v_free]
        )
    else:
        out_roles2 = (
            batch_roles
            + ["Hv" if d == v_big[0] else "u" for d in v_free]
            + [s_named[d] for d in p_free]
        )

    # operand orders: [b0, T, b1, H] with the unit dims last
    def order(x_shape, batch, tdim, hdim, nbatch_roles):
        lead = []
        if nbatch_roles >= 1:
            lead.append(batch[0])
        lead.append(tdim)
        if nbatch_roles >= 2:
            lead.append(batch[1])
        lead.append(hdim)
        rest = [d for d in range(len(x_shape)) if d not in lead]
        _need(all(x_shape[d] == 1 for d in rest))
        return tuple(lead + rest)

    v_batch = [None] * nb
    for j2, d in enumerate(bv):
        v_batch[int(s_named[bp[j2]][1])] = d
    q_order = order(qs, list(bq), q_big[0], cq, nb)
    k_order = order(ks, list(bk), k_big[0], ck, nb)
    v_order = order(vs, v_batch, cv[0], v_big[0], nb)

    # the mask: a broadcast of a source that depends on no float value
    pred_atom, pred_roles, causal = None, None, False
    if pred is not None:
        _need(not _mask_depends_on_values(pred, (Q, K, V), eqns, producer))
        pred_atom, pred_roles = pred, tuple(s_named)
        j = producer.get(pred)
        if j is not None and eqns[j].primitive.name == "broadcast_in_dim":
            src = eqns[j].invars[0]
            dims = tuple(eqns[j].params["broadcast_dimensions"])
            if not isinstance(src, compat.Literal):
                pred_atom = src
                pred_roles = tuple(
                    s_named[d] if src.aval.shape[n] != 1 else "u" for n, d in enumerate(dims)
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
    )


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


def decide(match: Match, mode: str, backend: str, compute_dtype: Any) -> tuple[str | None, str]:
    """(implementation or None, reason) for one recognised attention."""
    low = np.dtype(compute_dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
    if mode == "off":
        return None, "attention rewrite off (Policy(attention='off'))"
    if not low:
        return None, f"compute dtype {np.dtype(compute_dtype).name}: fused attention needs bf16/f16"
    if mode == "xla":
        return "xla", "fused attention, XLA implementation (Policy(attention='xla'))"
    if mode == "auto" and backend != "gpu":
        return None, f"no fused attention kernel on {backend}: left as written"
    h, hv = match.sizes["H"], match.sizes["Hv"]
    limit = _cudnn_head_dim_limit()
    if h != hv:
        return None, f"head dims of q/k ({h}) and v ({hv}) differ: cuDNN needs them equal"
    if h % 8 or h > limit:
        return None, f"head dim {h}: cuDNN needs a multiple of 8 and at most {limit}"
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


__all__: Sequence[str] = ("Match", "decide", "find")
