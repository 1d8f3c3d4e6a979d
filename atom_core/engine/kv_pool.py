"""The KV pool an engine allocates: its element type, its size (from ``num_kv_blocks``, or from the memory
left after the weights and one step's activations), and the activation headroom that size reserves.

Every rank of a multi-rank engine plans its own pool with :func:`plan_pool` (the engine keeps the
smallest; ``workers.py``).
"""

from __future__ import annotations

import itertools
import logging

import torch

from atom_core.cache import budget_for_instance, plan_kv_pool
from atom_core.cache.pool_sizing import check_fits_in_memory, host_memory_available_bytes
from atom_core.models.config import cuda_memory_info
from atom_core.models.layers.mla import EXPANDED_MAX_SLOTS_PER_TOKEN

logger = logging.getLogger(__name__)

CPU_DEFAULT_POOL_SEQS = 16  # without num_kv_blocks, a CPU pool holds at most this many max_model_len requests
CPU_POOL_MEMORY_SHARE = 0.25  # ... and at most this share of the host memory available when it is built


def step_activation_bytes(cfg, num_tokens: int, num_rows: int) -> int:
    """Headroom for one step's activations, in bytes (fp32 upper bound): hidden states and the
    widest MLP of ``num_tokens`` tokens, plus logits and sampling temporaries for ``num_rows`` rows.

    A dense MLP holds gate, up and their product (3 x intermediate_size per token). A MoE layer
    holds the same for each of its top-k experts plus each expert's down output before the
    weighted combine (K x (3 x moe_intermediate_size + hidden_size) per token), which for
    many-expert models (GLM-4.5, Qwen3-MoE) is the larger of the two.
    """
    mlp_width = 3 * cfg.intermediate_size
    top_k = cfg.get("num_experts_per_tok")
    if top_k:
        expert_size = cfg.get("moe_intermediate_size") or cfg.intermediate_size
        mlp_width = max(mlp_width, top_k * (3 * expert_size + cfg.hidden_size))
    return 4 * (num_tokens * (8 * cfg.hidden_size + mlp_width + mla_expansion_width(cfg))
                + num_rows * cfg.vocab_size * SAMPLING_COPIES)


def mla_expansion_width(cfg) -> int:
    """Values per query token of MLA's expanded form at its bound (``layers.mla.EXPANDED_MAX_SLOTS_PER_TOKEN``
    slots per token, each gathered (L + R), expanded to K and V [H, D] from two GEMM outputs [H, Dn] and
    [H, Dv]; q and the output [H, D] per token); 0 for other attention."""
    latent = cfg.get("kv_lora_rank")
    if not latent:
        return 0
    heads, nope, rope, v_dim = (cfg.num_attention_heads, cfg.get("qk_nope_head_dim"), cfg.get("qk_rope_head_dim"),
                                cfg.get("v_head_dim"))
    head_dim = max(nope + rope, v_dim)
    per_slot = heads * (2 * head_dim + nope + v_dim) + latent + rope
    return EXPANDED_MAX_SLOTS_PER_TOKEN * per_slot + 2 * heads * head_dim


# fp32-wide copies of the [rows, V] logits a step holds at once: the logits, the sampler's scaled copy,
# a sort's values and int64 indices (three widths), the log-probs. Measured on an H200 (Qwen3-0.6B,
# 256 rows, every filter and log-probs, debug checks on): 5.3 beyond the forward's own activations.
SAMPLING_COPIES = 6


KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def kv_cache_torch_dtype(kv_cache_dtype: str | torch.dtype) -> torch.dtype | None:
    """The pool's element type for ``Engine(kv_cache_dtype=...)``; None = the model's dtype ("auto")."""
    if kv_cache_dtype == "auto":
        return None
    if isinstance(kv_cache_dtype, torch.dtype):
        if kv_cache_dtype not in (torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype}: the pool holds float8_e4m3fn, bfloat16, float16 "
                             f"or float32")
        return kv_cache_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: choose 'auto' or one of {sorted(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def plan_pool(model, device: torch.device, *, block_size: int, num_kv_blocks: int | None, gpu_memory_utilization: float,
              max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, kv_cache_dtype):
    """The KV pool of ``model`` on ``device``: (spec, extra cache specs, plan). ``num_kv_blocks`` None: sized
    from memory (a CPU pool holds CPU_DEFAULT_POOL_SEQS requests of max_model_len, within
    CPU_POOL_MEMORY_SHARE of the host memory available; a GPU pool takes ``gpu_memory_utilization`` of the
    GPU less the model's weights and one step's activations, vLLM V1's per-instance share: memory others hold
    is not counted, but the share must be free); given: refused before allocating when it cannot fit."""
    pool_dtype = kv_cache_torch_dtype(kv_cache_dtype)
    spec = model.kv_cache_spec(pool_dtype)
    # Caches some models keep beside the KV pool over the same blocks (DSA's indexer keys, fp8 with their
    # scales in an fp8 pool): their bytes per block come out of the same budget.
    extra_specs = model.extra_kv_cache_specs(pool_dtype) if hasattr(model, "extra_kv_cache_specs") else {}
    extra_block_bytes = sum(extra.bytes_per_block(block_size) for extra in extra_specs.values())
    share = spec.bytes_per_block(block_size) / (spec.bytes_per_block(block_size) + extra_block_bytes)
    sizing = dict(block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    if num_kv_blocks is not None:
        plan = plan_kv_pool(spec, num_blocks=num_kv_blocks, **sizing)
    elif device.type == "cpu":
        block_bytes = spec.bytes_per_block(block_size) + extra_block_bytes
        plan = plan_kv_pool(spec, budget_bytes=int(_cpu_budget(block_bytes, block_size, max_model_len) * share),
                            **sizing)
    else:
        plan = plan_kv_pool(spec, budget_bytes=int(share * _gpu_budget(
            model, device, gpu_memory_utilization, max_num_batched_tokens, max_num_seqs)), **sizing)
    logger.info("KV pool: %d blocks of %d tokens (%.2f GiB)", plan.num_blocks, block_size, plan.kv_bytes / 2**30)
    if num_kv_blocks is not None:  # a pool asked for by size: refused before allocating when it cannot fit
        on_gpu = device.type == "cuda"
        check_fits_in_memory(f"a KV pool of num_kv_blocks={num_kv_blocks}",
                             plan.total_bytes + plan.num_blocks * extra_block_bytes,
                             cuda_memory_info(device)[0] if on_gpu else host_memory_available_bytes(),
                             where=str(device) if on_gpu else "host memory",
                             hint="ask for fewer num_kv_blocks, or leave it None to size the pool from memory")
    return spec, extra_specs, plan


def _cpu_budget(block_bytes: int, block_size: int, max_model_len: int) -> int:
    """Bytes of a CPU pool and the caches beside it (``block_bytes`` a block, both together): room for
    CPU_DEFAULT_POOL_SEQS requests of max_model_len, within CPU_POOL_MEMORY_SHARE of the host memory
    available (plan_kv_pool refuses, with the numbers, a budget that cannot hold one request)."""
    budget = CPU_DEFAULT_POOL_SEQS * -(-max_model_len // block_size) * block_bytes
    available = host_memory_available_bytes()
    if available is not None:
        budget = min(budget, int(available * CPU_POOL_MEMORY_SHARE))
    return budget


def _gpu_budget(model, device: torch.device, utilization: float, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """``utilization`` of the GPU for this engine (vLLM V1's per-instance rule, ``budget_for_instance``): less
    its weights and a step's activations; memory others hold (a trainer beside it) is not counted against it."""
    free, total = cuda_memory_info(device)  # a dropped engine's cached pool counts as free
    activations = step_activation_bytes(model.config, max_num_batched_tokens, max_num_seqs)
    index = torch.cuda.current_device() if device.index is None else device.index
    own = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers())
              if t.is_cuda and t.device.index == index)
    return budget_for_instance(total, free, own, activations, utilization)
