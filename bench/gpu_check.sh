#!/usr/bin/env bash
# One prepared check for a machine with a GPU (203 s on an H200, jax 0.11.2), with models built
# on the spot (no hub, and SmolLM2's weights are too big to carry: bench/gpu_check.py):
#   1. the Pallas kernel tests natively (tests/kernels/test_pallas_attention.py: on a GPU the GPU kernel
#      runs compiled, not interpreted; the TPU kernel checks stay interpret/adaptation-only);
#   2. greedy equality with the CPU path (successor model: must match; random models: reported);
#   3. the offline runner benchmark on a random-weight model of SmolLM2-135M's shape, bf16 and
#      fp32: decode tok/s at batch 1, 16, 64 and prefill tok/s (speed does not depend on the values).
# Needs jax with CUDA in the active python. Usage: bash bench/gpu_check.sh [OUT_DIR] [PYTHON]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-artifacts/gpu-check}
PY=${2:-python}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
$PY -c "import jax; d = jax.devices('gpu'); print('jax', jax.__version__, 'devices:', d, d[0].device_kind)" \
  2>&1 | tee "$OUT/devices.txt" || exit 1

echo "== 1. kernel tests (native on GPU)"
timeout 120 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_pallas_attention.py 2>&1 | tee "$OUT/kernels.txt" || status=1

echo "== 2. greedy equality with the CPU path"
SMOL=/tmp/tl-smol-shaped
$PY -m bench.gpu_check --make-smol "$SMOL" 2>&1 | tail -1
timeout 120 $PY -m bench.gpu_check --backend gpu --max-tokens 24 --smol "$SMOL" 2>&1 | tee "$OUT/greedy.jsonl" || status=1

echo "== 3. offline runner benchmark (SmolLM2-shaped random weights)"
for dtype in bfloat16 float32; do
  timeout 90 $PY -m bench runner --model "$SMOL" --backend gpu --dtype "$dtype" --batches 1,16,64 --repeat 10 \
    --json "$OUT/runner.jsonl" 2>&1 | tee "$OUT/runner-$dtype.txt" || status=1
done
echo "results in $OUT (status $status)"
exit $status
