#!/usr/bin/env bash
# Every H200 figure in docs/benchmarks.md and every GPU test, in parts that each fit one 10-minute call.
#   bash benchmarks/run_h200.sh OUT_DIR [PART ...]      (from the repository root, on the GPU machine)
# PARTs (default: all, in this order):
#   tests       the GPU tests (engine, models incl. DeepSeek and quantized checkpoints, op semantics)
#   selftest    python -m atom_core.ops.selftest, full grid, every backend here (writes no record)
#   core        engine throughput (cold, then warm), latency, TTFT; attention and elementwise ops
#   quant       FP8 GEMMs; Llama-3-8B fp8_block and GPT-OSS-20B MXFP4 decode; Qwen3-30B-A3B fp8 and the fp8 KV pool
#               (engine and decode attention)
#   fp8decode   the M = 1 FP8 GEMM launch sweep, fp8 experts at 1-8 tokens, dependent launch by token count,
#               the bs-1 FP8 step's kernels
#   deepseek    MLA / DSA ops; the DeepSeek-V2-Lite engine against HF
#   serve       = structured, then serving:
#   structured  structured output (tests, the mask op, per-step overhead at bs 64)
#   serving     the online serving benchmark: atom-core serve against transformers serve, and offline
#               Engine.generate (Qwen3-0.6B shapes, random weights). These three need the serve / structured
#               extras' packages: where the machine lacks them, put their wheels in .whl/ (installed into
#               /tmp/site first). SERVE_RATES: the online benchmark's request rates (default "4 16 64 inf");
#               SERVE_SERVERS: which servers it runs against (default "atom_core transformers");
#               SERVE_BENCH_ARGS: more flags for every online run (e.g. "--num-prompts 64 --no-ignore-eos").
#               STRUCTURED_TOKENIZER: a 151k-token tokenizer.json for the structured-output benchmark (else
#               it trains one: ~2 minutes).
# Each command runs under its own time limit; when it is reached the command gets SIGINT (pytest still
# prints its summary) and the next one starts. Each JSON records its run (GPU, versions, commit, Triton
# cache state: benchmarks/common.py run_metadata). Where the tree has no .git, set ATOM_CORE_COMMIT to
# the commit it was copied from. Triton caches: the tests get their own, so that the benchmarks' cache is
# still empty for the first benchmark of the core part (engine_throughput: the cold run); every later
# script reuses it (warm).
set -u
out=${1:?usage: run_h200.sh OUT_DIR [tests|selftest|core|quant|fp8decode|deepseek ...]}
shift
parts=${*:-tests selftest core quant fp8decode deepseek serve}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
cache="$out/triton_cache"
mkdir -p "$cache"

run() {  # run NAME SECONDS MODULE ARGS...   (with TRITON_CACHE_DIR=$cache)
    local name=$1 limit=$2
    shift 2
    echo "=== $name (Triton cache $cache: $(ls -A "$cache" | grep -q . && echo warm || echo cold))"
    TRITON_CACHE_DIR="$cache" timeout -k 10 -s INT "$limit" python -m "$@" 2>&1 | grep -vE "Warning|warnings.warn|^$" \
        > "$out/$name.log"
    tail -30 "$out/$name.log"
}

tests() {  # tests NAME SECONDS PATHS...
    local name=$1 limit=$2
    shift 2
    echo "=== tests: $name"
    TRITON_CACHE_DIR="$out/triton_cache_tests" timeout -k 10 -s INT "$limit" python -m pytest -q -p no:cacheprovider \
        --tb=short -rfE "$@" > "$out/tests_$name.log" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed|no tests ran" "$out/tests_$name.log" | cut -c1-300 | tail -15
}

