"""What amp asks of a backend, and each backend's answers.

The general rules (``rules/``, planning) never test a backend's
name: they read its `Backend` record. Which dots it runs in the compute dtype
(`Backend.has_low_kernel`), how a lowered dot is written for it (`Backend.dot`:
XLA:CPU's operand layouts, ``cpu.py``), the layouts chosen per dot when a
jaxpr is planned (`Backend.plan_layouts`), which dtype ``allow`` ops write and which
ops stay float32 (the tables below), fp8 matmuls and fused attention
(``gpu.py``: cuDNN's limits and its trace-time probe, `Backend.attention`).

One `Backend` record is resolved per trace (`current`: the process's default
backend, or the one a `use` block injects) and handed down: it is part of the
trace cache key, so a trace made under an injected record is never reused
outside it. No module outside ``backends/`` looks a backend up by name.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from amp_jax._src import compat
from amp_jax._src.backends import cpu, gpu
from amp_jax._src.backends.cpu_bf16 import CpuBf16Support as CpuBf16Support
from amp_jax._src.backends.cpu_bf16 import cpu_bf16_support as cpu_bf16_support
from amp_jax._src.backends.gpu import AttentionImpl as AttentionImpl


def plain_dot(
    a: jax.Array,
    b: jax.Array,
    dims: lax.DotDimensionNumbers,
    precision: lax.PrecisionLike,
    acc: DTypeLike | None,
    out_sharding: jax.sharding.Sharding | None = None,
) -> jax.Array:
    """A lowered ``dot_general`` as written (backends without layout needs)."""
    extra = {} if out_sharding is None else {"out_sharding": out_sharding}
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=acc, **extra)


def _always(eqn: compat.Eqn) -> bool:
    return True


def _never() -> bool:
    return False


def _no_layouts(
    jaxpr: compat.Jaxpr, lowered: Mapping[int, Any], skip: Collection[int] = ()
) -> dict[int, Any]:
    return {}


@dataclasses.dataclass(frozen=True, repr=False)
class Backend:
    """What amp needs to know of one backend (a platform name: ``"cpu"``, ``"gpu"``, ...).

    Attributes:
      name: the platform name.
      low_outputs: ``allow`` ops write the compute dtype under
        ``Policy(allow_outputs="auto")`` (bf16 results, float32 accumulation
        inside the kernel); else float32.
      slow_in_low_precision: primitives measured slower in the compute dtype
        than in float32; with ``Policy(backend_aware=True)`` they stay float32.
      fused_attention: ``Policy(attention="auto")`` fuses attention here (cuDNN).
      runs_low: ``runs_low(eqn)``: whether a ``dot_general`` eqn with
        compute-dtype operands has a kernel; planning keeps it float32 if not.
      dot: ``dot(a, b, dims, precision, acc, out_sharding)``: a lowered dot
        written in the layouts the backend runs fast.
      plan_layouts: ``plan_layouts(jaxpr, lowered, skip)``: the layout
        records of a planned jaxpr's lowered dots, by eqn index (XLA:CPU:
        ``cpu.DotLayout``), stored in the plan; none elsewhere.
      native_float8_matmul: ``native_float8_matmul()``: whether the matmul
        units take fp8 operands.
      bf16_dots: whether a bfloat16 dot pays here (XLA:CPU: `cpu_bf16_support`,
        decided once per process and part of this record, hence of the trace
        cache key); None where it does (GPUs, TPUs).
      low_elementwise: whether elementwise ops compute in a 16-bit float dtype
        here (GPUs, TPUs). False on XLA:CPU, which has no bfloat16 or float16
        elementwise kernels: it computes each such op in float32 with a
        convert each way, which costs compile time and precision and buys no
        speed. Where False, ``Policy(backend_aware=True)`` keeps ``follow`` ops
        out of the compute dtype (`elementwise_in_float32`); the matmuls still
        run low, and a value they read is cast once.
      clear_in_float32: the clear (data-movement, max/min, select) primitives
        the backend computes in float32 like its elementwise ops where
        `low_elementwise` is False (XLA:CPU: ``cpu.CLEAR_IN_F32``); they are
        then not painted low either, so a value is cast once, after them.
    """

    name: str
    low_outputs: bool = False
    slow_in_low_precision: frozenset[str] = frozenset()
    fused_attention: bool = False
    runs_low: Callable[[compat.Eqn], bool] = _always
    dot: Callable[..., Any] = plain_dot
    plan_layouts: Callable[..., dict[int, Any]] = _no_layouts
    native_float8_matmul: Callable[[], bool] = _never
    bf16_dots: CpuBf16Support | None = None
    low_elementwise: bool = True
    clear_in_float32: frozenset[str] = frozenset()

    def has_low_kernel(self, eqn: compat.Eqn) -> bool:
        """Whether ``eqn`` (an ``allow`` op on managed floats) has a kernel here
        with compute-dtype operands: planning keeps it float32 if not."""
        return eqn.primitive.name != "dot_general" or self.runs_low(eqn)

    def slower_low(self, name: str, dtype: DTypeLike) -> str | None:
        """Why primitive ``name`` runs slower with ``dtype`` operands here than in
        float32 (``Policy(backend_aware=True)`` keeps it as written), or None:
        a primitive of `slow_in_low_precision`, or a dot in bfloat16 where
        `bf16_dots` says it does not pay."""
        if name in self.slow_in_low_precision:
            return f"{name} is slower in {np.dtype(dtype).name} on {self.name}"
        if (
            name in _DOTS
            and self.bf16_dots is not None
            and not self.bf16_dots.pays
            and np.dtype(dtype) == np.dtype(jax.numpy.bfloat16)
        ):
            return self.bf16_dots.reason
        return None

    def lowers_nothing(self, allow: Collection[str], dtype: DTypeLike) -> bool:
        """Whether every primitive of ``allow`` runs slower with ``dtype``
        operands here (`slower_low`): where so, a backend-aware policy lowers
        no op (XLA:CPU without bfloat16 dot instructions, a bfloat16 policy)."""
        return all(self.slower_low(name, dtype) is not None for name in allow)

    def elementwise_in_float32(self, dtype: DTypeLike) -> str | None:
        """Why elementwise ops with ``dtype`` operands are computed in float32
        here (`low_elementwise` is False), or None where they run in ``dtype``."""
        if self.low_elementwise:
            return None
        return cpu.ELEMENTWISE_IN_F32.format(dtype=np.dtype(dtype).name)

    def attention(
        self, head_dim: int, tq: int, tk: int, needs_even: bool, probe: Callable[[], object]
    ) -> tuple[AttentionImpl | None, str]:
        """``(implementation or None, reason)`` for a recognised attention that
        the policy asks to fuse with cuDNN (``gpu.cudnn_attention``: its limits,
        then ``probe()``, which raises where cuDNN refuses the call at trace time)."""
        return gpu.cudnn_attention(
            self.name, self.fused_attention, head_dim, tq, tk, needs_even, probe
        )

    def __repr__(self) -> str:  # (a primitive parameter: printed in jaxprs)
        return f"Backend({self.name!r})"


#: the matmul primitives `Backend.bf16_dots` speaks for
_DOTS = frozenset({"dot_general", "ragged_dot_general", "ragged_dot"})

_BACKENDS = {
    "cpu": Backend(
        "cpu",
        slow_in_low_precision=cpu.SLOW_IN_LOW_PRECISION,
        runs_low=cpu.runs_low,
        dot=cpu.dot,
        plan_layouts=cpu.plan_layouts,
        low_elementwise=False,
        clear_in_float32=cpu.CLEAR_IN_F32,
    ),
    "gpu": Backend(
        "gpu",
        low_outputs=True,
        fused_attention=True,
        native_float8_matmul=gpu.native_float8_matmul,
    ),
}


def backend_for(name: str) -> Backend:
    """The `Backend` record of platform ``name`` (a plain one for platforms
    amp has nothing special for, e.g. ``"tpu"``). The CPU's record holds
    `cpu_bf16_support`'s decision (made at the first call, then cached)."""
    if name == "cpu":
        return _cpu_record(cpu_bf16_support())
    found = _BACKENDS.get(name)
    return found if found is not None else Backend(name)


