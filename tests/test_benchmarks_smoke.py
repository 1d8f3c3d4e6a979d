"""The op benchmark scripts run end to end at their ``--smoke`` sizes on a CPU (Triton in the
interpreter) and give complete rows: the scripts that produce docs/benchmarks.md do not rot. Every
result file carries its run's metadata, and every row of a script that times kernels says how it was
timed (``timing``); the JSON readers take both the new and the older bare-list form."""

import json
import math
import sys

import pytest
import torch

from benchmarks import (
    comm,
    common,
    ops_attention,
    ops_dependent_launch,
    ops_elementwise,
    ops_mla,
    ops_moe,
    ops_sampling,
    ops_scaled_mm,
    roofline,
    to_markdown,
)

# Scripts that time Triton kernels alone run with --device cpu only under the interpreter (not on a GPU machine).
needs_triton_on_the_cpu = pytest.mark.skipif(not common.runs_on("triton", "cpu"),
                                             reason="Triton runs CPU tensors only in its interpreter")

# What run_metadata must record (docs/benchmarks.md, "Conventions").
META_KEYS = {"gpu", "cuda", "hip", "torch", "triton", "transformers", "python", "commit", "dirty", "hostname",
             "utc", "command", "triton_cache"}


@pytest.mark.parametrize("script, columns", [
    (ops_elementwise, {"op", "tokens", "backend", "ms", "GB/s", "%copy", "eager_ms", "x_eager", "timing"}),
    pytest.param(ops_dependent_launch, {"tokens", "variant", "ms", "x_off", "same_bits", "timing"},
                 marks=needs_triton_on_the_cpu),
    (ops_sampling, {"op", "rows", "vocab", "backend", "ms", "GB/s", "%copy", "eager_ms", "x_eager", "timing"}),
    (ops_moe, {"op", "tokens", "backend", "ms", "x_twin", "timing"}),
    (ops_scaled_mm, {"format", "M", "N", "K", "backend", "ms", "TFLOP/s", "%copy", "x_bf16", "timing"}),
    (ops_attention, {"case", "batch", "ms", "x_sdpa", "x_twin", "timing"}),
    (ops_mla, {"case", "batch", "context", "topk", "backend", "ms", "MB_read", "GB/s", "%copy", "x_sdpa", "x_twin",
               "x_dense", "timing"}),
], ids=lambda v: getattr(v, "__name__", "").rpartition(".")[2])
def test_smoke_run_writes_complete_rows_and_meta(script, columns, tmp_path, monkeypatch):
    path = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", [script.__name__, "--device", "cpu", "--smoke", "--json", str(path)])
    script.main()
    data = json.loads(path.read_text())
    assert set(data) == {"meta", "rows"}
    meta, rows = data["meta"], data["rows"]
    assert META_KEYS <= set(meta), f"missing {sorted(META_KEYS - set(meta))} in meta"
    assert meta["torch"] == torch.__version__ and meta["commit"]
    assert set(meta["triton_cache"]) == {"dir", "empty", "state"}
    assert meta["triton_cache"]["state"] in ("cold", "warm")
    assert rows
    for row in rows:
        assert columns <= set(row), f"missing {sorted(columns - set(row))} in {row}"
        assert row["ms"] > 0 and math.isfinite(row["ms"])
        if "timing" in columns:
            assert row["timing"] == "eager (cpu)"  # every figure of a CPU run: wall-clock eager calls


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")
@needs_triton_on_the_cpu
@pytest.mark.parametrize("weight_format", ["bf16", "fp8_block"])
def test_moe_sweep_times_every_candidate_against_the_default_launch_and_each_computes_the_same(weight_format):
    # The default launch comes first, marked, and every candidate's output equals the bf16 kernel's up to
    # accumulation order (fp32 smoke sizes: bf16 arm) or fp8's rounding (fp8 arm, same for every launch).
    pytest.importorskip("triton")
    from atom_core.ops.triton import fused_moe as triton_moe
    rows = ops_moe.sweep(weight_format, "cpu", smoke=True, tokens=[8])
    sizes = ops_moe.layer_sizes(True)
    configs = (ops_moe.bf16_sweep_configs if weight_format == "bf16" else ops_moe.fp8_sweep_configs)(8, sizes)
    default = (triton_moe.block_config(8, sizes["top_k"], sizes["num_experts"], sizes["dtype"])
               if weight_format == "bf16" else
               triton_moe.quant_block_config(8, sizes["top_k"], sizes["num_experts"], sizes["dtype"], weight_format))
    assert [r["config"] for r in rows] == [ops_moe.config_name(c) for c in dict.fromkeys([default, *configs])]
    assert [r["default"] for r in rows] == [True] + [False] * (len(rows) - 1)
    errors = [r["rel_err"] for r in rows]
    assert all(r["ms"] > 0 for r in rows)
    assert max(errors) < (1e-5 if weight_format == "bf16" else 0.1)
    assert max(errors) - min(errors) < 1e-5


