#!/usr/bin/env bash
# Run the whole suite under KERAS_BACKEND=jax, tensorflow and torch.
# Fails if any backend fails or if no test ran.
set -uo pipefail
cd "$(dirname "$0")/.."
export TF_CPP_MIN_LOG_LEVEL=3
# One pytest-xdist worker per core, at most 4 (each holds a backend, ~1-2
# GB): on 2 cores the three suites take ~23 min instead of ~38.
workers=$(python -c "import os; print(min(4, len(os.sched_getaffinity(0))))")
status=0
for backend in jax tensorflow torch; do
  echo "=== KERAS_BACKEND=${backend} ==="
  KERAS_BACKEND=${backend} python -m pytest -q -n "${workers}" --dist worksteal "$@"
  rc=$?
  if [ "$rc" -ne 0 ]; then
    # pytest exit code 5: no tests collected.
    echo "=== ${backend}: pytest exited with ${rc} ==="
    status=1
  fi
done
# TensorFlow turns oneDNN on only for CPUs with AVX-512 VNNI/BF16,
# AVX-VNNI or AMX: elsewhere (AMD EPYC) its CPU ops run Eigen's kernels,
# which round differently (an approximate reciprocal in softmax, no NCHW
# convolution). The tests that are sensitive to that run once more with
# oneDNN off, so the suite holds on every x86 CPU.
echo "=== KERAS_BACKEND=tensorflow, TF_ENABLE_ONEDNN_OPTS=0 ==="
TF_ENABLE_ONEDNN_OPTS=0 KERAS_BACKEND=tensorflow python -m pytest -q -n "${workers}" --dist worksteal \
  tests/layers/test_extreme_magnitudes.py tests/layers/test_layers.py tests/ops/test_rules.py "$@"
rc=$?
if [ "$rc" -ne 0 ]; then
  echo "=== tensorflow without oneDNN: pytest exited with ${rc} ==="
  status=1
fi
exit $status