serving() {  # atom-core serve and transformers serve on one random-weight Qwen3-0.6B folder (docs/serving.md)
    local folder="$out/qwen3-0.6b-random" cli=(python -m atom_core.serve.cli)
    python - "$folder" <<'PY'
import pathlib, shutil, sys
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
import atom_core
folder = pathlib.Path(sys.argv[1])
Qwen3ForCausalLM(Qwen3Config.from_json_file("benchmarks/configs/qwen3-0.6b.json")).to(torch.bfloat16).save_pretrained(folder)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(pathlib.Path(atom_core.__file__).parent / "demo_model" / name, folder)
# The demo tokenizer has no chat template: both servers render atom-core's fallback (transformers serve refuses
# a chat request without one).
from atom_core.serve.engine_options import FALLBACK_CHAT_TEMPLATE
(folder / "chat_template.jinja").write_text(FALLBACK_CHAT_TEMPLATE)
PY
    local servers=${SERVE_SERVERS:-atom_core transformers}
    if [[ " $servers " == *" atom_core "* ]]; then  # the baseline of the server-overhead target
        echo "=== serving: offline"
        timeout -s INT 120 "${cli[@]}" bench --offline "$folder" --json "$out/serve_offline.json" \
            > "$out/serve_offline.log" 2>&1
        tail -8 "$out/serve_offline.log"
    fi
    # atom-core: token-id prompts (completions) and text prompts (chat); transformers serve: chat (it takes no
    # token ids, nor vLLM's ignore_eos). Its /v1/models lists the HF cache's models: an empty cache, and the
    # folder named per request.
    for server in $servers; do
        local port=8000 endpoints="completions chat" model=() start=("${cli[@]}" serve "$folder" --port 8000)
        if [ $server = transformers ]; then
            port=8001 endpoints=chat model=(--model "$folder" --no-ignore-eos)
            mkdir -p "$out/hf_hub_cache"
            start=(env HF_HUB_CACHE="$out/hf_hub_cache" transformers serve "$folder" --continuous-batching --port 8001)
        fi
        "${start[@]}" > "$out/serve_${server}_server.log" 2>&1 &
        local pid=$!
        for _ in $(seq 120); do  # up once it answers at all
            python -c "import urllib.request as u, urllib.error as e, sys
try: u.urlopen(sys.argv[1], timeout=1)
except e.HTTPError: pass" "http://127.0.0.1:$port/v1/models" 2>/dev/null && break
            sleep 1
        done
        for endpoint in $endpoints; do
            echo "=== serving: $server, $endpoint"
            timeout -s INT 200 "${cli[@]}" bench --url "http://127.0.0.1:$port" --endpoint $endpoint "${model[@]}" \
                ${SERVE_BENCH_ARGS:-} --rate ${SERVE_RATES:-4 16 64 inf} --json "$out/serve_${server}_${endpoint}.json" \
                > "$out/serve_${server}_${endpoint}.log" 2>&1
            tail -8 "$out/serve_${server}_${endpoint}.log"
        done
        kill -INT $pid; sleep 3; kill -9 $pid 2>/dev/null
    done
}

