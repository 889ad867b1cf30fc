"""One process of the multi-process test (tests/behaviour/test_multiprocess.py).

    PYTHONPATH=. python tests/behaviour/_multiprocess_worker.py OUT.npz NUM_PROCESSES PROCESS_ID PORT

from the repository root (which holds ``workloads``) trains the transformer block of workloads/sharded.py data parallel over
all 8 devices (8 forced host CPU devices in 1 process, or 4 in each of 2
processes joined by ``jax.distributed`` on 127.0.0.1) twice:

* ``amp``: ``amp(loss, policy="float16")``, bfloat16 parameters,
  ``dynamic_loss_scale(master_weights(adam))``, an inf in one sample of the
  batch at step ``OVERFLOW_STEP`` (held by the last device, i.e. process 1);
* ``f32``: the same program in plain float32 JAX (no amp, float32 parameters,
  adam, no inf): the reduction-order noise of the two set-ups.

With 1 process it also trains both again on every batch in reverse sample
order (``amp_rev``, ``f32_rev``): the same sum of per-sample gradients, added
in another order, on the same devices -- what one run changes against
another when only the order of the gradient reduction differs.

Process 0 writes losses, loss scales, skipped-step counts and final
float32 parameters (amp: the master weights) of every run to OUT.npz.
"""

import os
import sys

out_path, nproc, pid, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // nproc}"

import jax  # noqa: E402

if nproc > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        coordinator_bind_address=f"127.0.0.1:{port}",
        num_processes=nproc,
        process_id=pid,
        initialization_timeout=60,
    )

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import amp_jax  # noqa: E402
from amp_jax import optim  # noqa: E402
from workloads import sharded as sm  # noqa: E402

STEPS, OVERFLOW_STEP, BATCH = 16, 5, 16
assert jax.device_count() == 8 and jax.process_count() == nproc

mesh = jax.make_mesh((8,), ("data",), devices=jax.devices())
repl = NamedSharding(mesh, P())


def global_array(x, spec):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])


def to_host(tree):
    tree = jax.jit(lambda t: t, out_shardings=repl)(tree)
    return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), tree)


def batches(reverse):
    rng = np.random.default_rng(0)
    for i in range(STEPS):
        x = rng.standard_normal((BATCH, sm.S, sm.D), np.float32)
        y = rng.standard_normal((BATCH, sm.S, sm.D), np.float32)
        yield i, (x[::-1].copy(), y[::-1].copy()) if reverse else (x, y)


def run(use_amp, reverse=False):
    dtype = jnp.bfloat16 if use_amp else jnp.float32
    params = jax.tree.map(np.asarray, sm.init(jax.random.key(0), dtype))
    p = {k: global_array(v, P()) for k, v in params.items()}
    if use_amp:
        tx = optim.dynamic_loss_scale(
            optim.master_weights(optax.adam(3e-3)), init_scale=2.0**10, growth_interval=8
        )
        loss_fn = amp_jax.amp(sm.loss, policy="float16")
    else:
        tx, loss_fn = optax.adam(3e-3), sm.loss
    s = tx.init(p)

    @jax.jit
    def step(p, s, b):
        if use_amp:
            loss, g = optim.scaled_value_and_grad(loss_fn, s)(p, b)
        else:
            loss, g = jax.value_and_grad(loss_fn)(p, b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    losses, scales, skipped = [], [], []
    for i, (x, y) in batches(reverse):
        if use_amp and i == OVERFLOW_STEP:
            x[0 if reverse else BATCH - 1, 3, 5] = np.inf  # one device only (2 processes: the last)
        b = (global_array(x, P("data")), global_array(y, P("data")))
        p, s, loss = step(p, s, b)
        losses.append(float(to_host(loss)))
        if use_amp:
            scales.append(float(to_host(optim.loss_scale(s))))
            skipped.append(int(to_host(s.skipped_steps)))
    for k, v in p.items():
        assert v.sharding.is_equivalent_to(repl, v.ndim), (k, v.sharding)
    # the float32 copy the optimizer steps (master weights) for amp
    host = to_host(optim.master_params(s) if use_amp else p)
    return losses, scales, skipped, {k: np.asarray(v, np.float32) for k, v in host.items()}


results = {}
runs = [("amp", True, False), ("f32", False, False)]
if nproc == 1:
    runs += [("amp_rev", True, True), ("f32_rev", False, True)]
for name, use_amp, reverse in runs:
    losses, scales, skipped, params = run(use_amp, reverse)
    results[f"{name}_losses"] = np.asarray(losses)
    results[f"{name}_scales"] = np.asarray(scales)
    results[f"{name}_skipped"] = np.asarray(skipped)
    for k, v in params.items():
        results[f"{name}_param_{k}"] = v
if pid == 0:
    np.savez(out_path, **results)
if nproc > 1:
    jax.distributed.shutdown()
