"""A program evaluated eagerly, eqn by eqn, with a `Probe` watching every first-order
eqn's outputs: ``scan``, ``while``, ``cond`` and call-like primitives (``jit``,
``checkpoint``, ``custom_jvp``/``custom_vjp``) are entered, so what the probe sees
is a first-order op with its source line (what `first_nonfinite` reads)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from amp_jax._src import compat, jaxprs
from amp_jax._src.diagnostics.reasons import (
    full_stack,
)
from amp_jax._src.policy import is_managed_float


class Stop(Exception):
    pass


def is_float_array(x: object) -> bool:
    return hasattr(x, "dtype") and is_managed_float(x.dtype)


def is_finite(x: jax.Array) -> bool:
    return bool(jnp.all(jnp.isfinite(x)))


def max_abs(xs: Sequence[Any]) -> float | None:
    vals = [
        float(jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0).astype(jnp.float32)))
        for x in xs
        if is_float_array(x) and x.size
    ]
    return max(vals) if vals else None


@dataclasses.dataclass(frozen=True)
class Hit:
    """The first op whose output became non-finite while its inputs were finite."""

    eqn: Any
    src: Any  # for a cast: the first-order eqn whose result it casts, else None
    stack: str
    kind: str  # "inf", "nan" or "inf and nan"
    input_max_abs: float | None
    out_dtype: str


class Probe:
    """Watches every first-order eqn's outputs during an eager evaluation."""

    def __init__(self, stop_at_first: bool):
        self.stop_at_first = stop_at_first
        self.first: Hit | None = None
        #: (source line, primitive) -> [max |finite output|, any non-finite output]
        self.ranges: dict[tuple[str, str], list[Any]] = {}
        #: id(value) -> (value, the first-order eqn that produced it), to trace
        #: a cast back to the op whose result it casts (values keep their
        #: identity through calls and bodies; the value is kept alive with it)
        self.producer: dict[int, tuple[Any, Any]] = {}

    def check(
        self, eqn: compat.Eqn, stack: str, invals: Sequence[Any], outs: Sequence[Any]
    ) -> None:
        floats = [o for o in outs if is_float_array(o)]
        if not floats:
            return
        key = (compat.source_line(eqn), eqn.primitive.name)
        finite = all(is_finite(o) for o in floats)
        entry = self.ranges.setdefault(key, [0.0, False])
        entry[0] = max(entry[0], max_abs(floats) or 0.0)
        entry[1] = entry[1] or not finite
        if finite or self.first is not None:
            return
        if not all(is_finite(x) for x in invals if is_float_array(x)):
            return  # propagated from an earlier op
        bad = next(o for o in floats if not is_finite(o))
        kinds = [k for k, f in (("inf", jnp.isinf), ("nan", jnp.isnan)) if bool(jnp.any(f(bad)))]
        src = None
        if eqn.primitive.name == "convert_element_type" and invals:
            src = self.producer.get(id(invals[0]), (None, None))[1]
        self.first = Hit(
            eqn=eqn,
            src=src,
            stack=stack,
            kind=" and ".join(kinds),
            input_max_abs=max_abs(invals),
            out_dtype=str(bad.dtype),
        )
        if self.stop_at_first:
            raise Stop


def run_closed(
    closed: compat.ClosedJaxpr, args: Sequence[Any], stack: tuple[str, ...], probe: Probe
) -> list[Any]:
    """``closed`` evaluated eagerly on ``args``, every first-order eqn's outputs
    checked by ``probe`` (``stack``: the name stacks of the enclosing eqns)."""

    def probing(i: int, eqn: compat.Eqn, env: jaxprs.Env) -> Sequence[Any]:
        invals = env.operands(eqn)
        outs = _unrolled(eqn, invals, (*stack, str(eqn.source_info.name_stack)), probe)
        if outs is None:
            outs = compat.bind_eqn(eqn, invals)
            probe.check(eqn, full_stack(eqn, stack), invals, outs)
        for o in outs:
            probe.producer.setdefault(id(o), (o, eqn))
        return outs

    jaxpr, consts = jaxprs.open_jaxpr(closed)
    return jaxprs.eval_jaxpr(jaxpr, consts, args, probing)


def _unrolled(
    eqn: compat.Eqn, invals: list[Any], stack: tuple[str, ...], probe: Probe
) -> list[Any] | None:
    """A higher-order eqn evaluated eagerly by running its bodies through
    `run_closed` (a loop's body once per iteration, the taken branch of a
    ``cond``, a call's body), so that the probe sees their first-order eqns;
    None for a first-order eqn or one not entered (it is then bound whole).
    ``scan``/``while``/``cond`` would trace their bodies abstractly if bound."""
    name, p = eqn.primitive.name, eqn.params
    if name == "scan":
        nc, ncarry = compat.scan_split(p)
        length = int(p["length"])
        if length == 0:
            return None
        consts, carry, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
        ys: list[list[Any]] = []
        for i in reversed(range(length)) if p.get("reverse") else range(length):
            outs = run_closed(p["jaxpr"], [*consts, *carry, *(x[i] for x in xs)], stack, probe)
            carry, y = outs[:ncarry], outs[ncarry:]
            ys.append(y)
        if p.get("reverse"):
            ys.reverse()
        stacked = [jnp.stack([y[j] for y in ys]) for j in range(len(ys[0]))] if ys and ys[0] else []
        return [*carry, *stacked]
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, carry = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
        while bool(run_closed(p["cond_jaxpr"], [*cconsts, *carry], stack, probe)[0]):
            carry = run_closed(p["body_jaxpr"], [*bconsts, *carry], stack, probe)
        return carry
    if name == "cond":
        index = int(invals[0])
        return run_closed(p["branches"][index], invals[1:], stack, probe)
    sub = jaxprs.called_jaxpr(eqn)  # jit, checkpoint, custom_jvp/vjp calls, closed_call
    return None if sub is None else run_closed(sub, invals, stack, probe)
