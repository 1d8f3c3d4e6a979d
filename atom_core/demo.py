"""python -m atom_core.demo: generate text with the engine and report tokens/s.

Without --model it runs the small model that ships with the package (trained on Python
standard-library docstrings by scripts/train_demo_model.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from atom_core.serve.engine_options import (DEFAULT_PROMPTS, DEFAULT_THREADS, HUB_ID, Parser, UsageError,
                                             clean_text, finite_float, generate_and_print, positive_int, thread_count)

PROG = "python -m atom_core.demo"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("--model", default=None,
                        help="a local checkpoint folder (config.json, *.safetensors, tokenizer.json); "
                             "default: the built-in demo model")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few built-in ones")
    parser.add_argument("--max-tokens", type=positive_int, default=48,
                        help="tokens to generate per prompt (default 48)")
    parser.add_argument("--temperature", type=finite_float(0.0, 100.0), default=0.7,
                        help="sampling temperature; 0 = greedy (default 0.7)")
    parser.add_argument("--top-p", type=finite_float(0.0, 1.0, low_open=True), default=0.9, help="(default 0.9)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first prompt; prompt i uses seed + i")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="longest sequence (prompt + output) in tokens; sizes the KV pool "
                             "(default: the engine's choice for the model)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None,
                        help="float32, bfloat16, float16 or auto (default auto: the model's on GPU, float32 on CPU)")
    parser.add_argument("--threads", type=thread_count, default=DEFAULT_THREADS,
                        help=f"CPU threads for torch (default {DEFAULT_THREADS}: half the cores, at most 4). "
                             "One thread per core oversubscribes a machine whose cores other processes use: "
                             "on 2 shared cores the demo ran at ~590 tokens/s with 1 thread, ~160 with 2")
    return parser


def _check_model_folder(model: str | None) -> None:
    if model is None or Path(model).is_dir():
        return
    if not Path(model).exists() and HUB_ID.match(model):
        folder = model.rsplit("/", 1)[1]
        raise UsageError(f"{model!r} is not a local folder, and atom_core loads only local checkpoint folders; "
                         f"download it first (huggingface-cli download {model} --local-dir {folder}) "
                         f"and pass --model {folder}")
    what = "not a folder" if Path(model).exists() else "no such folder"
    raise UsageError(f"--model {model!r}: {what} (expected a checkpoint folder with config.json, "
                     f"*.safetensors and tokenizer.json)")


def run(args: argparse.Namespace) -> None:
    import torch

    from atom_core.engine import Engine, SamplingParams

    torch.set_num_threads(args.threads)
    _check_model_folder(args.model)
    if args.device is not None:
        try:
            torch.device(args.device)
        except RuntimeError:
            raise UsageError(f"--device {args.device!r}: expected cpu, cuda or cuda:N") from None
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                    max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=args.max_model_len)
    if engine.tokenizer is None:
        raise UsageError(f"--model {args.model!r}: the demo needs a model with a tokenizer (tokenizer.json); "
                         "atom-core bench --offline runs one without")
    prompts = [clean_text(p) for p in args.prompt] if args.prompt else DEFAULT_PROMPTS
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                             seed=args.seed + i) for i in range(len(prompts))]
    engine.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)  # warm-up: one-time set-up costs
    generate_and_print(engine, prompts, params, note=f", {args.threads} CPU thread(s)")


def main(argv: list[str] | None = None) -> int:
    """Run the demo; a user error (a bad flag or value, a missing folder, a value the library
    refuses) prints one line, ``error: ...``, on stderr and returns 2 instead of a traceback."""
    try:
        run(build_parser().parse_args(argv))
    except (UsageError, ValueError, TypeError, FileNotFoundError, MemoryError) as e:
        print(f"error: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
