"""``compiled_report``: what XLA compiled and ran, against what amp planned.

[`explain`][amp_jax.explain] reads amp's plan and the jaxpr amp hands to XLA;
XLA may still change the element types: a backend without bf16 collectives or
float8 matmuls upcasts them (XLA:CPU's float normalization), a pass removes or
merges an op. This module compiles the program with public JAX API only
(``jax.jit(...).lower(...).compile(compiler_options=...)``) and reads the HLO
text of two programs (hlo.py parses them):

* ``partitioned``: the program compiled with this backend's precision passes
  turned off (``xla_disable_hlo_passes``: float normalization, the operand
  upcaster, change-op-data-type): the element types the SPMD partitioner gave
  each op, which a backend that runs them natively (GPU, TPU) keeps. JAX has
  no public API for the module right after SPMD partitioning; for the FSDP
  step of workloads/sharded.py this program's collectives are those of XLA's
  own dump after its ``spmd-partitioning`` pass (tests/test_compiled_report.py).
  Where the backend cannot compile a type at all (XLA:CPU has no float8 dot),
  the passes for that type stay on and the report says so.
* ``final``: the optimized program this backend runs (``Compiled.as_text()``).

Each matmul and convolution of the amp program (its jaxpr, as ``explain``
walks it) is matched to the HLO ops of the same source line, pass (forward or
backward) and kind; collectives are matched between the two programs by kind
and shape. A row whose compiled element types differ from amp's plan, or an
op XLA removed, is a disagreement, with the reason inferred from the two
programs.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from typing import Any

import jax
from jax.typing import DTypeLike

from amp_jax._src.diagnostics.compiled_rows import (
    CompiledRow,
    collective_rows,
    op_rows,
    planned_by_key,
    reasons_by_key,
)
from amp_jax._src.diagnostics.explain import explain
from amp_jax._src.diagnostics.hlo import KINDS, hlo_ops, shape_bytes
from amp_jax._src.diagnostics.tracing import check_grad, flat_call, loss_of, split_fn
from amp_jax._src.policy import Policy
from amp_jax._src.transform import AmpFunction

#: the low-precision float types XLA may normalize (HLO names)
_NORMALIZED: tuple[str, ...] = (
    "bf16",
    "f16",
    "f8e4m3fn",
    "f8e5m2",
    "f8e4m3fnuz",
    "f8e5m2fnuz",
    "f8e4m3",
)
_NORMALIZED += ("f8e3m4", "f8e8m0fnu", "f4e2m1fn")
#: the XLA passes that change an op's element types for the backend's sake
PRECISION_PASSES: tuple[str, ...] = (
    "operand_upcaster",
    "change-op-data-type",
    *(f"float-normalization-{t}" for t in _NORMALIZED),
)
_UNSUPPORTED = re.compile(r"unsupported (?:operand|result)? ?type (\w+)", re.I)


class PrecisionMismatchError(AssertionError):
    """[`compiled_report`][amp_jax.compiled_report]``(strict=...)``: the compiled
    program does not run as amp planned. ``.report`` holds the whole report."""

    def __init__(self, message: str, report: CompiledReport):
        super().__init__(message)
        self.report = report


class CompiledReport:
    """What [`compiled_report`][amp_jax.compiled_report] returns.

    ``str(report)`` is an aligned table of the rows, disagreements first.

    Attributes:
      rows: the [`CompiledRow`][amp_jax.CompiledRow] groups: matmuls,
        convolutions and attention first, then collectives.
      backend: the platform XLA compiled for (``cpu``, ``gpu``, ``tpu``).
      kept_passes: the precision passes left on after partitioning because the
        backend cannot compile the types without them (empty on a backend that
        runs every type), with the compiler's message.
      partitioned_text: the HLO text of the program after partitioning.
      final_text: the HLO text of the optimized program.
    """

    def __init__(
        self,
        rows: list[CompiledRow],
        backend: str,
        kept_passes: dict[str, str],
        partitioned_text: str,
        final_text: str,
    ):
        self.rows = rows
        self.backend = backend
        self.kept_passes = kept_passes
        self.partitioned_text = partitioned_text
        self.final_text = final_text

    @property
    def disagreements(self) -> list[CompiledRow]:
        """The rows that do not run as amp planned."""
        return [r for r in self.rows if not r.agrees]

    def collectives(self, stage: str = "final") -> dict[tuple[str, str], list[int]]:
        """``{(kind, element type): [count, bytes]}`` of the collectives of one program.

        Args:
          stage: ``"partitioned"`` or ``"final"``.

        Returns:
          Counts and result bytes by kind and HLO element type (a combined
          collective counts once, under its first result's type; its bytes go
          to each result's type).
        """
        if stage not in ("partitioned", "final"):
            raise ValueError(f"stage must be 'partitioned' or 'final', got {stage!r}.")
        text = self.partitioned_text if stage == "partitioned" else self.final_text
        out: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
        for op in hlo_ops(text):
            if op.kind != "collective":
                continue
            for part in op.shape.split(", "):
                out[op.opcode, part.split("[")[0]][1] += shape_bytes(part)
            out[op.opcode, op.result][0] += 1
        return dict(out)

    def format(self, width: int | None = 120) -> str:
        """The rows as an aligned text table, disagreements first."""
        header = ("source line", "pass", "op", "planned", "partitioned", "final", "n", "reason")
        rows = sorted(self.rows, key=lambda r: (r.agrees, KINDS.index(r.kind), r.where))
        table = [header] + [
            (
                r.where,
                "bwd" if r.backward else "fwd",
                r.op,
                r.planned,
                r.partitioned,
                r.final,
                str(r.count),
                r.reason or "agrees",
            )
            for r in rows
        ]
        widths = [max(len(t[i]) for t in table) for i in range(len(header) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(t, widths)) + "  " + t[-1] for t in table]
        if width is not None:
            lines = [line if len(line) <= width else line[: width - 3] + "..." for line in lines]
        n = len(self.disagreements)
        tail = f"{len(self.rows)} rows on {self.backend}, {n} not as amp planned"
        if self.kept_passes:
            tail += "; kept on after partitioning: " + ", ".join(self.kept_passes)
        return "\n".join([*lines, "", tail])

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        return f"CompiledReport({len(self.rows)} rows, {len(self.disagreements)} disagreements)"


# -- the two programs ------------------------------------------------------------------


def _compile_partitioned(lowered: Any) -> tuple[str, dict[str, str]]:
    """The HLO text of ``lowered`` compiled with `PRECISION_PASSES` off, and the
    passes left on because the backend cannot compile a type without them: those
    of the type the compiler names, else the upcasters, else every one."""
    off = list(PRECISION_PASSES)
    kept: dict[str, str] = {}
    while True:
        try:
            opts = {"xla_disable_hlo_passes": ",".join(off)}
            return lowered.compile(compiler_options=opts).as_text() or "", kept
        except jax.errors.JaxRuntimeError as e:
            if not off:
                raise
            m = _UNSUPPORTED.search(str(e))
            dtype = m.group(1).lower() if m else None
            fix = [p for p in off if dtype and p.endswith(f"-{dtype}")]
            fix += [p for p in ("operand_upcaster", "change-op-data-type") if p in off]
            for p in fix or list(off):
                off.remove(p)
                kept[p] = str(e).strip().splitlines()[0][:160]


# -- the report ------------------------------------------------------------------------


def compiled_report(
    fn: Callable[..., Any],
    *args: Any,
    policy: Policy | str | DTypeLike | None = None,
    grad: bool | int | tuple[int, ...] = False,
    has_aux: bool = False,
    strict: bool | Callable[[CompiledRow], bool] = False,
    **kwargs: Any,
) -> CompiledReport:
    """What XLA compiled from ``fn(*args, **kwargs)`` under amp, against amp's plan.

    Compiles the program (with ``grad``, its ``value_and_grad``) with
    ``jax.jit(...).lower(...).compile()`` and reports, per matmul, convolution
    and attention call (cuBLASLt float8 GEMMs and cuDNN attention are custom
    calls on a GPU) and per collective, the element types XLA runs at two
    points: after SPMD partitioning (what a GPU or TPU runs and moves) and in
    the final program of this backend. Each matmul and convolution is matched
    to the ops of amp's program with its source line and pass; a group whose
    compiled types differ from amp's, or that XLA removed, is a disagreement
    with the reason the two programs show (an upcast on this backend, a
    removed or merged op, a type the backend cannot compile). Call it under
    ``jax.set_mesh`` with sharded arguments to see a sharded program's
    collectives.

    Args:
      fn: the float32 function (with ``policy``), an [`amp`][amp_jax.amp]
        function, or any function of arrays (``policy=None``: compiled as it
        is, with nothing planned to compare: a training step with amp inside).
      *args: its positional arguments (arrays, possibly sharded).
      policy: the policy (default: ``fn``'s if it is an amp function).
      grad: ``True`` (or argnums) to compile ``jax.value_and_grad`` of ``fn``.
      has_aux: ``fn`` returns ``(loss, aux)``.
      strict: ``True`` raises [`PrecisionMismatchError`][amp_jax.PrecisionMismatchError]
        when any row disagrees; a predicate on [`CompiledRow`][amp_jax.CompiledRow]
        raises for the disagreeing rows it selects (e.g. ``lambda r: r.kind ==
        "matmul"``).
      **kwargs: keyword arguments of ``fn``.

    Returns:
      A [`CompiledReport`][amp_jax.CompiledReport].

    Raises:
      PrecisionMismatchError: with ``strict``, a selected row disagrees.

    Examples:
      >>> import jax.numpy as jnp
      >>> import amp_jax
      >>> def f(w, x):
      ...     return jnp.sum(jnp.tanh(x @ w))
      >>> w, x = jnp.ones((256, 256)), jnp.ones((64, 256))
      >>> rep = amp_jax.compiled_report(f, w, x, policy="bfloat16")
      >>> [(r.op, r.planned, r.agrees) for r in rep.rows]
      [('dot', 'bf16,bf16', True)]
    """
    if not (isinstance(strict, bool) or callable(strict)):
        raise TypeError(f"strict must be a bool or a predicate on CompiledRow, got {strict!r}.")
    g = check_grad(grad)
    planned = policy is not None or isinstance(fn, AmpFunction)
    if planned:
        base, pol = split_fn(fn, policy)
        base = loss_of(base, has_aux, "compiled_report", g is not None)
        run: Callable[..., Any] = AmpFunction(base, pol)
    else:
        run = loss_of(fn, has_aux, "compiled_report", g is not None)
    call, dyn = flat_call(run, args, kwargs, g)
    lowered = jax.jit(call).lower(*dyn)
    final_text = lowered.compile().as_text() or ""
    part_text, kept = _compile_partitioned(lowered)
    plan, reasons = {}, {}
    if planned:
        plan = planned_by_key(jax.make_jaxpr(call)(*dyn))
        reasons = reasons_by_key(explain(base, *args, policy=pol, grad=grad, **kwargs))
    backend = jax.default_backend()
    part, final = hlo_ops(part_text), hlo_ops(final_text)
    rows = op_rows(plan, reasons, part, final, backend, kept)
    rows += collective_rows(part, final, backend)
    report = CompiledReport(rows, backend, kept, part_text, final_text)
    _check(report, strict)
    return report


def _check(report: CompiledReport, strict: bool | Callable[[CompiledRow], bool]) -> None:
    if strict is False:
        return
    bad = [r for r in report.disagreements if strict is True or (callable(strict) and strict(r))]
    if bad:
        lines = [
            f"  {r.where} {'bwd' if r.backward else 'fwd'} {r.op}: planned {r.planned}, "
            f"ran {r.final}: {r.reason}"
            for r in bad
        ]
        raise PrecisionMismatchError(
            f"compiled_report(strict=...): {len(bad)} group(s) of ops did not run as amp "
            "planned:\n" + "\n".join(lines) + "\n(report.rows has them all; a predicate as "
            "strict= selects the rows to check)",
            report,
        )
