#!/usr/bin/env bash
# The float8 checks that need a GPU with fp8 matmuls (compute capability >= 8.9, e.g. H100).
# Run from the repository root:  bash benchmarks/float8_gpu.sh [out dir]   (about 15 min on an H100)
#   1. tests/test_float8.py, including the fp8 GEMM checks on the optimized HLO
#   2. benchmarks/run.py --models gpt_fp8: amp fp8 vs amp bf16 step time (target <= 0.8x)
#   3. the demo, 1000 steps of amp-bf16 and amp-fp8 (target: final val loss within 1.5%)
set -euo pipefail
out="${1:-${OUT:-float8_gpu_out}}"
mkdir -p "$out"
python -c "import jax; d = jax.devices()[0]; print(jax.__version__, d, getattr(d, 'compute_capability', None))" | tee "$out/device.txt"
python -m pytest -q -p no:cacheprovider -rs tests/test_float8.py 2>&1 | tee "$out/test_float8.txt"
python -m benchmarks.run --models gpt_fp8 --no-extras --out "$out/RESULTS_GPU_FP8.md" 2>&1 | tee "$out/bench.txt"
python -m amp_jax.demo --modes amp-bf16,amp-fp8 --steps 1000 --no-progress --out "$out/demo" 2>&1 | tee "$out/demo.txt"
python - "$out/demo/results.json" <<'PY' | tee "$out/demo_check.txt"
import json, sys
modes = json.load(open(sys.argv[1]))["modes"]
b, f = modes["amp-bf16"]["final_val_loss"], modes["amp-fp8"]["final_val_loss"]
gap = (f - b) / b
print(f"final val loss: amp-bf16 {b:.4f}, amp-fp8 {f:.4f}, fp8 vs bf16 {gap:+.2%} "
      f"({'met' if abs(gap) <= 0.015 else 'NOT met'}: within 1.5%)")
PY
