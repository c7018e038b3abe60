#!/usr/bin/env bash
# One device call: install, run every `gpu` test, then every benchmark.
# Needs the wheels the device image lacks in .whl/ (see docs/benchmarks.md).
#   bash benchmarks/run_gpu.sh            (logs go to $OUT when set)
set -u
cd "$(dirname "$0")/.."
LOG=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . -e backends/paged -e backends/gdn \
  > "$LOG/install.log" 2>&1 || { tail -5 "$LOG/install.log"; exit 1; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$LOG/gpu_tests.log" | tail -15
for bench in bench_decode_attention bench_e2e_decode bench_gdn; do
  [ -f "benchmarks/$bench.py" ] || continue
  echo "== $bench"
  (cd benchmarks && timeout 150 python3 "$bench.py") 2>&1 | tee "$LOG/$bench.log" | grep -v Warning | tail -14
done
