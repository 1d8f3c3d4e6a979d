"""A generation loop written from the parts alone — BlockManager, build_step_layout, load_model,
ops.sample — without Engine. Every step runs all unfinished sequences: the first computes the
prompts, the next ones decode one token each through the paged KV cache; a sequence stops at EOS
or after MAX_NEW_TOKENS.

    python examples/custom_loop.py [MODEL_FOLDER] [MAX_NEW_TOKENS]
"""

import sys
from pathlib import Path

import torch

import atom_core
from atom_core import ops
from atom_core.cache import BlockManager, build_step_layout
from atom_core.engine.tokenizer import Tokenizer
from atom_core.models import load_model

folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(atom_core.__file__).parent / "demo_model"
max_new_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 32
device = "cuda" if torch.cuda.is_available() else "cpu"
model = load_model(folder, device=device)
tokenizer = Tokenizer(folder)  # the engine's: prepends BOS where the checkpoint's tokenizer_config asks
eos_token_ids = set(model.config.eos_token_id)

# The KV pool: per layer a K and a V tensor of [num_blocks, block_size, num_kv_heads, head_dim].
block_size, num_blocks = 16, 128
spec = model.kv_cache_spec()
shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
model.bind_kv_cache([(torch.zeros(shape, dtype=spec.dtype, device=device),
                      torch.zeros(shape, dtype=spec.dtype, device=device)) for _ in range(spec.num_layers)])
blocks = BlockManager(num_blocks, block_size)

prompts = ["Return the number of", "This module provides", "Return the number of items in"]
tokens = {seq: tokenizer.encode(p) for seq, p in enumerate(prompts)}
prompt_lens = {seq: len(ids) for seq, ids in tokens.items()}
computed = {seq: blocks.allocate(seq, ids) for seq, ids in tokens.items()}  # prefix-cache hits skip tokens
print("tokens served from the prefix cache:", computed)
running = list(tokens)

for step in range(max_new_tokens):
    seqs = list(running)
    for seq in seqs:  # room for this step's tokens (decode: one more slot)
        assert blocks.append_slots(seq, len(tokens[seq])), "pool full"
    query_lens = [len(tokens[s]) - computed[s] for s in seqs]
    layout = build_step_layout(query_lens, [computed[s] for s in seqs], [blocks.block_table(s) for s in seqs],
                               block_size).to(device)
    input_ids = torch.tensor([t for s in seqs for t in tokens[s][computed[s]:]], device=device)

    hidden = model(input_ids, layout.positions, layout)
    logits = model.compute_logits(hidden[layout.logits_indices])

    n = len(seqs)
    next_ids = ops.sample(logits, temperature=torch.full((n,), 0.7, device=device),
                          top_k=torch.full((n,), 50, dtype=torch.int32, device=device),
                          top_p=torch.full((n,), 0.9, device=device), min_p=torch.zeros(n, device=device),
                          seeds=torch.arange(n, device=device), offsets=torch.full((n,), step, device=device))
    for seq, token in zip(seqs, next_ids.tolist()):
        computed[seq] = len(tokens[seq])
        blocks.publish(seq, tokens[seq], computed[seq])  # full blocks become prefix-cache entries
        tokens[seq].append(token)
        if token in eos_token_ids:  # finished: its blocks go back to the pool (cached ones stay reusable)
            running.remove(seq)
            blocks.free(seq)
    if not running:
        break

for seq, prompt in enumerate(prompts):
    if seq in running:
        blocks.free(seq)
    ended = "EOS" if tokens[seq][-1] in eos_token_ids else f"{max_new_tokens} tokens"
    print(f"{prompt!r} -> {tokenizer.decode(tokens[seq][prompt_lens[seq]:])!r}  [{ended}]")
blocks.check_integrity()
