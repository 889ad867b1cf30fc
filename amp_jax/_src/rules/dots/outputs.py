"""What the planner asks of the dot family: the dtype a lowered ``allow`` op
writes, and the reason a rule of ``Policy.rules`` gives for a dot it lowered.

`allow_output_dtype` reads ``Policy.allow_outputs`` against the `Backend`
record (bf16 results where the backend's kernels write them fast, float32
elsewhere); `rule_reason` says whether the rule's dot runs in fp8
(``float8.reason``) or in the rule's compute dtype.
"""

from __future__ import annotations

import numpy as np

from amp_jax._src import compat
from amp_jax._src.backends import Backend
from amp_jax._src.decision import Reason, Variant, Why
from amp_jax._src.policy import HIGH_DTYPE, Policy
from amp_jax._src.rules.dots import float8


def allow_output_dtype(policy: Policy, backend: Backend) -> np.dtype:
    """The dtype ``allow`` ops write on ``backend`` (``Policy.allow_outputs``)."""
    low = policy.allow_outputs == "compute" or (
        policy.allow_outputs == "auto" and backend.low_outputs
    )
    return policy.compute_dtype if low else HIGH_DTYPE


def rule_reason(
    text: str, policy: Policy, backend: Backend, eqn: compat.Eqn, variant: Variant
) -> Reason:
    """Why an ``allow`` eqn that a rule of ``Policy.rules`` (described by
    ``text``) lowered runs as it does: in fp8 or in ``policy``'s compute dtype
    (``policy``: the one the rule's target makes, `planning.rule_policy`)."""
    fp8 = float8.reason(policy, backend, eqn, variant)
    if fp8 is not None:
        return Reason(Why.RULE, f"{text}: {fp8.text}")
    cd = policy.compute_dtype.name
    return Reason(Why.RULE, f"{text}: runs in {cd} (float32 accumulation)")
