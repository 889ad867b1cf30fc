"""What amp did to a program, for the person reading it.

[`explain`][amp_jax.explain] (explain.py; what it returns: explanation.py),
[`dtype_report`][amp_jax.dtype_report] (report.py),
[`compiled_report`][amp_jax.compiled_report] (compiled.py, its rows: compiled_rows.py) and
the debug tools (nonfinite.py, evaluating op by op with probe.py; underflow.py) share
three modules: tracing.py traces a program the way a diagnostic takes it (a float32 or
amp function, ``grad=``, ``has_aux=``), reasons.py says what an equation ran in and why
(the plan's decisions, matched to the rewritten program's equations), measure.py counts
an equation's FLOPs and bytes and finds the ones XLA removes.
"""
