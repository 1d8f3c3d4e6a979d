"""Train the small built-in demo model shipped in ``atom_core/demo_model/``.

The model is a 4-layer ``Qwen3ForCausalLM`` (about 1.05M parameters: hidden 128, 4 query heads
and 2 KV heads of dim 32, tied embeddings) with a 2048-token byte-level BPE tokenizer. Both are
trained here, on CPU, from the prose of Python's standard-library docstrings (PSF-licensed text
that may be redistributed), so that the package can generate readable text on a machine with no
network access.

The sizes are set by the compute: the whole run has to fit in about ten minutes on two CPU cores
that other processes share. At that budget (roughly 500k training tokens) a smaller model that
takes more optimizer steps writes better English than a wider one that takes fewer: 1000 steps
of 4 x 128 tokens reach a held-out loss near 4.4 nats/token and grammatical sentences, while
hidden 192 and a 4096-token vocabulary stalled near word salad in the same time.

Run from the repository root (needs the test extras: ``transformers``, ``tokenizers``)::

    python scripts/train_demo_model.py                  # writes atom_core/demo_model/
    python scripts/train_demo_model.py --out-dir /tmp/demo --steps 200

The run is seeded (Python ``random`` and torch) and uses a fixed thread count, so the same
Python version, torch build and machine give the same weights. The corpus is whatever the
running Python's standard library documents, so another Python version gives a slightly
different corpus.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import random
import time
import warnings
from pathlib import Path

SCRIPT_START = time.perf_counter()

# Must be set before torch starts its OpenMP pool: busy-waiting worker threads stall each
# other when other processes share the cores (measured 5x slower steps with 2 threads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

EOS_TOKEN = "<|endoftext|>"

# Standard-library modules whose docstrings form the corpus, walked in this order. Modules
# that only exist on other platforms or Python versions are skipped when they fail to import.
STDLIB_MODULES = (
    "abc argparse array ast asyncio asyncio.base_events asyncio.events asyncio.futures "
    "asyncio.locks asyncio.queues asyncio.streams asyncio.subprocess asyncio.tasks base64 bdb "
    "binascii bisect builtins bz2 calendar cmath cmd code codecs codeop collections "
    "collections.abc colorsys compileall concurrent.futures configparser contextlib contextvars "
    "copy copyreg csv ctypes dataclasses datetime dbm decimal difflib dis doctest email "
    "email.charset email.header email.message email.parser email.policy email.utils enum errno "
    "filecmp fileinput fnmatch fractions ftplib functools gc getopt getpass gettext glob graphlib "
    "gzip hashlib heapq hmac html html.parser http http.client http.cookiejar http.cookies "
    "http.server imaplib importlib importlib.abc importlib.machinery importlib.metadata "
    "importlib.resources importlib.util inspect io ipaddress itertools json json.decoder "
    "json.encoder keyword linecache locale logging logging.config logging.handlers lzma mailbox "
    "marshal math mimetypes mmap modulefinder multiprocessing multiprocessing.connection "
    "multiprocessing.managers multiprocessing.pool multiprocessing.queues "
    "multiprocessing.shared_memory netrc numbers opcode operator optparse os os.path pathlib pdb "
    "pickle pickletools pkgutil platform plistlib poplib posixpath pprint profile pstats pty "
    "py_compile pyclbr pydoc queue quopri random re reprlib rlcompleter runpy sched secrets "
    "select selectors shelve shlex shutil signal site smtplib socket socketserver sqlite3 ssl "
    "stat statistics string stringprep struct subprocess symtable sys sysconfig tabnanny tarfile "
    "tempfile textwrap threading time timeit token tokenize tomllib trace traceback tracemalloc "
    "types typing unicodedata unittest unittest.case unittest.mock unittest.result "
    "unittest.runner unittest.suite urllib.error urllib.parse urllib.request urllib.robotparser "
    "uuid warnings wave weakref webbrowser wsgiref.handlers wsgiref.simple_server wsgiref.util "
    "wsgiref.validate xml.dom.minidom xml.etree.ElementTree xml.sax xml.sax.handler "
    "xml.sax.saxutils xmlrpc.client xmlrpc.server zipapp zipfile zipimport zlib zoneinfo"
).split()

# Docstrings shorter than this are mostly signatures ("f(x) -> int"), not prose.
MIN_DOCSTRING_CHARS = 40

SAMPLE_PROMPTS = (
    "Return the number of",
    "This module provides",
    "Create a new",
    "If the file",
)


def _raw_docstrings(module) -> list:
    """Docstrings of ``module``, its public classes and functions, and their methods.

    Only objects defined in the module itself are visited (``obj.__module__`` equals the
    module's name, or is unset for methods of C types), names are visited in sorted order, and
    names starting with ``_`` are skipped.
    """
    found = [module.__doc__]
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            found.append(obj.__doc__)
            for member_name, member in sorted(vars(obj).items()):
                if member_name.startswith("_"):
                    continue
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if isinstance(member, property):
                    member = member.fget
                # Other packages may attach methods to stdlib classes (transformers adds
                # logging.Logger.warning_once); keep only methods defined in this module.
                if inspect.isroutine(member) and getattr(member, "__module__", None) in (None, module.__name__):
                    found.append(member.__doc__)
        elif inspect.isroutine(obj):
            found.append(obj.__doc__)
    return found


def prose_only(docstring: str) -> str:
    """The prose paragraphs of a cleaned docstring, each joined onto one line.

    Paragraphs (blocks between blank lines) that are indented or hold a doctest (``>>>``) are
    code, signatures or option tables and are dropped; the lines of the others are joined with
    single spaces, so the text flows the way sentences do rather than wrapping at 72 columns.
    """
    kept = []
    for paragraph in docstring.split("\n\n"):
        lines = [line for line in paragraph.splitlines() if line.strip()]
        if not lines or any(line.startswith((" ", "\t")) for line in lines) or ">>>" in paragraph:
            continue
        kept.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(kept)


def collect_stdlib_docstrings(module_names=STDLIB_MODULES) -> list[str]:
    """Prose of the docstrings of ``module_names``, de-duplicated, in walk order (first copy kept)."""
    seen: set[str] = set()
    docstrings: list[str] = []
    for module_name in module_names:
        with warnings.catch_warnings():
            # Deprecated aliases (typing.io, ...) warn when imported or read.
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            raw = _raw_docstrings(module)
        for doc in raw:
            if not isinstance(doc, str):
                continue
            text = prose_only(inspect.cleandoc(doc))
            if len(text) < MIN_DOCSTRING_CHARS or text in seen:
                continue
            seen.add(text)
            docstrings.append(text)
    return docstrings


def train_tokenizer(docstrings: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style) trained on ``docstrings``; ``EOS_TOKEN`` gets id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(docstrings, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer, path: Path, eos_id: int) -> None:
    """``tokenizer`` written to ``path`` with a post-processor that puts EOS (the BOS) before every encoded
    text, as in training: transformers (5 reads only tokenizer.json for this), vLLM and atom_core then all
    start a prompt with it."""
    from tokenizers import Tokenizer, processors

    saved = Tokenizer.from_str(tokenizer.to_str())
    saved.post_processor = processors.TemplateProcessing(
        single=f"{EOS_TOKEN} $A", pair=f"{EOS_TOKEN} $A {EOS_TOKEN}:1 $B:1", special_tokens=[(EOS_TOKEN, eos_id)])
    path.write_text(saved.to_str(pretty=True))


def token_stream(tokenizer, docstrings: list[str], eos_id: int) -> torch.Tensor:
    """int64 [N]: every docstring preceded by EOS (which doubles as BOS), then one final EOS."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(docstrings):
        ids.append(eos_id)
        ids.extend(encoding.ids)
    ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int64)


