"""amp_jax: automatic mixed precision for JAX.

``amp(fn)`` rewrites the primitives of ``fn`` under a :class:`Policy` so that a
float32 model runs its matmuls and convolutions in bfloat16 or float16 while
numerically sensitive ops stay in float32. ``amp_jax.optim`` holds the optax
transformations low precision needs (loss scaling, master weights, Kahan
summation, stochastic rounding, any-precision AdamW); ``amp_jax.eager`` applies the optimizer inside the
backward pass of scanned models so the full gradient never exists.
"""

from amp_jax._src.policy import (
    BACKEND_LOW_OUTPUTS as BACKEND_LOW_OUTPUTS,
    BACKEND_SLOW_IN_LOW_PRECISION as BACKEND_SLOW_IN_LOW_PRECISION,
    DEFAULT_ALLOW as DEFAULT_ALLOW,
    DEFAULT_CLEAR as DEFAULT_CLEAR,
    DEFAULT_DENY as DEFAULT_DENY,
    DEFAULT_FOLLOW as DEFAULT_FOLLOW,
    DEFAULT_NEVER as DEFAULT_NEVER,
    Policy as Policy,
    get_policy as get_policy,
)
from amp_jax._src.inspect import dtype_report as dtype_report, format_dtype_report as format_dtype_report
from amp_jax._src.explain import (
    Explanation as Explanation,
    ExplainRow as ExplainRow,
    ExplainSummary as ExplainSummary,
    explain as explain,
)
from amp_jax._src.rules import register_rule as register_rule
from amp_jax._src.transform import amp as amp, full_precision as full_precision
from amp_jax import optim as optim
from amp_jax import eager as eager
from amp_jax import debug as debug

__version__ = "0.1.0"

__all__ = [
    "BACKEND_LOW_OUTPUTS",
    "BACKEND_SLOW_IN_LOW_PRECISION",
    "DEFAULT_ALLOW",
    "DEFAULT_CLEAR",
    "DEFAULT_DENY",
    "DEFAULT_FOLLOW",
    "DEFAULT_NEVER",
    "ExplainRow",
    "ExplainSummary",
    "Explanation",
    "Policy",
    "amp",
    "debug",
    "dtype_report",
    "eager",
    "explain",
    "format_dtype_report",
    "full_precision",
    "get_policy",
    "optim",
    "register_rule",
]
