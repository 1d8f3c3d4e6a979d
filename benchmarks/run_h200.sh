#!/usr/bin/env bash
# Every H200 figure in docs/benchmarks.md, in one go (about 9 minutes).
#   bash benchmarks/run_h200.sh OUT_DIR        (from the repository root, on the GPU machine)
# Each JSON records its run (GPU, versions, commit, Triton cache state: benchmarks/common.py
# run_metadata). Where the tree has no .git, set ATOM_CORE_COMMIT to the commit it was copied from.
# Triton caches: the engine tests get their own, so that the benchmarks' cache is still empty for
# the first benchmark (engine_throughput: the cold run); every later script reuses it (warm).
set -u
out=${1:?usage: run_h200.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
cache="$out/triton_cache"
rm -rf "$cache" && mkdir -p "$cache"
run() {  # run NAME SECONDS MODULE ARGS...   (with TRITON_CACHE_DIR=$cache)
    local name=$1 limit=$2
    shift 2
    echo "=== $name (Triton cache $cache: $(ls -A "$cache" | grep -q . && echo warm || echo cold))"
    TRITON_CACHE_DIR="$cache" timeout "$limit" python -m "$@" 2>&1 | grep -vE "Warning|warnings.warn|^$" \
        | tee "$out/$name.log" | tail -30
}
echo "=== GPU engine tests"
TRITON_CACHE_DIR="$out/triton_cache_tests" timeout 120 python -m pytest tests/engine/test_engine_gpu.py \
    tests/engine/test_engine_binding.py tests/engine/test_engine_lifetime.py -q \
    -p no:cacheprovider 2>&1 | tail -5
run engine_throughput 240 benchmarks.engine --section throughput --hf-seqs 64 --hf-timeout 80 --json "$out/engine_throughput.json"
run engine_latency 110 benchmarks.engine --section latency --json "$out/engine_latency.json"
run engine_ttft 90 benchmarks.engine --section ttft --json "$out/engine_ttft.json"
run engine_throughput_fp8_kv 200 benchmarks.engine --section throughput --kv-cache-dtype fp8 --hf-seqs 0 --json "$out/engine_throughput_fp8_kv.json"
run ops_scaled_mm 150 benchmarks.ops_scaled_mm --json "$out/ops_scaled_mm.json"
run engine_latency_fp8 200 benchmarks.engine --section latency --latency-models llama-3-8b --quantization fp8_block --json "$out/engine_latency_fp8.json"
run engine_latency_gpt_oss 200 benchmarks.engine --section latency --latency-models gpt-oss-20b --quantization config --json "$out/engine_latency_gpt_oss.json"
run engine_throughput_30b_fp8 300 benchmarks.engine --section throughput --model qwen3-30b-a3b --quantization fp8 --hf-seqs 0 --json "$out/engine_throughput_30b_fp8.json"
run ops_attention 130 benchmarks.ops_attention --sdpa-only --json "$out/ops_attention.json"
run ops_elementwise 70 benchmarks.ops_elementwise --json "$out/ops_elementwise.json"
