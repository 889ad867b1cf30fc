"""amp_jax's core, stage by stage as a call flows through it (each module says more).

``amp(fn)(*args)``, in order:
  call       api: amp() and full_precision(); transform: AmpFunction, what amp returns;
             calling: the arguments as a Call (traced and static leaves), its key, the cache;
             plain_objects: the refusal of plain objects that hold arrays; returning: the
             outputs as arrays or static values
  trace      ``fn`` traced once per key into a closed jaxpr; compat/: every JAX-version
             difference; jaxprs: the jaxpr toolkit and the one evaluator; mutation: what
             ``fn`` writes into its arguments, carried out (nnx_nodes: Flax NNX nodes kept
             the caller's objects, and the write-back); mesh: is the trace sharded
  plan       planning: one Decision per eqn (decision: the typed record and its reason;
             plans: the Plan tree and its printer), under one context (context: policy,
             backend, memo), in stages: classify by the policy (policy, op_classes,
             policy_names) and the Backend record (backends/); paint the followers
             (painting: the pure graph pass; painted: it run over a jaxpr's classes);
             control flow and loops (control); fused attention (attention/: recognised at
             plan time, run by a Match); rules by path (paths)
  evaluate   interpreter: the plan run under the caller's trace, each eqn bound by its
             rule (rules/: table, base, elementwise, higher_order, and the matmul family in
             dots: lowering, lowdot the lowered dot and its tangent, float8, outputs; casting:
             the one casting rule), bodies by their plans
  read       diagnostics/: explain, dtype_report, compiled_report, first_nonfinite,
             underflow_report read the plan and the rewritten program; they decide nothing
Apart: optstate, what amp_jax.optim's optimizers share with the core; testing.
"""
