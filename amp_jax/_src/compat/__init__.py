"""Every JAX-version difference amp_jax depends on, and nothing else: this package.

Supported: JAX 0.10.2 and up: 0.10, 0.11 and 0.12 (CI runs 0.10.2, 0.11.2 and
the newest JAX, noxfile.py). What changed between those versions:

- 0.10 -> 0.11: ``ClosedJaxpr`` and ``Jaxpr`` are one class (a closed jaxpr
  is a ``Jaxpr`` with ``consts``; the params that held open jaxprs, ``remat``'s
  and ``shard_map``'s, hold that class too); ``scan`` describes its operands by
  flat trees ``ft_in``/``ft_out`` of (consts, carry, xs) instead of
  ``num_consts``/``num_carry``; ``jit``'s ``inline`` is an ``Inline`` enum, not
  a bool.
- 0.11 -> 0.12: none in what amp_jax reads.

Only public API is used: ``jax.extend.core``, ``jax.extend.linear_util``,
``jax.extend.source_info_util``, ``jax.make_jaxpr``.

It also names JAX's jaxpr objects for annotations (`Eqn`, `Var`, `Literal`,
`Atom`, `Jaxpr`, `ClosedJaxpr`, `Primitive`, `AbstractValue`, `ShapedArray`,
`PyTreeDef`, `KeyPath`, `WrappedFun`): the rest of amp_jax types its parameters with
these, never with ``jax._src`` classes. From JAX 0.11 ``ClosedJaxpr`` is
``Jaxpr``; a parameter that takes a closed jaxpr says `ClosedJaxpr` all the
same, for the reader and for JAX 0.10.

Its modules: `jaxpr` (the jaxpr objects, tracing, binding), `context` (source info,
name stacks, the trace context), `higher_order` (the params of ``jit``, ``scan``,
``while``, ``custom_jvp``/``custom_vjp``, ``shard_map``) and `flax_nnx`; every public
name is re-exported here, so the rest of amp_jax reads ``compat.X``.
"""