def test_comm_smoke_run_over_two_gloo_ranks_writes_both_sections(tmp_path):
    """benchmarks/comm.py at its --smoke sizes on the CPU: two spawned ranks over gloo, rank 0 writes the rows."""
    path = tmp_path / "comm.json"
    comm.main(["--device", "cpu", "--smoke", "--json", str(path)])
    data = json.loads(path.read_text())
    assert META_KEYS <= set(data["meta"])
    reduce_rows = [r for r in data["rows"] if r["section"] == "all_reduce"]
    moe_rows = [r for r in data["rows"] if r["section"] == "moe"]
    assert [r["tokens"] for r in reduce_rows] == [1, 5] and all(r["ranks"] == 2 for r in data["rows"])
    assert all(r["ops_us"] > 0 and r["torch_us"] > 0 and r["mode"] == "eager" for r in reduce_rows)
    assert [(r["ep_comm"], r["exchange"]) for r in moe_rows[:3]] == [("all_reduce", "-"), ("all_to_all", "padded"),
                                                                    ("all_to_all", "exact")]
    assert all(math.isfinite(r["layer_us"]) and r["layer_us"] > 0 for r in moe_rows)


class _FakeEvent:
    """Stands in for torch.cuda.Event on a machine without CUDA: every interval lasts 2 ms."""

    def record(self):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return 2.0


class _FakeGenerator:
    """Stands in for the device's default CUDA generator: records the state it is given."""

    def __init__(self):
        self.states = []

    def clone_state(self):
        return "fresh copy"

    def graphsafe_set_state(self, state):
        self.states.append(state)


def _fake_cuda(monkeypatch, capture_error: Exception) -> _FakeGenerator:
    def no_graph():
        raise capture_error

    generator = _FakeGenerator()

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing: _FakeEvent())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", no_graph)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "default_generators", (generator,))
    return generator


def test_bench_timed_names_the_eager_fallback_and_its_reason(monkeypatch):
    try:  # a failure inside the capture, then the graph's own error on closing it
        try:
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")
        finally:
            raise RuntimeError("operation failed due to a previous error during capture")
    except RuntimeError as e:
        error = e
    generator = _fake_cuda(monkeypatch, error)
    calls = []
    timing = common.bench_timed(lambda: calls.append(1), warmup=1, iters=5, device="cuda")
    assert timing == common.Timing(2.0, "eager (graph capture failed: RuntimeError: operation not permitted "
                                        "when stream is capturing)")
    assert calls  # timed eagerly all the same
    assert generator.states == ["fresh copy"]  # the random generator is no longer counted as captured
    assert common.bench_timed(lambda: None, warmup=0, iters=5, device="cuda", graph=False).mode == \
        "eager (graph=False)"
    assert common.bench(lambda: None, warmup=0, iters=5, device="cuda") == 2.0  # the float API still works


