"""What amp did to a program, for the person reading it.

[`explain`][amp_jax.explain] (explain.py), [`dtype_report`][amp_jax.dtype_report]
(report.py) and the debug tools (debug.py) share two modules: tracing.py
traces a program the way a diagnostic takes it (a float32 or amp function,
``grad=``, ``has_aux=``), reasons.py says what an equation ran in and why
(the plan's decisions, matched to the rewritten program's equations).
"""
