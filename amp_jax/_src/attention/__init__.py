"""Attention written out in a jaxpr, recognised and run as fused attention.

Under ``amp`` a model is traced in float32, so attention written as
``einsum -> scale -> mask -> softmax -> einsum`` (or float32
``jax.nn.dot_product_attention``, which takes its XLA path) arrives as separate
primitives that materialise the ``[B, N, T, S]`` scores and probabilities.
Only amp knows the inputs will be bf16/f16, which cuDNN's fused flash attention
needs. `find` recognises the pattern in one jaxpr (stage by stage: the softmax,
its values matmul, the ops back to the scores matmul, the operands' layouts, the
mask and bias); `Match.evaluate` replaces it by one call of
``jax.nn.dot_product_attention`` on compute-dtype operands.

Recognised: a scores ``dot_general`` with 0-2 batch dims (grouped-query and
multi-query attention too, and k/v repeated with ``jnp.repeat``), then at most
one each of a scalar scale, an additive bias, a ``select_n`` mask whose fill is
``<= -1e4`` and whose predicate depends on no float value q, k and v come from
(a constant lower-triangular one becomes ``is_causal=True``) and a transpose,
then ``jax.nn.softmax`` over the keys and the values ``dot_general`` (v's head
dim may differ from q's: the smaller is zero-padded). The intermediate values
must have no other consumers. A softmax between two matmuls that cannot be
taken is a *near miss*, left as written with its reason. `plan_attention` decides per
attention (`decide`: policy, compute dtype, and the `Backend` record, which
holds cuDNN's limits and runs its probe) and names
the scope its ops run under (``amp_attention[cudnn]``,
``amp_attention[xla-fused]``, ``amp_attention[xla: <reason>]``), which
``dtype_report`` and ``explain`` read. docs/how-amp-works.md lists the patterns.

Plan time and run time apart: ``recognise.py`` (`find`; its stages in
``stages.py``, the jaxpr walks in ``graph.py``) and ``plan.py``
(`plan_attention`, `decide`) run when a jaxpr is planned; ``match.py`` holds
the record a plan keeps (`Match`) and `Match.evaluate`, which runs when the
plan is evaluated.
"""

from amp_jax._src.attention.match import Match as Match
from amp_jax._src.attention.match import NearMiss as NearMiss
from amp_jax._src.attention.plan import AttentionPlan as AttentionPlan
from amp_jax._src.attention.plan import decide as decide
from amp_jax._src.attention.plan import plan_attention as plan_attention
from amp_jax._src.attention.recognise import find as find

__all__ = ("AttentionPlan", "Match", "NearMiss", "decide", "find", "plan_attention")
