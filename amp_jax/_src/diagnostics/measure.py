"""What a program computes and moves, op by op: FLOPs, bytes, and the ops XLA
removes because nothing reads them (read by `explain`, `dtype_report` and
`compiled_report`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from jax.extend import core as jex_core

from amp_jax._src import compat, jaxprs
from amp_jax._src.jaxprs import open_jaxpr
from amp_jax._src.op_classes import DEFAULT_ALLOW
from amp_jax._src.policy import is_managed_float

#: primitives that move data without arithmetic (0 FLOPs).
_NO_FLOPS = frozenset(
    {
        "reshape",
        "broadcast_in_dim",
        "transpose",
        "convert_element_type",
        "squeeze",
        "expand_dims",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "concatenate",
        "gather",
        "scatter",
        "pad",
        "rev",
        "copy",
        "copy_p",
        "iota",
        "select_n",
        "reduce_precision",
        "stop_gradient",
        "device_put",
        "bitcast_convert_type",
        "sharding_constraint",
        "split",
        "optimization_barrier",
    }
)
#: primitives whose FLOPs are one per *input* element.
_REDUCTIONS = frozenset(
    {
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "argmax",
        "argmin",
        "cumsum",
        "cumprod",
        "cummax",
        "cummin",
        "cumlogsumexp",
        "reduce_and",
        "reduce_or",
    }
)
#: the matmuls and convolutions, whose FLOPs the summary also counts apart.
MATMULS = DEFAULT_ALLOW


# -- per-eqn measures -----------------------------------------------------------------


def _size(aval: compat.AbstractValue | None) -> int:
    return int(math.prod(getattr(aval, "shape", ())))


def _nbytes(aval: compat.AbstractValue) -> int:
    dtype = getattr(aval, "dtype", None)
    try:
        return _size(aval) * np.dtype(dtype).itemsize
    except TypeError:  # key types, tokens
        return 0


def eqn_bytes(eqn: compat.Eqn, memo: dict[Any, int]) -> int:
    """Bytes ``eqn`` reads and writes once (``memo``: by aval, for a whole program)."""
    total = 0
    for v in (*eqn.invars, *eqn.outvars):
        aval = v.aval
        try:
            n = memo[aval]
        except KeyError:
            n = memo[aval] = _nbytes(aval)
        except TypeError:  # an unhashable aval
            n = _nbytes(aval)
        total += n
    return total


def eqn_flops(eqn: compat.Eqn) -> int:
    """Floating-point operations of one first-order eqn (a multiply-add is 2)."""
    name = eqn.primitive.name
    out = eqn.outvars[0].aval if eqn.outvars else None
    sizes = jaxprs.contraction_and_flops(eqn)
    if sizes is not None:
        return sizes[1]
    if name in _NO_FLOPS or out is None or not is_managed_float(getattr(out, "dtype", None)):
        if name not in _REDUCTIONS:
            return 0
    if name in _REDUCTIONS:
        return _size(eqn.invars[0].aval)
    return _size(out)


def unused_eqns(jaxpr: compat.ClosedJaxpr | compat.Jaxpr) -> frozenset[int]:
    """The ids of the eqns of ``jaxpr`` and its sub-jaxprs whose results nothing
    reads (no effects either): XLA removes them. A sub-jaxpr of a used eqn has
    all its outputs read; every eqn of an unused one is unused."""
    unused: set[int] = set()
    used: set[int] = set()

    def walk(j: compat.ClosedJaxpr | compat.Jaxpr, alive: bool) -> None:
        needed = {v for v in j.outvars if not isinstance(v, compat.Literal)} if alive else set()
        for eqn in reversed(j.eqns):
            live = alive and (
                bool(eqn.effects)
                or any(not compat.is_drop_var(v) and v in needed for v in eqn.outvars)
            )
            (used if live else unused).add(id(eqn))
            if live:
                needed.update(v for v in eqn.invars if not isinstance(v, compat.Literal))
            for sub in jex_core.jaxprs_in_params(eqn.params):
                walk(open_jaxpr(sub)[0], live)

    walk(jaxpr, True)
    return frozenset(unused - used)
