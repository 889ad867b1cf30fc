"""An e3nn-jax equivariant message-passing network (needs ``e3nn-jax``): shared
by tests/behaviour/test_model_libraries.py and benchmarks/studies/e3nn_step.py.

Per layer, the node features (irreps) of each edge's source go through a
tensor product with the edge's spherical harmonics, an irreps-wise linear,
a ``segment_sum`` onto the edge's destination, a self-connection linear and
a gate. Many of its contractions are small (a few channels per irrep).
"""

from __future__ import annotations

import e3nn_jax as e3nn
import flax.linen as nn
import jax
import jax.numpy as jnp

#: name -> (nodes, edges, hidden irreps, gate irreps, spherical harmonics, layers)
SIZES = {
    "small": (32, 256, "16x0e+8x1o+4x2e", "20x0e+8x1o+4x2e", "0e+1o+2e", 2),
    "medium": (128, 1024, "32x0e+16x1o+8x2e", "40x0e+16x1o+8x2e", "0e+1o+2e", 3),
    "lmax3": (
        64,
        512,
        "16x0e+16x1o+16x2e+16x3o",
        "64x0e+16x1o+16x2e+16x3o",
        "0e+1o+2e+3o",
        3,
    ),
}


def message_passing(size="small"):
    """``(loss, params, batch)``: ``loss(params, *batch)`` is the mean squared
    error of the network's per-node scalar against a smooth target."""
    nodes, edges, hidden, gates, sh_irreps, layers = SIZES[size]

    def linear(irreps):
        return e3nn.flax.Linear(irreps, force_irreps_out=True)

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, sh, src, dst):
            msg = linear(hidden)(e3nn.tensor_product(x[src], sh, filter_ir_out=hidden))
            agg = e3nn.IrrepsArray(msg.irreps, jax.ops.segment_sum(msg.array, dst, nodes) / 8.0)
            return e3nn.gate(linear(gates)(linear(hidden)(x) + agg))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, sh, src, dst):
            x = linear(hidden)(x)
            for _ in range(layers):
                x = Layer()(x, sh, src, dst)
            return linear("1x0e")(x).array

    k = jax.random.split(jax.random.key(0), 5)
    pos = jax.random.normal(k[0], (nodes, 3))
    src = jax.random.randint(k[1], (edges,), 0, nodes)
    dst = jax.random.randint(k[2], (edges,), 0, nodes)
    sh = e3nn.spherical_harmonics(sh_irreps, pos[dst] - pos[src], normalize=True)
    x = e3nn.IrrepsArray("4x0e", jax.random.normal(k[3], (nodes, 4)))
    target = jnp.sin(pos[:, :1]) + 0.1 * jax.random.normal(k[4], (nodes, 1))
    net = Net()
    params = net.init(jax.random.key(1), x, sh, src, dst)

    def loss(params, x, sh, src, dst, target):
        return jnp.mean((net.apply(params, x, sh, src, dst) - target) ** 2)

    return loss, params, (x, sh, src, dst, target)
