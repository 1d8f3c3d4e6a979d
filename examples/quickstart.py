"""Generate with the engine in a few lines (the built-in demo model unless a path is given)."""

import sys

from atom_core.engine import Engine, SamplingParams

engine = Engine.from_pretrained(sys.argv[1] if len(sys.argv) > 1 else None)
prompts = ["Return the number of", "This module provides"]
for prompt, out in zip(prompts, engine.generate(prompts, SamplingParams(temperature=0.7, max_tokens=32, seed=0))):
    print(f"{prompt}{out.text!r}  [{out.finish_reason}]")
