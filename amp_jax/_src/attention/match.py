"""What runs: one recognised attention (`Match`) and its evaluation.

`Match` records where a recognised attention's operands are in the jaxpr
(q, k, v, mask and bias atoms, the dims' roles) and `Match.evaluate` builds
it at run time, from the values the evaluator reads: one call of
``jax.nn.dot_product_attention`` on compute-dtype operands, laid out as the
second matmul's output. `NearMiss`: a softmax between two matmuls that cannot
be taken, with its reason. Recognition (``recognise.py``) makes both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from amp_jax._src import compat
from amp_jax._src.backends import AttentionImpl


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
