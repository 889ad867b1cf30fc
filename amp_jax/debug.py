"""Debugging mixed precision: find the first overflow, measure underflow.

``first_nonfinite`` runs the program [`amp_jax.amp`][amp_jax.amp] makes and reports
the first op whose output became inf or NaN, with its source line, the dtype
it ran in, what the float32 program computed there, and a fix.
``underflow_report`` measures how much of a loss's gradient a low-precision
dtype flushes to zero at a given loss scale. See also [`amp_jax.explain`][amp_jax.explain]
and [`amp_jax.optim.loss_scale_stats`][amp_jax.optim.loss_scale_stats].
"""

from amp_jax._src.diagnostics.nonfinite import FirstNonfinite as FirstNonfinite
from amp_jax._src.diagnostics.nonfinite import first_nonfinite as first_nonfinite
from amp_jax._src.diagnostics.underflow import UnderflowReport as UnderflowReport
from amp_jax._src.diagnostics.underflow import UnderflowRow as UnderflowRow
from amp_jax._src.diagnostics.underflow import underflow_report as underflow_report

__all__ = [
    "FirstNonfinite",
    "UnderflowReport",
    "UnderflowRow",
    "first_nonfinite",
    "underflow_report",
]
