"""The engine flags every ``atom-core`` command shares, the engine they build, and the chat template
used for a model that has none. Imports nothing beyond the base install."""

from __future__ import annotations

import argparse
import atexit
import functools
import logging
import math
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

# Used by `atom-core chat` and `atom-core serve` when a model ships no chat template (the demo model):
# plain "role: content" lines, then "assistant:" to answer.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# Half the cores, at most 4. Measured with the demo model on a 2-core machine shared with one
# other busy process: 1 thread ~590 tokens/s, 2 threads ~160 (torch's default, one per core: its
# worker threads wait on each other whenever another process holds a core). Small models gain
# little from more threads; leaving cores free keeps the machine usable.
DEFAULT_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))
# "owner/name" that is not a local path: what a Hugging Face Hub model id looks like.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class UsageError(Exception):
    """A mistake in the command line: one line on stderr, exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(message)


def int_at_least(low: int):
    """An argparse type: an integer >= ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def thread_count(text: str) -> int:
    """--threads: 1 .. the machine's cores (more oversubscribes them, and a huge count crashes OpenMP)."""
    value = positive_int(text)
    cores = os.cpu_count() or 1
    if value > cores:
        raise argparse.ArgumentTypeError(f"expected at most this machine's {cores} cores, got {value}")
    return value


def clean_text(text: str) -> str:
    """``text`` with what is not Unicode text (the lone surrogates Python makes of undecodable bytes in argv
    or stdin) replaced by U+FFFD, as a tokenizer takes only valid text."""
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def finite_float(low: float, high: float, *, low_open: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
            raise argparse.ArgumentTypeError(f"expected a number in {'(' if low_open else '['}{low:g}, {high:g}], "
                                             f"got {text!r}")
        return value
    return parse


def add_engine_arguments(parser: argparse.ArgumentParser, *, with_path: bool = True, model_flag: bool = True) -> None:
    """The engine flags; ``model_flag``: also ``--model PATH`` (vLLM's spelling of PATH; ``bench`` has a ``--model``
    of its own, the served model's name)."""
    if with_path:
        parser.add_argument("path", nargs="?", default=None,
                            help="a local checkpoint folder (config.json, *.safetensors, tokenizer.json), or with "
                                 "--load-format dummy a config.json file; default: the built-in demo model")
        if model_flag:
            parser.add_argument("--model", dest="model_path", metavar="PATH", default=None,
                                help="PATH given as a flag (vLLM's spelling); with PATH too, both must name it")
    group = parser.add_argument_group("engine")
    group.add_argument("--max-model-len", type=positive_int, default=None,
                       help="longest sequence (prompt + output) in tokens (default: the engine's choice)")
    group.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    group.add_argument("--dtype", default=None, help="float32, bfloat16, float16 or auto (default auto: the model's "
                                                     "on GPU, float32 on CPU)")
    group.add_argument("--max-num-seqs", type=positive_int, default=256, help="rows per step (default 256)")
    group.add_argument("--max-num-batched-tokens", type=positive_int, default=8192,
                       help="tokens per step (default 8192)")
    group.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                       help="KV pool element type (default auto: the model's)")
    group.add_argument("--num-kv-blocks", type=positive_int, default=None,
                       help="KV pool size in blocks (default: from memory)")
    group.add_argument("--gpu-memory-utilization", type=finite_float(0.0, 1.0, low_open=True), default=0.9,
                       help="share of GPU memory for weights, activations and the KV pool (default 0.9)")
    group.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (default 16)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="the prefix cache (default on; vLLM's flag)")
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=True,
                       help="turn the prefix cache off (= --no-enable-prefix-caching)")
    group.add_argument("--max-logprobs", type=int_at_least(-1), default=20,
                       help="the most top alternatives a request may ask per token (logprobs, top_logprobs, "
                            "prompt_logprobs; default 20, vLLM's; -1: no limit)")
    group.add_argument("--logprobs-mode", default="raw_logprobs",
                       choices=["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"],
                       help="what logprobs and prompt_logprobs return: the log-probs (or logits) of the model's raw "
                            "logits (default raw_logprobs), or of the scores sampling drew from (processed_*: after "
                            "penalties, biases, temperature and top-k/top-p/min-p; prompt positions stay raw); "
                            "vLLM's flag")
    group.add_argument("--generation-config", default="auto", metavar="{auto,vllm,FOLDER}",
                       help="sampling defaults and extra EOS ids: auto = the checkpoint's generation_config.json "
                            "(default), vllm = no sampling defaults (its EOS ids still end sequences), or a folder "
                            "whose generation_config.json replaces the checkpoint's (vLLM's values)")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for vLLM command lines and does nothing: atom_core never runs code from a "
                            "checkpoint (its architectures are built in)")
    group.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    group.add_argument("--enable-sleep-mode", action="store_true",
                       help="allow Engine.sleep / wake_up, which free and take back the engine's GPU memory (KV "
                            "pool, CUDA graphs, weights) for a trainer beside it; vLLM's flag")
    group.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy", "zeros"],
                       help="dummy: random weights of the config's shapes (benchmarks)")
    group.add_argument("--quantization", default=None, choices=["fp8", "fp8_block"],
                       help="quantize an unquantized checkpoint while loading")
    group.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                       help="split the model over this many ranks (this process is rank 0; on CUDA rank r uses GPU r)")
    group.add_argument("--expert-parallel", action="store_true",
                       help="with --tensor-parallel-size: split a MoE model's experts whole over the ranks")
    group.add_argument("--expert-exchange", default="all_reduce", choices=["all_reduce", "all_to_all"],
                       help="with --expert-parallel: combine the experts' outputs by an all-reduce over replicated "
                            "tokens (default), or send each token to the ranks of its experts (all-to-all)")
    group.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1,
                       help="this many engine replicas, each its own process (on CUDA replica i uses GPUs "
                            "i*TP .. i*TP+TP-1), requests routed to the least loaded")
    group.add_argument("--dp-attention", action="store_true",
                       help="with --data-parallel-size and a MoE model: the replicas hold the whole attention and "
                            "split the experts among them, each sending its own tokens to their experts (all-to-all); "
                            "the replicas step together, eagerly")
    group.add_argument("--threads", type=thread_count, default=DEFAULT_THREADS,
                       help=f"CPU threads for torch, in this process and each rank or replica it starts "
                            f"(default {DEFAULT_THREADS}: half the cores, at most 4)")


