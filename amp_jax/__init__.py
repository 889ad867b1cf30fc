"""amp_jax: automatic mixed precision for JAX.

``amp(fn)`` rewrites the primitives of ``fn`` under a [`Policy`][amp_jax.Policy] so that a
float32 model runs its matmuls and convolutions in bfloat16 or float16 while
numerically sensitive ops stay in float32. ``amp_jax.optim`` holds the optax
transformations low precision needs (loss scaling, master weights, Kahan
summation, stochastic rounding, any-precision AdamW); ``amp_jax.eager`` applies the optimizer inside the
backward pass of scanned models so the full gradient never exists.
"""

from amp_jax import debug as debug
from amp_jax import eager as eager
from amp_jax import optim as optim
from amp_jax._src.api import amp as amp
from amp_jax._src.api import full_precision as full_precision
from amp_jax._src.backends import (
    BACKEND_LOW_OUTPUTS as BACKEND_LOW_OUTPUTS,
)
from amp_jax._src.backends import (
    BACKEND_SLOW_IN_LOW_PRECISION as BACKEND_SLOW_IN_LOW_PRECISION,
)
from amp_jax._src.backends import (
    CpuBf16Support as CpuBf16Support,
)
from amp_jax._src.backends import (
    cpu_bf16_support as cpu_bf16_support,
)
from amp_jax._src.diagnostics.compiled import (
    CompiledReport as CompiledReport,
)
from amp_jax._src.diagnostics.compiled import (
    PrecisionMismatchError as PrecisionMismatchError,
)
from amp_jax._src.diagnostics.compiled import (
    compiled_report as compiled_report,
)
from amp_jax._src.diagnostics.compiled_rows import CompiledRow as CompiledRow
from amp_jax._src.diagnostics.explain import (
    explain as explain,
)
from amp_jax._src.diagnostics.explanation import ExplainRow as ExplainRow
from amp_jax._src.diagnostics.explanation import ExplainSummary as ExplainSummary
from amp_jax._src.diagnostics.explanation import Explanation as Explanation
from amp_jax._src.diagnostics.report import (
    dtype_report as dtype_report,
)
from amp_jax._src.diagnostics.report import (
    format_dtype_report as format_dtype_report,
)
from amp_jax._src.op_classes import DEFAULT_ALLOW as DEFAULT_ALLOW
from amp_jax._src.op_classes import DEFAULT_CLEAR as DEFAULT_CLEAR
from amp_jax._src.op_classes import DEFAULT_DENY as DEFAULT_DENY
from amp_jax._src.op_classes import DEFAULT_FOLLOW as DEFAULT_FOLLOW
from amp_jax._src.op_classes import DEFAULT_NEVER as DEFAULT_NEVER
from amp_jax._src.paths import (
    UnmatchedRuleWarning as UnmatchedRuleWarning,
)
from amp_jax._src.paths import (
    float8_except_first_and_last as float8_except_first_and_last,
)
from amp_jax._src.paths import (
    float32_embeddings_head_routers as float32_embeddings_head_routers,
)
from amp_jax._src.policy import (
    Policy as Policy,
)
from amp_jax._src.policy import (
    get_policy as get_policy,
)
from amp_jax._src.rules.table import register_rule as register_rule

__version__ = "0.1.0"

__all__ = [
    "BACKEND_LOW_OUTPUTS",
    "BACKEND_SLOW_IN_LOW_PRECISION",
    "CompiledReport",
    "CompiledRow",
    "CpuBf16Support",
    "DEFAULT_ALLOW",
    "DEFAULT_CLEAR",
    "DEFAULT_DENY",
    "DEFAULT_FOLLOW",
    "DEFAULT_NEVER",
    "ExplainRow",
    "ExplainSummary",
    "Explanation",
    "Policy",
    "PrecisionMismatchError",
    "UnmatchedRuleWarning",
    "amp",
    "compiled_report",
    "cpu_bf16_support",
    "debug",
    "dtype_report",
    "eager",
    "explain",
    "float32_embeddings_head_routers",
    "float8_except_first_and_last",
    "format_dtype_report",
    "full_precision",
    "get_policy",
    "optim",
    "register_rule",
]
