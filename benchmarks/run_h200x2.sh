#!/usr/bin/env bash
# The two-GPU figures and tests (tensor, expert and data parallelism over NCCL), on nvidia-h200-x2.
#   bash benchmarks/run_h200x2.sh OUT_DIR [PART ...]      (from the repository root)
# PARTs (default: all, in this order):
#   tests   the NCCL variants of the multi-rank, expert-exchange and data-parallel tests
#   comm    all-reduce (ours vs torch.distributed) at hidden sizes for 1..256 tokens; one MoE layer per EP mode
#   tp      Llama-3-8B bs1/bs64 decode and throughput at TP 1 and 2; Qwen3-30B-A3B at TP 2, EP 2 (all-reduce
#           and all-to-all) against TP 1
#   dp      the nano-vllm workload with one engine and with two replicas (one GPU each)
#   dpa     DP attention: Qwen3-30B-A3B over two ranks that split the experts (eager) against one engine
#   single  run_h200.sh's one-GPU parts, one run per GPU at once: GPU0_PARTS (default "tests selftest core")
#           and GPU1_PARTS (default "quant deepseek serve"), into OUT_DIR/gpu0 and OUT_DIR/gpu1 (the two
#           runs share the host's cores: the figures say so only through this note)
# Each command runs under its own time limit (SIGINT when reached). JSONs record their run (run_metadata).
set -u
out=${1:?usage: run_h200x2.sh OUT_DIR [tests|comm|tp|dp|dpa ...]}
shift
parts=${*:-tests comm tp dp dpa}  # ("single" only when named)
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_CACHE_DIR="$out/triton_cache"

run() {  # run NAME SECONDS MODULE ARGS...
    local name=$1 limit=$2
    shift 2
    echo "=== $name"
    timeout -k 10 -s INT "$limit" python -m "$@" 2>&1 | grep -vE "Warning|warnings.warn|^$" > "$out/$name.log"
    tail -25 "$out/$name.log"
}

for part in $parts; do
    case $part in
    tests)  # one pytest per file (a hang costs its own limit only); faulthandler dumps the stacks of a slow test
        for spec in exchange:90:tests/models/test_expert_exchange.py dp:120:tests/engine/test_data_parallel.py \
                dp_attention:120:tests/engine/test_dp_attention.py multi_rank:420:tests/engine/test_multi_rank.py; do
            IFS=: read -r name limit path <<< "$spec"
            echo "=== tests: $name"
            timeout -k 10 -s INT "$limit" python -m pytest -q -p no:cacheprovider --tb=short -rfE \
                -o faulthandler_timeout=120 -k "gpu or cuda" "$path" > "$out/tests_$name.log" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests_$name.log" | cut -c1-300 | tail -15
        done
        ;;
    comm) run comm 150 benchmarks.comm --nproc 2 --json "$out/comm.json" ;;
    tp)
        run tp_llama 240 benchmarks.engine --section tp --latency-models llama-3-8b --json "$out/engine_tp_llama.json"
        run tp_30b 420 benchmarks.engine --section tp --latency-models qwen3-30b-a3b --json "$out/engine_tp_30b.json"
        ;;
    dp) run dp 300 benchmarks.engine_dp --json "$out/engine_dp.json" ;;
    dpa) run dp_attention 420 benchmarks.engine_dp --model qwen3-30b-a3b --dp-attention --no-front-1 \
            --json "$out/engine_dp_attention.json" ;;
    single)
        CUDA_VISIBLE_DEVICES=0 bash benchmarks/run_h200.sh "$out/gpu0" ${GPU0_PARTS:-tests selftest core} \
            > "$out/gpu0.log" 2>&1 &
        CUDA_VISIBLE_DEVICES=1 bash benchmarks/run_h200.sh "$out/gpu1" ${GPU1_PARTS:-quant deepseek serve} \
            > "$out/gpu1.log" 2>&1 &
        wait
        tail -40 "$out/gpu0.log" "$out/gpu1.log"
        ;;
    *) echo "unknown part $part (tests, comm, tp, dp, dpa, single)"; exit 2 ;;
    esac
done