def model_folder(path: str | None, load_format: str) -> str | None:
    """The checkpoint folder to load (None = the demo model); a config.json file with a dummy load
    format is copied into a temporary folder of its own, with the tokenizer, chat templates and
    generation config that sit beside it."""
    if path is None:
        return None
    p = Path(path)
    if p.is_file() and p.suffix == ".json" and load_format in ("dummy", "zeros"):
        folder = Path(tempfile.mkdtemp(prefix="atom_core_config_"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        shutil.copy(p, folder / "config.json")
        from atom_core.engine.chat_template import CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_FILE

        # what a model folder holds beside config.json and the weights: tokenizer, chat templates, defaults
        for name in ("tokenizer.json", "tokenizer_config.json", CHAT_TEMPLATE_FILE, "generation_config.json"):
            if (p.parent / name).is_file():
                shutil.copy(p.parent / name, folder / name)
        if (p.parent / CHAT_TEMPLATE_DIR).is_dir():
            shutil.copytree(p.parent / CHAT_TEMPLATE_DIR, folder / CHAT_TEMPLATE_DIR)
        return str(folder)
    if p.is_dir():
        return str(p)
    if not p.exists() and HUB_ID.match(path):
        raise UsageError(f"{path!r} is not a local folder, and atom_core loads only local checkpoint folders; "
                         f"download it first (huggingface-cli download {path} --local-dir {path.rsplit('/', 1)[1]})")
    what = "not a folder" if p.exists() else "no such folder"
    raise UsageError(f"{path!r}: {what} (expected a checkpoint folder with config.json, *.safetensors and "
                     f"tokenizer.json)")


def build_engine(args: argparse.Namespace):
    """The ``Engine`` the flags describe (``engine.shutdown()`` stops its worker ranks, if any)."""
    import torch

    from atom_core.engine import Engine

    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # what the ranks and replicas this process starts take
    if args.device is not None:
        try:
            torch.device(args.device)
        except RuntimeError:
            raise UsageError(f"--device {args.device!r}: expected cpu, cuda or cuda:N") from None
    folder = model_folder(checkpoint_path(args), args.load_format)
    parallel = {}
    if args.tensor_parallel_size > 1:
        parallel = dict(tensor_parallel_size=args.tensor_parallel_size,
                        expert_parallel=args.expert_parallel and args.expert_exchange)
    if args.data_parallel_size > 1:
        parallel["data_parallel_size"] = args.data_parallel_size
    if args.dp_attention:
        if args.data_parallel_size == 1 or args.tensor_parallel_size > 1:
            raise UsageError("--dp-attention needs --data-parallel-size > 1 and --tensor-parallel-size 1")
        parallel |= {"dp_attention": True, "expert_parallel": "all_to_all"}
    build = Engine.from_pretrained
    if engine_process(args) and args.data_parallel_size == 1:
        from atom_core.engine import DataParallelEngine

        build = functools.partial(DataParallelEngine, data_parallel_size=1)  # one replica, in its own process
    try:
        return build(
            folder, device=args.device, dtype=args.dtype, load_format=args.load_format, quantization=args.quantization,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_dtype=args.kv_cache_dtype,
            num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
            block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
            enforce_eager=args.enforce_eager, max_logprobs=args.max_logprobs, logprobs_mode=args.logprobs_mode,
            seed=getattr(args, "seed", None), enable_sleep_mode=args.enable_sleep_mode,
            generation_config=args.generation_config, **parallel)
    except ValueError as e:
        raise ValueError(with_flag_names(str(e))) from e
    except FileNotFoundError as e:  # a folder without weights
        raise FileNotFoundError(with_flag_names(str(e))) from e


def checkpoint_path(args: argparse.Namespace) -> str | None:
    """The checkpoint the command line names: PATH or ``--model PATH`` (both: they must name the same folder)."""
    path, flag = getattr(args, "path", None), getattr(args, "model_path", None)
    if path is not None and flag is not None and os.path.realpath(path) != os.path.realpath(flag):
        raise UsageError(f"the checkpoint is given twice, as PATH {path!r} and as --model {flag!r}: give one")
    return path if path is not None else flag



# The library's names for what an engine flag sets, as its errors spell them ("max_model_len=...").
FLAG_OF = {"max_model_len": "--max-model-len", "num_blocks": "--num-kv-blocks", "num_kv_blocks": "--num-kv-blocks",
           "block_size": "--block-size", "max_num_seqs": "--max-num-seqs",
           "max_num_batched_tokens": "--max-num-batched-tokens", "tp_size": "--tensor-parallel-size",
           "tensor_parallel_size": "--tensor-parallel-size", "data_parallel_size": "--data-parallel-size",
           "gpu_memory_utilization": "--gpu-memory-utilization", "kv_cache_dtype": "--kv-cache-dtype",
           "dtype": "--dtype", "device": "--device", "quantization": "--quantization", "load_format": "--load-format",
           "generation_config": "--generation-config"}
_LIBRARY_NAME = re.compile(r"(?<![\w.-])(" + "|".join(FLAG_OF) + r")(?=[=:])")


def with_flag_names(message: str) -> str:
    """An engine error with the flag in place of each library name it gives a value of (``name=`` or
    ``name:``): ``max_model_len=100000 exceeds ...`` -> ``--max-model-len=100000 exceeds ...``."""
    return _LIBRARY_NAME.sub(lambda m: FLAG_OF[m.group(1)], message)


def engine_process(args: argparse.Namespace) -> bool:
    """Whether serve runs the engine in a process of its own: ``--engine-process`` / ``--no-engine-process``,
    else on a GPU yes (the server's event loop and detokenization would share the GIL with the engine's steps:
    0.72x the offline throughput at saturation on an H200, 0.95x in a process of its own; docs/benchmarks.md)
    and on the CPU no (the steps dominate; a second process would only add its start-up). Also no by default for
    a numbered GPU (``cuda:1``: the replica's process takes its GPUs from CUDA_VISIBLE_DEVICES), under torchrun and
    with ``--enable-rl-endpoints`` (its routes call the ``Engine``'s own methods: sleep mode, the weight-update
    group). Other commands: no."""
    chosen = getattr(args, "engine_process", False)
    if chosen is not None:
        return chosen
    if getattr(args, "enable_rl_endpoints", False):
        return False
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return device.type != "cpu" and device.index is None and "RANK" not in os.environ


def chat_template_for(engine, option: str | None) -> str | None:
    """The template to render chats with: ``option`` (a file or the template text), else None (the
    model's own) when the model has one, else FALLBACK_CHAT_TEMPLATE (logged)."""
    if option is not None:
        path = Path(option)
        if path.is_file():
            try:
                return path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise UsageError(f"--chat-template {option!r}: cannot read it as UTF-8 text ({e})") from None
        if not any(ch in option for ch in "{}\n"):  # vLLM's rule: no template syntax, so a path that is not there
            raise UsageError(f"--chat-template {option!r}: no such file (a template given inline holds {{ }})")
        return option
    if engine.tokenizer is not None and engine.tokenizer.chat_templates:
        return None
    logger.warning("the model has no chat template: using a plain 'role: content' one (--chat-template to choose)")
    return FALLBACK_CHAT_TEMPLATE


# What ``atom-core generate`` and ``python -m atom_core.demo`` complete when given no --prompt.
DEFAULT_PROMPTS = ["Return the number of", "This module provides", "If the file does not exist,", "Create a new"]


def generate_and_print(engine, prompts: list[str], params, note: str = "") -> None:
    """``engine.generate(prompts, params)``, then each prompt with its completion and one line of
    throughput (``note`` ends that line's parenthesis)."""
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        print(f"--- {prompt!r}\n{prompt}{out.text}\n")
    generated = sum(len(o.token_ids) for o in outputs)
    count = f"{len(prompts)} prompt" + ("s" if len(prompts) != 1 else "")
    print(f"{generated} tokens in {elapsed:.2f} s: {generated / elapsed:.1f} tokens/s ({count}, "
          f"device {engine.device}{note})")