def test_bench_timed_on_cpu_says_eager_cpu():
    timing = common.bench_timed(lambda: torch.ones(4).sum(), warmup=1, iters=3, device="cpu")
    assert timing.mode == "eager (cpu)" and timing.ms >= 0
    assert common.adaptive_timing("cpu", smoke=True)(lambda: None).mode == "eager (cpu)"
    assert isinstance(common.adaptive_timer("cpu", smoke=True)(lambda: None), float)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_timed_on_gpu_graph_and_real_capture_failure():
    x = torch.ones(1024, device="cuda")
    assert common.bench_timed(lambda: x.mul_(1.0), warmup=2, iters=20).mode == "graph"
    failed = common.bench_timed(lambda: x.sum().item(), warmup=2, iters=20)  # a host sync cannot be captured
    assert failed.mode.startswith("eager (graph capture failed: ")
    assert "previous error during capture" not in failed.mode  # the first error, not its echo
    torch.randn(4, device="cuda")  # random ops still work after the failed capture
    assert common.bench_timed(lambda: x.mul_(1.0), warmup=2, iters=20).mode == "graph"


def test_timing_column_says_which_figure_was_timed_how():
    graph, cpu = common.Timing(1.0, "graph"), common.Timing(1.0, "eager (cpu)")
    failed = common.Timing(3.0, "eager (graph capture failed: RuntimeError: sync)")
    assert common.timing_column({"ms": graph, "eager_ms": graph, "compile_ms": None}) == "graph"
    assert common.timing_column({"ms": cpu}) == "eager (cpu)"
    assert common.timing_column({"ms": graph, "twin_ms": failed, "compile_ms": failed}) == \
        "ms: graph; twin_ms, compile_ms: eager (graph capture failed: RuntimeError: sync)"


def test_triton_cache_state_cold_then_warm(tmp_path, monkeypatch):
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    assert common.triton_cache_state() == {"dir": str(cache), "empty": True, "state": "cold"}  # missing
    cache.mkdir()
    assert common.triton_cache_state()["state"] == "cold"  # empty
    (cache / "kernel").mkdir()
    assert common.triton_cache_state() == {"dir": str(cache), "empty": False, "state": "warm"}