from amp_jax._src.compat.context import current_name_stack_str as current_name_stack_str
from amp_jax._src.compat.context import current_source_line as current_source_line
from amp_jax._src.compat.context import eqn_context as eqn_context
from amp_jax._src.compat.context import eqn_source_line as eqn_source_line
from amp_jax._src.compat.context import explicit_sharding_in_order as explicit_sharding_in_order
from amp_jax._src.compat.context import jit_disabled as jit_disabled
from amp_jax._src.compat.context import name_stack_str as name_stack_str
from amp_jax._src.compat.context import source_line as source_line
from amp_jax._src.compat.context import trace_context as trace_context
from amp_jax._src.compat.context import x64_of as x64_of
from amp_jax._src.compat.flax_nnx import hijax_writable_under_jit as hijax_writable_under_jit
from amp_jax._src.compat.flax_nnx import nnx_node_items as nnx_node_items
from amp_jax._src.compat.flax_nnx import nnx_set_key as nnx_set_key
from amp_jax._src.compat.higher_order import CALL_LIKE_NAMES as CALL_LIKE_NAMES
from amp_jax._src.compat.higher_order import CUSTOM_JVP_NAMES as CUSTOM_JVP_NAMES
from amp_jax._src.compat.higher_order import CUSTOM_VJP_NAMES as CUSTOM_VJP_NAMES
from amp_jax._src.compat.higher_order import JIT_NAMES as JIT_NAMES
from amp_jax._src.compat.higher_order import SHARD_MAP_NAMES as SHARD_MAP_NAMES
from amp_jax._src.compat.higher_order import call_thunk as call_thunk
from amp_jax._src.compat.higher_order import custom_jvp_params as custom_jvp_params
from amp_jax._src.compat.higher_order import custom_jvp_parts as custom_jvp_parts
from amp_jax._src.compat.higher_order import has_subjaxprs as has_subjaxprs
from amp_jax._src.compat.higher_order import inline_jits_staged as inline_jits_staged
from amp_jax._src.compat.higher_order import is_staged as is_staged
from amp_jax._src.compat.higher_order import jit_inlined_by_jax as jit_inlined_by_jax
from amp_jax._src.compat.higher_order import jit_is_inlinable as jit_is_inlinable
from amp_jax._src.compat.higher_order import jit_jaxpr as jit_jaxpr
from amp_jax._src.compat.higher_order import map_subjaxprs as map_subjaxprs
from amp_jax._src.compat.higher_order import memoized_fun as memoized_fun
from amp_jax._src.compat.higher_order import scan_num_xs as scan_num_xs
from amp_jax._src.compat.higher_order import scan_params_with_body as scan_params_with_body
from amp_jax._src.compat.higher_order import scan_split as scan_split
from amp_jax._src.compat.higher_order import scan_xs as scan_xs
from amp_jax._src.compat.higher_order import shard_map_body as shard_map_body
from amp_jax._src.compat.higher_order import shard_map_of as shard_map_of
from amp_jax._src.compat.higher_order import vjp_residuals as vjp_residuals
from amp_jax._src.compat.higher_order import while_split as while_split
from amp_jax._src.compat.jaxpr import JAX_VERSION as JAX_VERSION
from amp_jax._src.compat.jaxpr import ONE_JAXPR_CLASS as ONE_JAXPR_CLASS
from amp_jax._src.compat.jaxpr import AbstractToken as AbstractToken
from amp_jax._src.compat.jaxpr import AbstractValue as AbstractValue
from amp_jax._src.compat.jaxpr import Atom as Atom
from amp_jax._src.compat.jaxpr import ClosedJaxpr as ClosedJaxpr
from amp_jax._src.compat.jaxpr import Eqn as Eqn
from amp_jax._src.compat.jaxpr import Jaxpr as Jaxpr
from amp_jax._src.compat.jaxpr import KeyPath as KeyPath
from amp_jax._src.compat.jaxpr import Literal as Literal
from amp_jax._src.compat.jaxpr import Primitive as Primitive
from amp_jax._src.compat.jaxpr import PyTreeDef as PyTreeDef
from amp_jax._src.compat.jaxpr import Ref as Ref
from amp_jax._src.compat.jaxpr import ShapedArray as ShapedArray
from amp_jax._src.compat.jaxpr import Token as Token
from amp_jax._src.compat.jaxpr import Tracer as Tracer
from amp_jax._src.compat.jaxpr import Var as Var
from amp_jax._src.compat.jaxpr import WrappedFun as WrappedFun
from amp_jax._src.compat.jaxpr import abstract_key as abstract_key
from amp_jax._src.compat.jaxpr import abstractify as abstractify
from amp_jax._src.compat.jaxpr import aval_of as aval_of
from amp_jax._src.compat.jaxpr import bind_eqn as bind_eqn
from amp_jax._src.compat.jaxpr import cast_constant as cast_constant
from amp_jax._src.compat.jaxpr import close as close
from amp_jax._src.compat.jaxpr import closed_to_open_no_consts as closed_to_open_no_consts
from amp_jax._src.compat.jaxpr import consts_of as consts_of
from amp_jax._src.compat.jaxpr import in_avals as in_avals
from amp_jax._src.compat.jaxpr import is_closed_jaxpr as is_closed_jaxpr
from amp_jax._src.compat.jaxpr import is_drop_var as is_drop_var
from amp_jax._src.compat.jaxpr import is_open_jaxpr as is_open_jaxpr
from amp_jax._src.compat.jaxpr import jaxpr_as_fun as jaxpr_as_fun
from amp_jax._src.compat.jaxpr import jaxpr_of as jaxpr_of
from amp_jax._src.compat.jaxpr import literal_value as literal_value
from amp_jax._src.compat.jaxpr import trace_to_closed_jaxpr as trace_to_closed_jaxpr
from amp_jax._src.compat.jaxpr import trace_with_shape as trace_with_shape
from amp_jax._src.compat.jaxpr import trace_with_shape_kw as trace_with_shape_kw
