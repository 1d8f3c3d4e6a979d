"""Pure KV-cache arithmetic: pool sizing, the block manager with its prefix cache, token layout.

Imports only torch, numpy and xxhash: no GPU, no Triton, no other atom_core layer.
"""

from atom_core.cache.block_manager import BlockManager, PrefixCacheStats
from atom_core.cache.page_table import block_table_to_csr, csr_to_block_table
from atom_core.cache.pool_sizing import KVCacheSpec, PoolPlan, budget_for_instance, budget_from_memory, plan_kv_pool
from atom_core.cache.prefix_hash import hash_block_tokens
from atom_core.cache.token_layout import StepLayout, build_decode_layout, build_step_layout

__all__ = [
    "BlockManager",
    "KVCacheSpec",
    "PoolPlan",
    "PrefixCacheStats",
    "StepLayout",
    "block_table_to_csr",
    "budget_for_instance",
    "budget_from_memory",
    "build_decode_layout",
    "build_step_layout",
    "csr_to_block_table",
    "hash_block_tokens",
    "plan_kv_pool",
]
