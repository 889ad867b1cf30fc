"""A private hook for testing amp itself: its interpreter forced on at float32.

``amp(fn, policy="float32")`` is the identity: `AmpFunction` calls ``fn``
itself. To test the interpreter on programs whose results are known (JAX's
own test suite, ``benchmarks/jax_suite.py``), `interpreted_float32` runs the
whole path instead -- trace, plan with every rule, evaluate under the
caller's trace -- with float32 as the compute dtype, so every equation is
re-bound (higher-order ones through their rules) and no dtype changes.
Not public API.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from amp_jax._src.policy import Policy
from amp_jax._src.transform import AmpFunction


@dataclasses.dataclass(frozen=True)
class InterpretedPolicy(Policy):
    """A float32 `Policy` that amp does not treat as the identity: the
    allow/deny/follow rules all run, and their casts to float32 change nothing."""

    @property
    def is_identity(self) -> bool:
        return False


#: the policy of `interpreted_float32`: no size threshold, so that every dot
#: and convolution goes through its allow rule, however small
INTERPRETED_FLOAT32 = InterpretedPolicy(
    compute_dtype=np.dtype(np.float32), min_low_contraction=0, min_low_flops=0
)


def interpreted_float32(fn: Callable[..., Any]) -> AmpFunction:
    """``fn`` under amp's interpreter at float32 (never the identity shortcut)."""
    return AmpFunction(fn, INTERPRETED_FLOAT32)
