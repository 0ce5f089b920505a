#!/usr/bin/env bash
# One prepared check for a machine with a GPU (under 10 minutes on one device):
#   1. the Pallas kernel tests natively (tests/test_pallas_attention.py: on a GPU the GPU kernel
#      runs compiled, not interpreted; the TPU kernel checks stay interpret/adaptation-only);
#   2. greedy equality with the CPU path on SmolLM2 in fp32 (must match) and bf16 (reported);
#   3. the offline runner benchmark: decode tok/s at each batch bucket and prefill tok/s, bf16 and fp32.
# Needs jax with CUDA (pip install -U "jax[cuda12]") in the active environment and the model at
# artifacts/models/smol-135m (`tl pull smol-135m`). Usage: bash bench/gpu_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-artifacts/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
python -c "import jax; d = jax.devices('gpu'); print('devices:', d, d[0].device_kind)" | tee "$OUT/devices.txt"

echo "== 1. kernel tests (native on GPU)"
timeout 240 python -m pytest -q -p no:cacheprovider tests/test_pallas_attention.py 2>&1 | tee "$OUT/kernels.txt"

echo "== 2. greedy equality with the CPU path (SmolLM2 fp32, bf16)"
timeout 240 python -m bench.gpu_check --backend gpu 2>&1 | tee "$OUT/greedy.jsonl"

echo "== 3. offline runner benchmark"
for dtype in bfloat16 float32; do
  timeout 120 python -m bench runner --backend gpu --dtype "$dtype" --batches 1,4,16,64 --repeat 10 \
    --json "$OUT/runner.jsonl" 2>&1 | tee "$OUT/runner-$dtype.txt"
done
echo "results in $OUT"
