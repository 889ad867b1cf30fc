"""Models and HLO counters shared by tests and benchmarks.

``workloads.models``: the benchmark models in plain JAX (MLP, GPT, CNN,
ResNet-50, the unrolled decoder), each with a float32 and a hand-cast
version; ``workloads.sharded``: a transformer block with its sharding
layouts and a collective counter; ``workloads.hlo``: counters over compiled
HLO text. Tests and benchmarks import them from here, so both count the same
things; neither imports the other. Not part of the installed package.
"""
