"""The rules: how amp binds each primitive of a rewritten jaxpr.

``base.py`` is the rule base (`EqnRule`, `AllowRule`, the `CastingEnv` a
rule reads its operands from; a rule runs under a ``context.Context``); the
rules of each family are beside it (``elementwise.py``, ``higher_order.py``,
and the ``dots/`` package: the dot's rule, its tangent, float8 and what
planning asks of them), and ``table.py`` builds the table of rules by primitive
(`table.rule_for`, `table.register_rule`). Nothing here imports the planner
or the interpreter: they hand a rule its context.
"""