@functools.cache
def _cpu_record(support: CpuBf16Support) -> Backend:
    return dataclasses.replace(_BACKENDS["cpu"], bf16_dots=support)


_INJECTED: contextvars.ContextVar[Backend | None] = contextvars.ContextVar(
    "amp_jax_backend", default=None
)


def current() -> Backend:
    """The `Backend` record amp plans for now: the one a `use` block injected,
    else the record of ``jax.default_backend()``. Read once per call (the trace
    cache key holds it) and handed down with the planning configuration."""
    injected = _INJECTED.get()
    return injected if injected is not None else backend_for(jax.default_backend())


@contextlib.contextmanager
def use(backend: Backend) -> Iterator[Backend]:
    """Plan for ``backend`` inside the block (what tests inject: e.g. native fp8
    products on CPU, ``dataclasses.replace(current(), native_float8_matmul=lambda:
    True)``). The record is part of amp's trace cache key: a trace made inside
    the block is not reused outside it, nor the other way round."""
    if not isinstance(backend, Backend):
        raise TypeError(f"backends.use takes a Backend record, got {type(backend).__name__}.")
    token = _INJECTED.set(backend)
    try:
        yield backend
    finally:
        _INJECTED.reset(token)


#: (primitive, backend) pairs measured slower in low precision than float32;
#: with ``backend_aware=True`` these stay float32. See benchmarks/results/RESULTS.md.
BACKEND_SLOW_IN_LOW_PRECISION: frozenset[tuple[str, str]] = frozenset(
    (p, b.name) for b in _BACKENDS.values() for p in b.slow_in_low_precision
)
"""(primitive, backend) pairs measured slower in low precision than in float32; with ``Policy(backend_aware=True)`` they stay float32."""


#: Backends where ``allow`` ops write the compute dtype under
#: ``Policy(allow_outputs="auto")``; elsewhere they write float32.
#: Measured: benchmarks/results/RESULTS_GPU.md (H100) and benchmarks/results/RESULTS.md (CPU).
BACKEND_LOW_OUTPUTS: frozenset[str] = frozenset(b.name for b in _BACKENDS.values() if b.low_outputs)
"""Backends where ``allow`` ops write the compute dtype (bf16 results, float32 accumulation inside the kernel) under ``Policy(allow_outputs="auto")``."""
