"""amp_jax's benchmarks: the maintained suite, run as modules from the repository root.

    python -m benchmarks.run        # float32 vs amp vs hand-written bf16: speed
    python -m benchmarks.peers      # amp vs the other mixed-precision libraries

benchmarks/README.md lists every benchmark, what it measures, how long it
takes and the results file it writes; benchmarks/studies/ holds one-off
studies, frozen with their results.
"""
