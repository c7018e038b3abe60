#!/usr/bin/env bash
# Install, run every `gpu` test, then the benchmarks, on a GPU machine.
# Needs the wheels the device image lacks in .whl/ (see docs/benchmarks.md).
#   bash benchmarks/run_gpu.sh                      every benchmark (TP only with 2 GPUs)
#   bash benchmarks/run_gpu.sh bench_tp_decode      only the named ones
#   bash benchmarks/run_gpu.sh "bench_fp8 --shapes 8b"   a named one with its arguments
# Logs go to $OUT when set. GPU_TEST_TIMEOUT / BENCH_TIMEOUT bound the tests / each benchmark (s).
# GPU_TESTS narrows the tests run (paths or node ids; default: every `gpu` test under tests/,
# the gdn tests last: fla's kernels compile and autotune for minutes on a fresh machine).
# Node ids run in the order given; naming a whole file beside them reorders by file.
# Triton's cache (compiled kernels, and the autotune results fla keeps there) can be
# kept between runs: SAVE_TRITON_CACHE=1 writes it to $OUT as triton_cache.tgz.part-NN
# (parts of TRITON_CACHE_PART bytes, default 15M); with those parts in .triton_cache/, a run
# starts from that cache.
# It unpacks to the same path: Triton's cache records absolute paths.
set -u
cd "$(dirname "$0")/.."
LOG=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p "$TRITON_CACHE_DIR"
if ls .triton_cache/triton_cache.tgz* >/dev/null 2>&1; then
  cat .triton_cache/triton_cache.tgz* | tar xzf - -C "$TRITON_CACHE_DIR" \
    && echo "Triton cache: $(find "$TRITON_CACHE_DIR" -type f | wc -l) files from .triton_cache/"
fi
save_triton_cache() {
  [ "${SAVE_TRITON_CACHE:-0}" = 1 ] && [ -n "${OUT:-}" ] || return 0
  tar czf /tmp/triton_cache.tgz -C "$TRITON_CACHE_DIR" . \
    && split -b "${TRITON_CACHE_PART:-15M}" -d /tmp/triton_cache.tgz "$OUT/triton_cache.tgz.part-" \
    && echo "Triton cache: $(du -h /tmp/triton_cache.tgz | cut -f1) in $(ls "$OUT"/triton_cache.tgz.part-* | wc -l) part(s)"
}
trap save_triton_cache EXIT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
else  # .whl is git-ignored: it is present only where the wheels were copied in
  echo "no wheels in .whl/: fla's tests skip and its bench rows are missing (carry .whl)"
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . -e backends/paged -e backends/gdn -e backends/tbo \
  > "$LOG/install.log" 2>&1 || { tail -5 "$LOG/install.log"; exit 1; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.device_count(), 'x', torch.cuda.get_device_name())"
nvidia-smi topo -m 2>/dev/null | head -4
DEFAULT_GPU_TESTS="$(ls -d tests/*/ | grep -v '^tests/gdn/$' | tr '\n' ' ') tests/gdn"
# SIGINT first: pytest then still prints the failures so far (a plain kill loses them);
# -rfEs names every failure, error and skip; the log keeps one line per test.
timeout -s INT -k 30 "${GPU_TEST_TIMEOUT:-540}" python3 -m pytest -v -m gpu -p no:cacheprovider \
  -rfEs --tb=short ${GPU_TESTS:-$DEFAULT_GPU_TESTS} 2>&1 | tee "$LOG/gpu_tests.log" | grep -v " PASSED" | tail -40
benches=("$@")
if [ ${#benches[@]} -eq 0 ]; then
  benches=(bench_decode_attention bench_prefill bench_skinny_gemm bench_sampler bench_capture bench_e2e_decode bench_graph_end bench_nonfinite_check bench_sanitizer bench_gdn bench_gdn_conv bench_gdn_layer bench_pdl_gaps bench_moe bench_sleep_wake bench_weight_push_ipc bench_rollout bench_serving bench_structured_outputs bench_deterministic bench_invariant_kernels bench_fp32_parity bench_numerics bench_fp8)
  [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ] && benches+=(bench_tp_decode bench_tbo bench_weight_push_nccl)
fi
for bench in "${benches[@]}"; do
  read -r name args <<< "$bench"  # a quoted "bench_fp8 --shapes 8b" passes its arguments
  echo "== $bench"
  (cd benchmarks && timeout "${BENCH_TIMEOUT:-400}" python3 "$name.py" $args) 2>&1 | tee "$LOG/$name.log" | grep -v Warning | tail -${BENCH_TAIL:-14}
done
