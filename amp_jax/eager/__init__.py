"""Eager optimizer updates: apply the optimizer inside the backward pass.

For models written as ``embed -> lax.scan over identical blocks -> head + loss``,
[`scan_step`][amp_jax.eager.scan_step] builds a training step whose backward pass is a reverse loop
over the layers that updates each layer's parameters (and optimizer state) as
soon as that layer's gradient is ready, so the gradient of the whole block
stack never exists. See ``docs/eager.md``.
"""

from amp_jax.eager._scan_step import ScanStep as ScanStep
from amp_jax.eager._scan_step import ScanStepState as ScanStepState
from amp_jax.eager._scan_step import scan_step as scan_step

__all__ = [
    "ScanStep",
    "ScanStepState",
    "scan_step",
]
