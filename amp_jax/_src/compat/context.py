"""Where an op is bound: the source info, name stack and ``ctx`` an eqn carries, the
user's source line, what can change a trace besides its arguments (config, named axes,
mesh), 64-bit scopes and explicit-mode shardings."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.extend import source_info_util
from jax.typing import ArrayLike

from amp_jax._src.compat.jaxpr import Eqn, ShapedArray


def eqn_context(eqn: Eqn) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """Context managers that reproduce ``eqn``'s source info and ctx while binding."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    return (
        source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager,
    )


def eqn_source_line(eqn: Eqn) -> AbstractContextManager[Any]:
    """A context in which ops bound get ``eqn``'s source line (its traceback), in
    the current name stack: for an op amp binds for another eqn than the one
    it evaluates (a dot written at the transpose of its result)."""
    return source_info_util.user_context(
        eqn.source_info.traceback, name_stack=source_info_util.current_name_stack()
    )


def current_name_stack_str() -> str:
    """The ``jax.named_scope`` names the caller is tracing in, joined by ``/``."""
    return str(source_info_util.current_name_stack())


def _axis_env() -> tuple[tuple[str, int], ...]:
    """The named axes in scope (``vmap(axis_name=...)``, ``shard_map``, ``pmap``) and their sizes."""
    names = getattr(jex_core, "unsafe_get_axis_names_DO_NOT_USE", lambda: ())()
    return tuple((n, int(jax.lax.axis_size(n))) for n in names)


def jit_disabled() -> bool:
    """Whether the caller is inside ``jax.disable_jit()`` (jit runs functions as Python)."""
    return bool(jax.config.values["jax_disable_jit"])


def trace_context() -> tuple[Any, ...]:
    """Everything besides the arguments that can change what tracing a function gives.

    What ``jax.jit`` keys its trace cache on (its "trace context"), from public
    API: every config value as the caller sees it (contexts such as
    ``jax.numpy_rank_promotion("raise")`` or ``jax.default_matmul_precision``
    included), the named axes in scope with their sizes (``psum(1, "b")``
    traces to the size of ``b``), and the abstract mesh. Hashable.
    """
    return (
        tuple(jax.config.values.items()),
        _axis_env(),
        jax.sharding.get_abstract_mesh(),
    )


def name_stack_str(eqn: Eqn) -> str:
    return str(source_info_util.current_name_stack() + eqn.source_info.name_stack)


_X64_DTYPES = frozenset(np.dtype(t) for t in ("float64", "int64", "uint64", "complex128"))


def x64_of(eqn: Eqn) -> AbstractContextManager[Any]:
    """``jax.enable_x64()`` when ``eqn`` has a 64-bit operand or result and the
    caller runs without 64-bit types: the eqn was traced inside a user's
    ``with jax.enable_x64():``, so the Python rules JAX runs when it binds
    or differentiates it (a ``custom_vjp``'s forward, a ``custom_jvp``'s
    rule) must run there too, as they do without amp, or they build
    32-bit values a 64-bit primal does not match. Else a null context."""
    if jax.config.values["jax_enable_x64"]:
        return contextlib.nullcontext()
    for v in (*eqn.invars, *eqn.outvars):
        dtype = getattr(v.aval, "dtype", None)
        if dtype is not None and dtype in _X64_DTYPES:
            return jax.enable_x64(True)
    return contextlib.nullcontext()


def source_line(eqn: Eqn) -> str:
    """The user's source line of ``eqn`` (``file:line:col (function)``), or ``"-"``;
    files under the working directory are named relative to it (``train.py:12:5``)."""
    return _line_of(eqn.source_info)


def current_source_line() -> str:
    """The user's source line an op bound now would get (`source_line`)."""
    return _line_of(source_info_util.current())


def _line_of(info: source_info_util.SourceInfo) -> str:
    try:
        where = source_info_util.summarize(info) or "-"
    except Exception:  # no traceback
        return "-"
    cwd = os.getcwd().rstrip(os.sep) + os.sep
    return where[len(cwd) :] if where.startswith(cwd) else where


def explicit_sharding_in_order(x: ArrayLike | ShapedArray, order: Sequence[int]) -> Any:
    """``x``'s (an array's or an aval's) explicit-mode sharding with its dims
    taken in ``order``, or None.

    For a dot that produces an operand's cotangent with its axes in ``order``
    (then transposed back), as JAX's own dot_general transpose rule does: in
    ``AxisType.Explicit`` mode a dot whose contracting dims are sharded needs
    an ``out_sharding``, and the cotangent must be sharded like the operand.
    None unless ``x``'s mesh has an explicit axis (auto, manual or
    single-device): the dot then derives its output sharding as before.
    """
    aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
    s: Any = getattr(aval, "sharding", None)
    spec = getattr(s, "spec", None)
    types = getattr(getattr(s, "mesh", None), "axis_types", None) or ()
    if spec is None or jax.sharding.AxisType.Explicit not in tuple(types):
        return None
    parts = tuple(spec) + (None,) * (len(order) - len(spec))
    return s.update(spec=spec.update(partitions=tuple(parts[o] for o in order)))