for part in $parts; do
    case $part in
    tests)
        tests engine 150 tests/engine/test_engine_gpu.py tests/engine/test_engine_binding.py \
            tests/engine/test_engine_lifetime.py tests/engine/test_memory_headroom.py tests/engine/test_fp8_kv_cache.py
        tests models 200 tests/models/test_parity_llama.py tests/models/test_parity_qwen3.py \
            tests/models/test_moe_gpu.py tests/models/test_quant_checkpoints.py tests/models/test_quant_deepseek.py
        tests deepseek 150 tests/models/test_deepseek_gpu.py
        tests ops 90 tests/ops/test_sampling_semantics.py tests/ops/test_quant.py tests/ops/test_scaled_mm.py \
            tests/ops/test_fused_moe_quant.py tests/ops/test_token_mask.py
        ;;
    selftest)
        echo "=== selftest"
        TRITON_CACHE_DIR="$out/triton_cache_tests" timeout -s INT 480 python -m atom_core.ops.selftest --no-write \
            > "$out/selftest.log" 2>&1
        grep -E "FAILED|no verdict" -A2 "$out/selftest.log" | cut -c1-400; grep -c passed "$out/selftest.log"
        ;;
    core)
        run engine_throughput 240 benchmarks.engine --section throughput --hf-seqs 64 --hf-timeout 80 \
            --json "$out/engine_throughput.json"
        run engine_latency 110 benchmarks.engine --section latency --json "$out/engine_latency.json"
        run engine_ttft 90 benchmarks.engine --section ttft --json "$out/engine_ttft.json"
        run ops_attention 80 benchmarks.ops_attention --sdpa-only --json "$out/ops_attention.json"
        run ops_elementwise 60 benchmarks.ops_elementwise --json "$out/ops_elementwise.json"
        ;;
    quant)
        run ops_scaled_mm 150 benchmarks.ops_scaled_mm --json "$out/ops_scaled_mm.json"
        run ops_moe_quant 90 benchmarks.ops_moe --no-compile --json "$out/ops_moe.json"
        run engine_latency_fp8 150 benchmarks.engine --section latency --latency-models llama-3-8b \
            --quantization fp8_block --json "$out/engine_latency_fp8.json"
        run engine_latency_gpt_oss 150 benchmarks.engine --section latency --latency-models gpt-oss-20b \
            --quantization config --json "$out/engine_latency_gpt_oss.json"
        run engine_throughput_30b_fp8 300 benchmarks.engine --section throughput --model qwen3-30b-a3b \
            --quantization fp8 --hf-seqs 0 --json "$out/engine_throughput_30b_fp8.json"
        run engine_throughput_fp8_kv 150 benchmarks.engine --section throughput --kv-cache-dtype fp8 --hf-seqs 0 \
            --json "$out/engine_throughput_fp8_kv.json"
        run engine_30b_fp8_fp8_kv 150 benchmarks.engine --section atom-core-runs --model qwen3-30b-a3b \
            --quantization fp8 --kv-cache-dtype fp8 --json "$out/engine_30b_fp8_fp8_kv.json"
        run ops_attention_fp8_pool 90 benchmarks.ops_attention --sdpa-only --decode-only --fp8-pool --kv-heads 4 \
            --decode 256x1024 256x2048 64x4096 1x512 --json "$out/ops_attention_fp8_pool.json"
        ;;
    fp8decode)
        run ops_scaled_mm_sweep_m1 480 benchmarks.ops_scaled_mm_sweep --tokens 1 --json "$out/ops_scaled_mm_sweep_m1.json"
        run ops_moe_small 90 benchmarks.ops_moe --no-compile --formats bf16 fp8_block fp8_channel --tokens 1 2 4 8 \
            --json "$out/ops_moe_small.json"
        run ops_dependent_launch 90 benchmarks.ops_dependent_launch --json "$out/ops_dependent_launch.json"
        run engine_profile_fp8 120 benchmarks.engine --section profile --model llama-3-8b --quantization fp8_block \
            --profile-bs 1 --profile-rows 26 --json "$out/engine_profile_fp8.json"
        ;;
    deepseek)
        run ops_mla 120 benchmarks.ops_mla --no-twin --json "$out/ops_mla.json"
        run engine_throughput_v2_lite 420 benchmarks.engine --section throughput --model deepseek-v2-lite \
            --hf-seqs 64 --hf-max-tokens 128 --hf-timeout 100 --json "$out/engine_throughput_v2_lite.json"
        ;;
    serve|structured|serving)
        if [ -d .whl ]; then  # (installed once; on the path of every part that needs it)
            [ -n "${serve_site:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
                --upgrade --target /tmp/site .whl/*.whl && export serve_site=1
            export PYTHONPATH=.:/tmp/site
        fi
        if [ $part != serving ]; then
            tests structured 150 tests/ops/test_token_mask.py tests/engine/test_structured_output.py \
                tests/serve/test_structured_output.py
            tokenizer=(); [ -n "${STRUCTURED_TOKENIZER:-}" ] && tokenizer=(--tokenizer "$STRUCTURED_TOKENIZER")
            run structured_output_op 90 benchmarks.structured_output --section op --device cuda "${tokenizer[@]}" \
                --json "$out/structured_output_op.json"
            run structured_output_engine 150 benchmarks.structured_output --section engine --device cuda \
                "${tokenizer[@]}" --model benchmarks/configs/qwen3-0.6b.json --load-format dummy --dtype bfloat16 \
                --json "$out/structured_output_engine.json"
        fi
        [ $part != structured ] && serving
        ;;
    *)
        echo "unknown part $part (tests, selftest, core, quant, fp8decode, deepseek, serve, structured, serving)"; exit 2
        ;;
    esac
done
