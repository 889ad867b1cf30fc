"""The decision: which recognised attentions run fused, and why (`plan_attention`).

`plan_attention` finds the attentions of a jaxpr (``recognise.find``) and
`decide` chooses per attention from the policy's mode, the compute dtype and
the `Backend` record (which holds cuDNN's limits and runs its trace-time
probe, here on zeros of the operands' shapes); the `AttentionPlan` keeps the
fused matches, the log of reasons and each eqn's `AttentionPath`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from amp_jax._src import compat
from amp_jax._src.attention import recognise
from amp_jax._src.attention.match import Match, NearMiss
from amp_jax._src.backends import AttentionImpl, Backend
from amp_jax._src.decision import AttentionPath


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
    for i, match in recognise.find(jaxpr, consts, near).items():
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