def random_windows(stream: torch.Tensor, batch_size: int, seq_len: int, generator) -> torch.Tensor:
    """int64 [batch_size, seq_len + 1]: windows of ``stream`` at random starts."""
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)
    return stream[starts[:, None] + offsets[None, :]]


def next_token_loss(model, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting ``windows[:, 1:]`` from ``windows[:, :-1]``."""
    logits = model(input_ids=windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), windows[:, 1:].reshape(-1)
    )


@torch.no_grad()
def validation_loss(model, stream: torch.Tensor, seq_len: int) -> float:
    """Mean loss over consecutive, non-overlapping windows of the held-out stream."""
    model.eval()
    num_windows = (stream.numel() - 1) // seq_len
    starts = torch.arange(num_windows) * seq_len
    windows = stream[starts[:, None] + torch.arange(seq_len + 1)[None, :]]
    losses = [next_token_loss(model, chunk).item() for chunk in windows.split(32)]
    model.train()
    return sum(losses) / len(losses)


def learning_rate(step: int, total_steps: int, peak: float, warmup_steps: int) -> float:
    """Linear warm-up to ``peak``, then cosine decay to ``peak / 10``."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def print_samples(model, tokenizer, eos_id: int, max_new_tokens: int, seed: int) -> None:
    """Greedy and sampled (temperature 0.8, top-p 0.9) continuations of ``SAMPLE_PROMPTS``."""
    model.eval()
    for prompt_index, prompt in enumerate(SAMPLE_PROMPTS):
        input_ids = torch.tensor([[eos_id] + tokenizer.encode(prompt).ids])
        for label, kwargs in (
            ("greedy", dict(do_sample=False)),
            ("sampled", dict(do_sample=True, temperature=0.8, top_p=0.9, top_k=0)),
        ):
            torch.manual_seed(seed + prompt_index)
            output = model.generate(
                input_ids, max_new_tokens=max_new_tokens, eos_token_id=eos_id, pad_token_id=eos_id, **kwargs
            )
            text = tokenizer.decode(output[0, 1:].tolist())
            print(f"[{label}] {text!r}")


def write_readme(out_dir: Path, summary: dict) -> None:
    """Provenance, data license and rebuild instructions next to the weights."""
    text = f"""# atom_core demo model

A tiny `Qwen3ForCausalLM` that ships with atom_core so that the quickstart produces readable
text with no download. It writes text in the style of Python docstrings; it knows nothing else
and is not useful for any real task.

| | |
|---|---|
| architecture | Qwen3ForCausalLM, {summary["num_hidden_layers"]} layers, hidden {summary["hidden_size"]}, {summary["num_attention_heads"]} query heads / {summary["num_key_value_heads"]} KV heads of dim {summary["head_dim"]}, tied embeddings |
| parameters | {summary["num_parameters"]:,} (stored as {summary["dtype"]}) |
| tokenizer | byte-level BPE, {summary["vocab_size"]} tokens, `{EOS_TOKEN}` (id {summary["eos_id"]}) is both BOS and EOS |
| context | trained on {summary["seq_len"]}-token windows (text degrades past that); `max_position_embeddings` {summary["max_position_embeddings"]} |
| training | {summary["steps"]} AdamW steps of {summary["batch_size"]} x {summary["seq_len"]} tokens on CPU, seed {summary["seed"]} |
| final loss | train {summary["train_loss"]:.3f}, held-out {summary["val_loss"]:.3f} (nats per token) |
| built with | Python {summary["python"]}, torch {summary["torch"]}, transformers {summary["transformers"]}, tokenizers {summary["tokenizers"]} |

## Data and license

The training text is the docstrings of Python {summary["python"]}'s standard library: the modules
listed in `scripts/train_demo_model.py`, their public classes, functions and methods. Each
docstring is cleaned with `inspect.cleandoc`; its code paragraphs (indented or holding `>>>`)
are dropped and the lines of each prose paragraph joined; duplicates and texts under
{MIN_DOCSTRING_CHARS} characters are dropped ({summary["num_docstrings"]:,} docstrings,
{summary["num_chars"]:,} characters). The tokenizer is trained on all of them; every
{summary["val_every"]}th docstring is held out of model training for the validation loss.

The docstrings are part of Python: Copyright (c) 2001 Python Software Foundation; All Rights
Reserved. Python is distributed under the PSF License Agreement
(https://docs.python.org/3/license.html), which allows derived works to be prepared and
distributed provided the PSF copyright notice and license are retained with them; this notice
is that. The weights and the tokenizer in this folder are derived from that text; the rest of
atom_core is Apache-2.0.

## Files

- `config.json`, `generation_config.json`: written by transformers' `save_pretrained`;
  `config.json` also carries the older key names `torch_dtype` and `rope_theta` (same values
  as `dtype` and `rope_parameters`) so that transformers 4.x reads it too.
- `model.safetensors`: the weights (the output projection is tied to `model.embed_tokens.weight`).
- `tokenizer.json`: a `tokenizers` tokenizer with a ByteLevel decoder and a post-processor that
  puts `{EOS_TOKEN}` before every encoded text (the BOS, as in training);
  `tokenizer_config.json` lets transformers' `AutoTokenizer` load it too.

## Rebuild

From the repository root, with the test extras installed:

    python scripts/train_demo_model.py

The script collects the corpus, trains the tokenizer and the model, prints sample
continuations and rewrites this folder. The recorded run took {summary["wall_minutes"]:.1f} minutes on
2 CPU cores; expect up to about ten when other processes share them. It is seeded and uses a
fixed thread count; the same Python version and torch build reproduce the same weights.
"""
    (out_dir / "README.md").write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parents[1] / "atom_core" / "demo_model")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--intermediate-size", type=int, default=384)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import platform

    import tokenizers
    import transformers
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    wall_start = SCRIPT_START
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)

    docstrings = collect_stdlib_docstrings()
    print(f"collected corpus in {time.perf_counter() - wall_start:.1f}s")
    val_every = 50
    train_docs = [d for i, d in enumerate(docstrings) if i % val_every != val_every - 1]
    val_docs = [d for i, d in enumerate(docstrings) if i % val_every == val_every - 1]
    print(f"corpus: {len(docstrings)} docstrings, {sum(map(len, docstrings)):,} chars "
          f"({len(val_docs)} held out)")

    tokenizer = train_tokenizer(docstrings, args.vocab_size)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    print(f"trained tokenizer at {time.perf_counter() - wall_start:.1f}s")
    train_stream = token_stream(tokenizer, train_docs, eos_id)
    val_stream = token_stream(tokenizer, val_docs, eos_id)
    print(f"tokens: train {train_stream.numel():,}, held-out {val_stream.numel():,}, "
          f"vocab {tokenizer.get_vocab_size()}")

    config = Qwen3Config(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=4,
        num_attention_heads=args.num_heads,
        num_key_value_heads=2,
        head_dim=args.head_dim,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    model = Qwen3ForCausalLM(config)
    model.train()
    num_parameters = sum(p.numel() for p in model.parameters())
    print(f"model: {num_parameters:,} parameters")

    # No weight decay on norms (1-D tensors): shrinking their gains only hurts.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )
    batch_generator = torch.Generator().manual_seed(args.seed)
    warmup_steps = max(1, args.steps // 20)
    running_loss = None
    train_start = time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, warmup_steps)
        windows = random_windows(train_stream, args.batch_size, args.seq_len, batch_generator)
        loss = next_token_loss(model, windows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running_loss = loss.item() if running_loss is None else 0.95 * running_loss + 0.05 * loss.item()
        if step % 100 == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - train_start
            print(f"step {step:5d}  loss {loss.item():.3f}  smoothed {running_loss:.3f}  "
                  f"lr {optimizer.param_groups[0]['lr']:.2e}  {elapsed:6.1f}s")

    val_loss_fp32 = validation_loss(model, val_stream, args.seq_len)
    model = model.to(torch.bfloat16)
    val_loss = validation_loss(model, val_stream, args.seq_len)
    print(f"held-out loss: {val_loss_fp32:.3f} (float32), {val_loss:.3f} (bfloat16)")

    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        do_sample=True, temperature=0.8, top_p=0.9, top_k=0,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    # transformers 4.x reads these older key names; 5.x reads `dtype` / `rope_parameters`.
    config_path = out_dir / "config.json"
    config_json = json.loads(config_path.read_text())
    config_json.setdefault("torch_dtype", "bfloat16")
    config_json.setdefault("rope_theta", config_json.get("rope_parameters", {}).get("rope_theta", 10000.0))
    config_path.write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    save_tokenizer(tokenizer, out_dir / "tokenizer.json", eos_id)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "model_max_length": config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")

    print_samples(model, tokenizer, eos_id, max_new_tokens=40, seed=args.seed)
    wall_seconds = time.perf_counter() - wall_start
    write_readme(out_dir, {
        **{k: getattr(config, k) for k in (
            "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "max_position_embeddings")},
        "num_parameters": num_parameters, "dtype": "bfloat16", "eos_id": eos_id,
        "seq_len": args.seq_len, "batch_size": args.batch_size, "steps": args.steps, "seed": args.seed,
        "train_loss": running_loss, "val_loss": val_loss, "val_every": val_every,
        "num_docstrings": len(docstrings), "num_chars": sum(map(len, docstrings)),
        "python": platform.python_version(), "torch": torch.__version__.split("+")[0],
        "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
        "wall_minutes": wall_seconds / 60,
    })
    for path in sorted(out_dir.iterdir()):
        print(f"{path.name:28s} {path.stat().st_size:>10,} bytes")
    print(f"total wall time {wall_seconds:.0f}s")


if __name__ == "__main__":
    main()
