"""``python -m atom_core.demo``: generate text with the engine and report tokens/s.

Without ``--model`` it runs the small model that ships with the package (trained on Python
standard-library docstrings by ``scripts/train_demo_model.py``).
"""

from __future__ import annotations

import argparse
import time

DEFAULT_PROMPTS = [
    "Return the number of",
    "This module provides",
    "If the file does not exist,",
    "Create a new",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the built-in demo model)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few built-in ones")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: the model's on GPU, float32 on CPU)")
    args = parser.parse_args(argv)

    from atom_core.engine import Engine, SamplingParams

    engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype, max_num_seqs=64,
                                    max_num_batched_tokens=2048)
    prompts = args.prompt or DEFAULT_PROMPTS
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                             seed=args.seed + i) for i in range(len(prompts))]
    engine.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up: one-time set-up costs
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        print(f"--- {prompt!r}\n{prompt}{out.text}\n")
    generated = sum(len(o.token_ids) for o in outputs)
    print(f"{generated} tokens in {elapsed:.2f} s: {generated / elapsed:.1f} tokens/s "
          f"({len(prompts)} prompts, device {engine.device})")


if __name__ == "__main__":
    main()
