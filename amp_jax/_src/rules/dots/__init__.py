"""The dot family: how amp lowers ``dot_general`` (and ``transpose``,
``conv_general_dilated``), from the plan to the backward pass.

``lowering.py`` holds the rules the table binds (`lowering.DotRule`, the
transpose and convolution rules) and the layouts planned per dot
(`lowering.plan_layouts`); ``lowdot.py`` the tangent product of a lowered dot
and its transpose (the cotangent products of ``jax.grad``); ``float8.py`` the
fp8 variant of the dot rule under ``Policy(float8=...)``; ``outputs.py`` what
the planner asks of the family (the dtype an ``allow`` op writes, a rule's
reason). How each product is written for a backend (XLA:CPU's operand
layouts) is the `Backend` record's (`Backend.dot`, `Backend.plan_layouts`):
nothing here looks a backend up.
"""