def test_commit_from_the_environment_wins_else_unknown_without_git(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOM_CORE_COMMIT", "abc123")
    assert common.git_commit() == {"commit": "abc123", "dirty": None}  # even inside the repository
    monkeypatch.setattr(common, "REPO_ROOT", tmp_path)  # not a git repository
    assert common.git_commit() == {"commit": "abc123", "dirty": None}
    monkeypatch.delenv("ATOM_CORE_COMMIT")
    assert common.run_metadata()["commit"] == "unknown"


def test_readers_take_both_json_forms(tmp_path, monkeypatch):
    rows = [{"op": "fused_experts", "tokens": 1, "ms": 0.5, "weight_MB": 1.0}]
    old, new = tmp_path / "h200_ops_moe.json", tmp_path / "new.json"
    old.write_text(json.dumps(rows))
    common.write_json(rows, str(new))
    assert to_markdown.load_result(old) == (None, rows)
    meta, new_rows = to_markdown.load_result(new)
    assert new_rows == rows and META_KEYS <= set(meta)
    assert to_markdown.render(old) == to_markdown.table(rows)
    rendered = to_markdown.render(new)
    assert rendered.startswith(to_markdown.table(rows)) and "Triton cache" in rendered
    monkeypatch.setattr(roofline, "RESULTS", tmp_path)
    assert roofline.load("ops_moe") == rows
    new.rename(old)
    assert roofline.load("ops_moe") == rows


def test_a_table_has_every_rows_columns_and_a_merged_runs_caption_names_each_run():
    rows = [{"model": "m", "ms": 1.0}, {"model": "m", "ms": 0.5, "vs_bf16": 2.0}]
    assert to_markdown.table(rows).splitlines()[0] == "| model | ms | vs_bf16 |"
    meta = {"gpu": "G", "torch": "2.11", "commit": ["aaaaaaaaaaaa1", "bbbbbbbbbbbb2"], "dirty": [False, True],
            "triton_cache": [{"state": "warm"}, {"state": "cold"}], "utc": ["t1", "t2"]}
    assert to_markdown.caption(meta) == "*G; torch 2.11; commit aaaaaaaaaa / bbbbbbbbbb; Triton cache warm / cold at " \
                                        "start; t1 / t2*"
    assert "Triton cache warm at start" in to_markdown.caption({"triton_cache": "warm"})


# The DeepSeek shapes of benchmarks/configs shrunk to a CPU-sized model, every other key kept.
TINY_DEEPSEEK = {"vocab_size": 101, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 24,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
                 "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
                 "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                 "index_n_heads": 4, "index_head_dim": 16, "index_topk": 8, "max_position_embeddings": 256,
                 "bos_token_id": 0, "eos_token_id": 1}


@pytest.mark.parametrize("name, q_lora_rank, indexer_bytes", [("deepseek-v2-lite", None, 0),
                                                              ("deepseek-v3", 24, 0),
                                                              ("deepseek-v3.2", 24, 2 * 16 * 4)])
def test_deepseek_configs_build_and_report_kv_bytes_against_per_head_kv(name, q_lora_rank, indexer_bytes):
    """benchmarks.engine's configs build as their architecture (the throughput section drops a
    quantization_config as build_bench_model does), transformers reads them as build_hf_model does, and the
    KV line counts one latent row (L + R) per layer, plus DSA's indexer key, against H x (Dn + R + Dv)."""
    from atom_core.models import build_model
    from benchmarks import engine as bench_engine

    cfg = bench_engine.load_config(name)
    assert cfg["kv_lora_rank"] == 512 and cfg["qk_rope_head_dim"] == 64 and cfg.get("q_lora_rank") == (
        None if q_lora_rank is None else 1536)
    tiny = cfg | TINY_DEEPSEEK | ({"q_lora_rank": q_lora_rank} if q_lora_rank else {})
    model = build_model({k: v for k, v in tiny.items() if k != "quantization_config"}, device="cpu",
                        dtype=torch.float32, load_format="zeros")
    assert type(model).__name__ == cfg["architectures"][0]
    kv = bench_engine.kv_bytes_per_token(model, tiny, torch.float32)
    latent = 2 * (32 + 8) * 4                    # layers x (L + R) x fp32
    per_head = 2 * 4 * (16 + 8 + 16) * 4         # layers x H x (Dn + R + Dv) x fp32
    assert kv == {"kv_bytes_per_token": latent + indexer_bytes, "kv_bytes_per_token_gqa": per_head,
                  "kv_vs_gqa": (latent + indexer_bytes) / per_head}
    transformers = pytest.importorskip("transformers")
    if cfg["model_type"] in ("deepseek_v2", "deepseek_v3"):
        hf_config = transformers.AutoConfig.for_model(cfg["model_type"],
                                                      **{k: v for k, v in tiny.items() if k != "model_type"})
        assert hf_config.kv_lora_rank == 32 and hf_config.q_lora_rank == q_lora_rank


def test_engine_dp_smoke_run_with_dp_attention_compares_two_ranks_with_one_engine(tmp_path, monkeypatch):
    """benchmarks/engine_dp --dp-attention on a CPU: a Qwen3-MoE split over two DP-attention ranks against one
    engine holding the whole model, the same workload."""
    from benchmarks import engine_dp

    monkeypatch.setenv("ATOM_CORE_BACKEND", "torch")  # the replica processes read it at import
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = tmp_path / "out.json"
    engine_dp.main(["--device", "cpu", "--smoke", "--model", "qwen3-30b-a3b", "--dp-attention", "--num-seqs", "4",
                    "--no-front-1", "--json", str(path)])
    one, two = json.loads(path.read_text())["rows"]
    assert (one["system"], two["system"]) == ("one engine", "front, 2 replicas, DP attention")
    assert one["output_tokens"] == two["output_tokens"] > 0 and math.isfinite(two["vs_one_engine"])


def test_engine_dp_smoke_run_compares_replicas_with_one_engine(tmp_path, monkeypatch):
    """benchmarks/engine_dp on a CPU: one engine and a front over two replica processes, the same workload."""
    from benchmarks import engine_dp

    monkeypatch.setenv("ATOM_CORE_BACKEND", "torch")  # the replica processes read it at import
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = tmp_path / "out.json"
    engine_dp.main(["--device", "cpu", "--smoke", "--num-seqs", "4", "--no-front-1", "--json", str(path)])
    data = json.loads(path.read_text())
    assert META_KEYS <= set(data["meta"])
    one, two = data["rows"]
    assert (one["system"], one["replicas"], two["replicas"]) == ("one engine", 1, 2)
    assert one["output_tokens"] == two["output_tokens"] > 0 and one["vs_one_engine"] == 1
    assert two["requests_per_replica"] == "2/2" and math.isfinite(two["vs_one_engine"])


def test_engine_tp_variants_default_to_tp_1_and_2_and_take_any_sizes():
    from benchmarks.engine import load_config, tp_variants

    dense, moe = load_config("llama-3-70b"), load_config("qwen3-30b-a3b")
    modes = ["all_reduce", "all_to_all"]
    assert tp_variants(moe, [1, 2], modes) == [(1, False), (2, False), (2, "all_reduce"), (2, "all_to_all")]
    assert tp_variants(dense, [4, 8], modes) == [(4, False), (8, False)]
    assert tp_variants(moe, [1, 8], modes, ep_sizes=[4, 8]) == [(1, False), (8, False), (4, "all_reduce"),
                                                                (4, "all_to_all"), (8, "all_reduce"), (8, "all_to_all")]
    assert tp_variants(moe, [8], modes, ep_sizes=[]) == [(8, False)]
    assert tp_variants(moe, [], ["all_to_all"], ep_sizes=[8]) == [(8, "all_to_all")]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")
def test_engine_tp_smoke_run_at_four_gloo_ranks_gives_the_copy_bandwidth_fraction(tmp_path, monkeypatch):
    """benchmarks/engine --section tp on a CPU: Llama-3-70B's family at CPU size over 4 ranks (three worker
    processes). Measured on 2 shared cores: 11 - 12 s (20 s with other work on the cores)."""
    from benchmarks import engine

    monkeypatch.setenv("ATOM_CORE_BACKEND", "torch")  # the worker processes read it at import
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["engine", "--section", "tp", "--smoke", "--device", "cpu", "--dtype", "float32",
                                      "--latency-models", "llama-3-70b", "--tp-sizes", "4", "--json", str(path)])
    engine.main()
    data = json.loads(path.read_text())
    assert META_KEYS <= set(data["meta"])
    rows = data["rows"]
    assert [(r["tp"], r["metric"]) for r in rows] == [(4, "decode ms/step bs1"), (4, "decode ms/step bs4"),
                                                      (4, "nano-vllm output tok/s")]
    assert all(r["vs_first"] == 1 and r["value"] > 0 for r in rows)
    for row in rows[:2]:
        assert 0 < row["weight_GB_per_rank"] and 0 < row["%agg_copy_bw"] and math.isfinite(row["%agg_copy_bw"])


@pytest.mark.parametrize("tied", [False, True])
def test_a_decode_step_reads_the_embedding_rows_it_gathers_unless_the_head_is_tied(tied):
    from atom_core.models import build_model
    from benchmarks.engine import TP_SMOKE_SHAPES, load_config, step_weight_bytes

    cfg = load_config("llama-3-8b") | TP_SMOKE_SHAPES | {"tie_word_embeddings": tied}
    model = build_model(cfg, device="cpu", dtype=torch.float32, load_format="zeros")
    stored = sum(p.numel() * p.element_size() for p in model.parameters())
    table = cfg["vocab_size"] * cfg["hidden_size"] * 4
    for bs in (1, 64):
        want = stored if tied else stored - table + bs * cfg["hidden_size"] * 4
        assert step_weight_bytes(model, bs) == want
