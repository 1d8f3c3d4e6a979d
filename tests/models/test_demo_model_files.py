"""The demo model shipped in ``atom_core/demo_model/``: files, config, weights and tokenizer agree.

Expected tensor names and shapes are derived here from the config fields by the Qwen3 layout
(q/k/v/o projections, per-head q/k RMSNorm, gated MLP, tied output projection), not read back
from the weights file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from tokenizers import Tokenizer

import atom_core

DEMO_DIR = Path(atom_core.__file__).resolve().parent / "demo_model"
EOS_TOKEN = "<|endoftext|>"
MAX_TOTAL_BYTES = 6 * 1024 * 1024

ROUND_TRIP_TEXTS = [
    "Return the number of items in the list.",
    "  leading spaces,\ttabs\nand\n\nblank lines  ",
    "def f(x: int) -> dict[str, int]:\n    return {'x': x ** 2}  # squared",
    "naïve café, Grüße, 東京, emoji 🙂, math ∑ ≤ ∞",
    "",
]


def _config() -> dict:
    return json.loads((DEMO_DIR / "config.json").read_text())


def _tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))


def _expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a Qwen3 checkpoint with tied embeddings (no ``lm_head.weight``)."""
    hidden, inter, head_dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_out = cfg["num_attention_heads"] * head_dim
    kv_out = cfg["num_key_value_heads"] * head_dim
    shapes = {
        "model.embed_tokens.weight": (cfg["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_out, hidden),
            p + "self_attn.k_proj.weight": (kv_out, hidden),
            p + "self_attn.v_proj.weight": (kv_out, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_out),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })
    return shapes


def test_shipped_files_exist_and_fit_the_size_budget():
    for name in ("config.json", "generation_config.json", "model.safetensors",
                 "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (DEMO_DIR / name).is_file(), f"missing {DEMO_DIR / name}"
    total = sum(p.stat().st_size for p in DEMO_DIR.iterdir() if p.is_file())
    assert total <= MAX_TOTAL_BYTES, f"demo model is {total:,} bytes, budget {MAX_TOTAL_BYTES:,}"


def test_config_is_a_tied_gqa_qwen3_config():
    cfg = _config()
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["tie_word_embeddings"] is True
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # grouped-query attention
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    assert cfg["max_position_embeddings"] >= 128
    for key in ("bos_token_id", "eos_token_id"):
        assert isinstance(cfg[key], int) and 0 <= cfg[key] < cfg["vocab_size"], key


def test_generation_config_uses_the_same_eos():
    cfg = _config()
    gen = json.loads((DEMO_DIR / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]
    assert gen["bos_token_id"] == cfg["bos_token_id"]


def test_weight_names_shapes_and_dtype_follow_the_config():
    cfg = _config()
    expected = _expected_shapes(cfg)
    with safe_open(str(DEMO_DIR / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names == set(expected), (
            f"unexpected {sorted(names - set(expected))}, missing {sorted(set(expected) - names)}")
        for name in sorted(names):
            tensor = f.get_tensor(name)
            assert tuple(tensor.shape) == expected[name], name
            assert tensor.dtype == torch.bfloat16, name
            assert torch.isfinite(tensor.float()).all(), name


def test_tokenizer_vocab_and_special_tokens_match_the_config():
    cfg = _config()
    tok = _tokenizer()
    assert tok.get_vocab_size() == cfg["vocab_size"]
    eos_id = tok.token_to_id(EOS_TOKEN)
    assert eos_id == cfg["eos_token_id"] == cfg["bos_token_id"]
    tok_cfg = json.loads((DEMO_DIR / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == tok_cfg["bos_token"] == EOS_TOKEN
    # The special token is one id, not spelled out in bytes.
    assert tok.encode(f"a{EOS_TOKEN}b", add_special_tokens=False).ids.count(eos_id) == 1


def test_prompts_start_with_the_bos_in_atom_core_and_transformers():
    """tokenizer.json's post-processor puts <|endoftext|> first, as in training: the only place transformers 5
    (and so vLLM) and atom_core read that from."""
    from transformers import AutoTokenizer

    from atom_core.engine.tokenizer import Tokenizer as EngineTokenizer

    text = ROUND_TRIP_TEXTS[0]
    plain = _tokenizer().encode(text, add_special_tokens=False).ids
    want = [_config()["bos_token_id"]] + plain
    assert EngineTokenizer(DEMO_DIR).encode(text) == AutoTokenizer.from_pretrained(DEMO_DIR).encode(text) == want


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_text(text):
    tok = _tokenizer()
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text


@settings(max_examples=40, deadline=None)
@given(st.text(max_size=60))
def test_tokenizer_round_trips_any_text(text):
    tok = _tokenizer()
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text


def test_tokenizer_packs_english_into_whole_word_tokens():
    # A trained BPE of this size holds the commonest docstring words as single tokens
    # (" the" with its leading space); an untrained byte-level tokenizer would need one token
    # per byte, i.e. len(text) tokens.
    tok = _tokenizer()
    text = "Return the number of items in the list."
    assert len(tok.encode(text).ids) <= len(text) // 3
    assert tok.token_to_id("Ġthe") is not None


# Held-out text: sentences of standard-library docstrings that scripts/train_demo_model.py did not
# train on (neither the model nor the tokenizer): its corpus is the modules in STDLIB_MODULES, and
# these come from modules outside that list (submodules it skipped, modules deprecated since).
# Chosen by a rule, not by how well the model does on them: through the script's own
# _raw_docstrings and prose_only (Python 3.11), split into sentences, the first two of each module
# that are 50-160 characters long, end with a period, hold no backtick or ">>>", and occur nowhere
# in the training corpus. 66 sentences, ~1600 tokens.
HELD_OUT = [
    # asyncio.runners
    'A context manager that controls event loop life cycle.',
    'The context manager always creates a new event loop, allows to run async functions inside it, and '
     'properly finalizes the loop at the context manager exit.',
    # asyncio.transports
    "After all buffered data is flushed, the protocol's connection_lost() method will (eventually) be "
     'called with None as its argument.',
    'Return True if the transport is closing or closed.',
    # asyncio.protocols
    'Usually user implements protocols that derived from BaseProtocol like Protocol or ProcessProtocol.',
    'The argument is an exception object or None (the latter meaning a regular EOF is received or the '
     'connection was aborted or closed).',
    # asyncio.timeouts
    'Asynchronous context manager for cancelling overdue coroutines.',
    'Useful in cases when you want to apply timeout logic around block of code or in cases when '
     'asyncio.wait_for is not suitable.',
    # asyncio.taskgroups
    'Asynchronous context manager for managing groups of tasks.',
    'Example use: All tasks are awaited when the context manager exits.',
    # concurrent.futures.thread
    'Raised when a worker thread in a ThreadPoolExecutor failed initializing.',
    'Clean-up the resources associated with the Executor.',
    # concurrent.futures.process
    'Raised when a process in a ProcessPoolExecutor terminated abruptly while a future was in the running'
     ' state.',
    'Clean-up the resources associated with the Executor.',
    # email.generator
    'Classes to generate plain text from a message object tree.',
    'Generates a bytes version of a Message object tree.',
    # email.feedparser
    'The feed parser implements an interface for incrementally parsing an email message, line by line.',
    'This has advantages for certain applications, such as those reading email messages off a socket.',
    # email.headerregistry
    'Representing and manipulating email headers via custom objects.',
    'This module provides an implementation of the HeaderRegistry API.',
    # multiprocessing.process
    'This method releases resources held by the Process object.',
    'It is an error to call this method if the child process is still running.',
    # multiprocessing.context
    'Check whether this is a fake forked process in a frozen executable.',
    'If so then run code specified by commandline and exit.',
    # multiprocessing.reduction
    'Abstract base class for use in implementing a Reduction class suitable for use in replacing the '
     'standard reduction mechanism used in multiprocessing.',
    'Replacement for pickle.dump() using ForkingPickler.',
    # urllib.response
    'The base class, addbase, defines a minimal file-like interface, including read() and readline().',
    'The typical response object is an addinfourl instance, which defines an info() method that returns '
     'headers and a geturl() method that returns the url.',
    # asyncore
    'Basic infrastructure for asynchronous socket service clients and servers.',
    'There are only two ways to have a program on a single processor do "more than one thing at a time".',
    # asynchat
    'A class supporting chat-style (command/response) protocols.',
    "At the start of the connection, you'll have self.terminator set to '\\r\\n', in order to process the "
     'single-line greeting.',
    # smtpd
    'An RFC 5321 smtp proxy with optional RFC 1870 and RFC 6531 extensions.',
    # cgi
    'Support module for CGI (Common Gateway Interface) scripts.',
    'This module defines a number of utilities for use by CGI scripts written in Python.',
    # telnetlib
    'Based on RFC 854: TELNET Protocol Specification, by J.',
    "Reynolds Example: Note that read_all() won't read until eof -- it just reads some data -- but it "
     'guarantees to read at least one byte unless EOF is hit.',
    # nntplib
    'For descriptions of all methods, read the comments in the code below.',
    'Note that all arguments and return values representing article numbers are strings, not numbers, '
     'since they are rarely used for calculations.',
    # aifc
    'Unless explicitly stated otherwise, the description below is true both for AIFF-C files and AIFF '
     'files.',
    'An AIFF file has the string "AIFF" instead of "AIFC".',
    # chunk
    'The size field (a 32-bit value, encoded using big-endian byte order) gives the size of the whole '
     'chunk, including the 8-byte header.',
    'Usually an IFF-type file consists of one or more chunks.',
    # sunau
    'An audio file consists of a header followed by the data.',
    "The magic word consists of the 4 characters '.snd'.",
    # imghdr
    'Recognize image file formats based on their first few bytes.',
    # sndhdr
    'Function whathdr() recognizes various types of sound file headers.',
    'It understands almost all headers that SOX can decode.',
    # pipes
    'The problem: ------------ Suppose you have some data that you want to convert to another format, '
     'such as from GIF image format to PPM image format.',
    'Maybe the conversion involves several steps (e.g. piping it through compress or uuencode).',
    # xdrlib
    'Implements (a subset of) Sun XDR -- eXternal Data Representation.',
    'Unpacks various data representations from the given buffer.',
    # mailcap
    'Return a tuple containing the command line, and the mailcap entry used; (None, None) if no match is '
     'found.',
    "This may invoke the 'test' command of several matching entries before deciding which entry to use.",
    # importlib.resources.abc
    'Abstract base class for loaders to provide resource reading support.',
    'Return an opened, file-like object for binary reading.',
    # wsgiref.headers
    'These will be sorted in the order they appeared in the original header list or were added to this '
     'instance, and may contain duplicates.',
    'If no fields exist with the given name, returns an empty list.',
    # turtle
    'Turtle graphics is a popular way for introducing programming to kids.',
    'It was part of the original Logo programming language developed by Wally Feurzig and Seymour Papert '
     'in 1966.',
    # tkinter
    'Tkinter provides classes which allow the display, positioning and control of widgets.',
    'Properties of the widgets are specified with keyword arguments.',
    # idlelib.pyshell
    'Initiate the remote stack viewer from a separate thread.',
    'This method is called from the subprocess, and by returning from this method we allow the subprocess'
     ' to unblock.',
    # lib2to3.refactor
    'Used as a main program, this can refactor any number of files and/or recursively descend down '
     'directories.',
    'Imported as a module, this provides infrastructure to write your own refactoring tool.',
]


def test_held_out_loss_is_below_the_best_unigram_model_of_the_held_out_text():
    """The demo model's mean loss per token on HELD_OUT (each sentence after the BOS token, as in
    training) is below the entropy of HELD_OUT's own token frequencies: the loss of the best model
    that ignores context, given those frequencies in advance (an optimistic baseline: it is fitted
    to the very text it scores). Beating it means the model uses the context; the uniform guess,
    ln(vocab_size) = ln(2048) = 7.62 nats, is far higher still. Measured: loss 4.95, unigram 5.91.
    """
    transformers = pytest.importorskip("transformers")
    model = transformers.Qwen3ForCausalLM.from_pretrained(str(DEMO_DIR), dtype=torch.float32)
    model.eval()
    cfg = _config()
    tok = _tokenizer()
    total_nll, targets = 0.0, []
    for sentence in HELD_OUT:
        ids = torch.tensor([[cfg["bos_token_id"]] + tok.encode(sentence).ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1]
        total_nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        targets += ids[0, 1:].tolist()
    loss = total_nll / len(targets)
    counts = torch.bincount(torch.tensor(targets), minlength=cfg["vocab_size"]).double()
    freqs = counts[counts > 0] / len(targets)
    unigram_entropy = -(freqs * freqs.log()).sum().item()
    assert loss < unigram_entropy, f"held-out loss {loss:.3f} nats/token, unigram baseline {unigram_entropy:.3f}"
