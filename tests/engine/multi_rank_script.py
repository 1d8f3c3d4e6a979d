"""What a user's multi-rank script looks like (run by tests/engine/test_multi_rank.py under launchers).

    python multi_rank_script.py MODEL_DIR OUT.json [--own-world] [--expert-parallel]

Every rank runs this same file. ``Engine.from_pretrained(..., tensor_parallel_size=N)`` joins the
world the launcher describes (``torchrun``'s environment; N is its ``WORLD_SIZE``: nodes x processes
per node); rank 0 gets the engine, generates and writes the greedy tokens to OUT.json; the other ranks
serve inside the call and get None.

``--own-world``: the script owns its process group and its model (a framework's case): it
initializes ``torch.distributed`` itself, builds ``ParallelContext.from_world``, loads its shard,
and passes the model to ``Engine(...)`` on rank 0 / ``run_worker(model)`` on the others.
"""

import json
import os
import sys

import torch

from atom_core.engine import Engine, SamplingParams
from atom_core.engine.workers import run_worker

PROMPTS = [[1, 5, 42, 7, 9, 11, 3], [3, 4], list(range(10, 30))]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
ENGINE_ARGS = dict(block_size=4, max_num_batched_tokens=8)  # the 20-token prompt is chunked


def main() -> None:
    folder, out = sys.argv[1], sys.argv[2]
    expert_parallel = "--expert-parallel" in sys.argv
    if "--own-world" in sys.argv:
        import torch.distributed as dist

        from atom_core.models import ParallelContext, load_model

        dist.init_process_group("gloo")  # torchrun's environment
        try:
            ctx = ParallelContext.from_world(expert_parallel=expert_parallel)
            model = load_model(folder, dtype=torch.float32, device="cpu", parallel=ctx)
            if ctx.tp_rank != 0:
                run_worker(model)
                return
            with Engine(model, device="cpu", **ENGINE_ARGS) as engine:
                outputs = engine.generate(PROMPTS, PARAMS, use_tqdm=False)
        finally:
            dist.destroy_process_group()
    else:
        engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, tensor_parallel_size=int(os.environ["WORLD_SIZE"]),
                                        expert_parallel=expert_parallel, **ENGINE_ARGS)
        if engine is None:  # a worker rank: it served rank 0's steps until rank 0 shut the engine down
            return
        with engine:
            outputs = engine.generate(PROMPTS, PARAMS, use_tqdm=False)
    with open(out, "w") as f:
        json.dump([o.token_ids for o in outputs], f)


if __name__ == "__main__":
    main()
