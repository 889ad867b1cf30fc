"""The rules: how amp binds each primitive of a rewritten jaxpr.

``base.py`` is the rule base (`EqnRule`, `AllowRule`, the context a
rule runs under (``context.Context``), the `CastingEnv` it reads its operands from); the rules of
each family are beside it (``elementwise.py``, ``dots.py``,
``higher_order.py``), and ``table.py`` builds the table of rules by primitive
(`table.rule_for`, `table.register_rule`). Nothing here imports the planner
or the interpreter: they hand a rule its context.
"""
