"""Structured output: a request's output constrained by a JSON schema, a regex, a choice of strings or
a grammar, through the grammar library xgrammar (the ``structured`` extra; docs/sampling.md says why
xgrammar, with the measured numbers).

The pieces, and who owns them:

* ``StructuredOutputsParams`` (``sampling_params``): what a request asks for, checked alone.
* ``GrammarCompiler`` (one per engine, made at the first request that asks): the tokenizer's
  vocabulary as xgrammar sees it and xgrammar's compiler with its cache (a schema asked for twice
  compiles once). ``compile`` turns a request's ``StructuredOutputsParams`` into a
  ``CompiledStructuredOutput``, or raises ValueError naming the problem — ``Engine.add_request`` calls it
  before queueing, unless the caller compiled it already (``Engine.compile_structured``, which any thread
  may call: ``AsyncEngine`` compiles on a worker thread, so a new schema never stalls the step thread).
* ``GrammarState`` (one per sequence, ``Request.grammar``): a matcher advanced by each of the
  sequence's accepted tokens (``Scheduler.record``); freed (set to None) when the request finishes
  or is aborted. A preemption keeps it: the recomputed request continues from the same tokens, so
  the matcher that consumed them stays right.
* The step's mask: ``Scheduler`` asks :func:`fill_bitmask` for the packed bitmask (int32 [G, W]) of
  the G rows of the step that sample a constrained token, and the runner applies it on the device
  (``ops.apply_token_mask_``) before any other logits processing.

Masks need each row's previous token on the host, so the engine does not launch a step ahead
(async scheduling) while a request with structured output is unfinished: those steps run in order,
with the host between them (docs/sampling.md, "Structured output").

``import atom_core`` never imports xgrammar; a request that asks for structured output without it
installed gets ``StructuredOutputUnavailableError`` (a ValueError) naming the extra.
"""

from __future__ import annotations

import json
import logging
import os
import re

import numpy as np

from atom_core.engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

EXTRA = "structured"
INSTALL_HINT = f"pip install 'atom_core[{EXTRA}]'"
MAX_COMPILE_THREADS = 8
# The compiled grammars xgrammar keeps for reuse, in bytes: least recently used ones go past this (vLLM's
# default). Unbounded, a server whose clients send their own schemas grows for as long as it runs.
GRAMMAR_CACHE_BYTES = 512 * 2**20
MAX_MASK_THREADS = 8  # threads that fill one step's masks (xgrammar's BatchGrammarMatcher)
# ... from this many rows on: below, starting the threads costs more than it saves (4 rows of cheap
# masks: 0.14 ms on threads against 0.013 ms in turn; 64 rows of a JSON schema at a 151,643-token
# vocabulary: 2.1 ms on two threads against 3.2 ms in turn; benchmarks/structured_output.py).
MIN_ROWS_FOR_THREADS = 8
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class StructuredOutputUnavailableError(ValueError):
    """Structured output was asked for, but the grammar library is not installed."""


def import_xgrammar():
    """The xgrammar module, or StructuredOutputUnavailableError naming the extra to install."""
    try:
        import xgrammar
    except ImportError as e:
        raise StructuredOutputUnavailableError(
            f"SamplingParams.structured_outputs: structured output needs the grammar library xgrammar, which "
            f"is not installed ({e}): {INSTALL_HINT}") from None
    return xgrammar


def _library_message(error: Exception) -> str:
    """xgrammar's error text without its log prefix ("[09:05:14] /project/cpp/x.cc:94: ")."""
    return _XGRAMMAR_LOG_PREFIX.sub("", str(error).strip())


# JSON Schema keywords xgrammar accepts without enforcing them (outputs broke them, measured with xgrammar 0.2):
# refused by name rather than generating output that breaks the schema. "oneOf" is enforced as "anyOf" (a
# value matching several branches may come out), "allOf" only with one schema.
UNENFORCED_KEYWORDS = {
    "not": "'not'", "if": "'if' / 'then' / 'else'", "then": "'if' / 'then' / 'else'", "else": "'if' / 'then' / 'else'",
    "contains": "'contains'", "minContains": "'minContains'", "maxContains": "'maxContains'",
    "dependentRequired": "'dependentRequired'",
}
_SUBSCHEMA = ("items", "additionalProperties", "additionalItems", "propertyNames", "unevaluatedProperties",
              "unevaluatedItems", "contains", "not", "if", "then", "else")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def unenforced_keyword(schema, path: str = "#") -> str | None:
    """Where ``schema`` uses a keyword the grammar library would not enforce, and which: "path: why"; None if
    none does."""
    if not isinstance(schema, dict):
        return None
    for key, what in UNENFORCED_KEYWORDS.items():
        if key in schema:
            return f"{path}: {what} is not enforced by the grammar library (xgrammar)"
    if schema.get("uniqueItems") is True:
        return f"{path}: 'uniqueItems' is not enforced by the grammar library (xgrammar)"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"{path}: 'allOf' of several schemas is not enforced by the grammar library (xgrammar); merge them"
    step = schema.get("multipleOf")
    if step is not None and (schema.get("type") != "integer" or not float(step).is_integer()):
        return f"{path}: 'multipleOf' is enforced on integers by a whole step only (xgrammar), got {step!r}"
    children = [(f"{path}/{key}", schema[key]) for key in _SUBSCHEMA if isinstance(schema.get(key), dict)]
    children += [(f"{path}/{key}/{i}", sub) for key in _SUBSCHEMA_LISTS if isinstance(schema.get(key), list)
                 for i, sub in enumerate(schema[key])]
    children += [(f"{path}/{key}/{name}", sub) for key in _SUBSCHEMA_MAPS if isinstance(schema.get(key), dict)
                 for name, sub in schema[key].items()]
    for child_path, child in children:
        found = unenforced_keyword(child, child_path)
        if found is not None:
            return found
    return None


def _check_enforceable(spec: StructuredOutputsParams) -> None:
    if spec.kind == "json":
        found = unenforced_keyword(json.loads(spec.json_schema_text))
        if found is not None:
            raise ValueError(f"SamplingParams.structured_outputs.json: {found}: refused rather than generate output "
                             "that breaks the schema")


def check_grammar(spec: StructuredOutputsParams) -> None:
    """Refuse a constraint that would not compile, without a vocabulary: its schema, regex or grammar is
    only parsed into xgrammar's grammar (``xgr.Grammar.from_*``), not compiled over the tokens, so no
    ``GrammarCompiler`` is built (seconds and memory at a 150k vocabulary) and a schema costs about a
    millisecond instead of tens. The errors are the ones ``GrammarCompiler.compile`` gives (it parses
    first; each refusal of the tests is a parse error). The data-parallel front checks with it: the
    replica compiles, and a constraint refused by its compile alone fails there, as a step error."""
    xgr = import_xgrammar()
    _check_enforceable(spec)
    kind = spec.kind
    whitespace = not spec.disable_any_whitespace
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(spec.json_schema_text, any_whitespace=whitespace)
        elif kind == "json_object":
            xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=whitespace, strict_mode=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec.regex)
        else:
            xgr.Grammar.from_ebnf(choice_grammar(spec.choice) if kind == "choice" else spec.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"SamplingParams.structured_outputs.{kind}: {_library_message(e)}") from None


def choice_grammar(choices) -> str:
    """An EBNF grammar (xgrammar's dialect) whose language is exactly the given strings. Characters are
    written as themselves (``ensure_ascii=False``): the grammar reads an escaped surrogate pair as two
    separate code points, so an ASCII-escaped emoji would not be the emoji."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """xgrammar's view of a tokenizer's vocabulary, and a caching compiler over it.

    ``tokenizer``: the engine's ``Tokenizer``; ``vocab_size``: the model's (the logits' width, which
    may exceed the tokenizer's: the extra ids are never allowed); ``stop_token_ids``: the ids that
    end a completed grammar (the engine's EOS ids).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids):
        xgr = import_xgrammar()
        self.xgr = xgr
        backend = tokenizer.backend
        encoded = [""] * vocab_size
        for token, i in backend.get_vocab(with_added_tokens=True).items():
            if i < vocab_size:
                encoded[i] = token
        # Special tokens and the stop ids carry no text: given their literal text ("<|endoftext|>"), a grammar
        # that may end after those characters would allow EOS there, and accepting it ends the grammar early.
        for i in {i for i, added in backend.get_added_tokens_decoder().items() if added.special} | set(stop_token_ids):
            if 0 <= i < vocab_size:
                encoded[i] = ""
        # xgrammar reads the vocabulary's encoding (byte-level, byte-fallback or raw) and whether a
        # leading space is added from the tokenizer.json, as its own from_huggingface does.
        metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        stop = sorted(int(t) for t in stop_token_ids if 0 <= t < vocab_size)
        self.info = xgr.TokenizerInfo(encoded, vocab_type=metadata["vocab_type"], vocab_size=vocab_size,
                                      stop_token_ids=stop or None, add_prefix_space=metadata["add_prefix_space"])
        self.vocab_size = vocab_size
        threads = max(1, min(MAX_COMPILE_THREADS, os.cpu_count() or 1))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=True,
                                            cache_limit_bytes=GRAMMAR_CACHE_BYTES)
        self.batch_matcher = xgr.BatchGrammarMatcher(max_threads=max(1, min(MAX_MASK_THREADS, os.cpu_count() or 1)))

    def compile(self, spec: StructuredOutputsParams) -> CompiledStructuredOutput:
        """``spec`` compiled over this vocabulary (cached by xgrammar); ValueError naming the field and why.
        Safe from several threads at once (xgrammar's compiler guards its cache; the compile itself runs
        without the GIL)."""
        _check_enforceable(spec)
        kind = spec.kind
        whitespace = not spec.disable_any_whitespace
        try:
            if kind == "json":
                compiled = self.compiler.compile_json_schema(spec.json_schema_text, any_whitespace=whitespace)
            elif kind == "json_object":  # any JSON object (strict_mode=False: any properties)
                compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=whitespace,
                                                             strict_mode=False)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(spec.regex)
            elif kind == "choice":
                compiled = self.compiler.compile_grammar(choice_grammar(spec.choice))
            else:
                compiled = self.compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"SamplingParams.structured_outputs.{kind}: {_library_message(e)}") from None
        return CompiledStructuredOutput(spec, compiled, self)

    def new_state(self, compiled: CompiledStructuredOutput) -> GrammarState:
        return GrammarState(self.xgr.GrammarMatcher(compiled.grammar), self.vocab_size, self.batch_matcher)


class CompiledStructuredOutput:
    """A request's constraint compiled for one engine (``Engine.compile_structured``), to hand to its
    ``add_request(..., grammar=...)``: ``spec`` (the ``StructuredOutputsParams`` it was compiled from),
    ``grammar`` (xgrammar's compiled grammar), ``compiler`` (the ``GrammarCompiler`` that made it: the
    vocabulary it is valid for)."""

    __slots__ = ("compiler", "grammar", "spec")

    def __init__(self, spec: StructuredOutputsParams, grammar, compiler: GrammarCompiler):
        self.spec, self.grammar, self.compiler = spec, grammar, compiler

    def __repr__(self) -> str:
        return f"CompiledStructuredOutput({self.spec.kind})"


class GrammarState:
    """One sequence's place in its grammar: ``accept(token)`` after each sampled token, ``fill(bitmask,
    i)`` for the next token's mask. ``done``: the grammar reached its end (a stop token accepted) or
    refused a token (only when the sampler could not follow the mask: every allowed token was banned
    by another rule, e.g. ``min_tokens`` banning the EOS a finished grammar asks for)."""

    __slots__ = ("__weakref__", "batch_matcher", "matcher", "num_accepted", "refused", "vocab_size")

    def __init__(self, matcher, vocab_size: int, batch_matcher=None):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.batch_matcher = batch_matcher  # the compiler's (shared): fills several masks on threads
        self.num_accepted = 0
        self.refused = False

    def accept(self, token: int) -> bool:
        if self.matcher.accept_token(token):
            self.num_accepted += 1
            return True
        self.refused = True
        return False

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    @property
    def done(self) -> bool:
        return self.refused or self.matcher.is_terminated()


def fill_bitmask(states: list[GrammarState]) -> np.ndarray:
    """int32 [G, W] (W = ceil(V / 32)): the next-token bitmask of each state (``ops.apply_token_mask_``'s
    layout: bit v % 32 of word v // 32 = token v allowed); from MIN_ROWS_FOR_THREADS rows on, on
    xgrammar's threads (``BatchGrammarMatcher``, up to MAX_MASK_THREADS)."""
    import torch

    bitmask = torch.full((len(states), (states[0].vocab_size + 31) // 32), -1, dtype=torch.int32)
    live = [i for i, state in enumerate(states) if not state.done]
    batch_matcher = states[0].batch_matcher
    if len(live) >= MIN_ROWS_FOR_THREADS and batch_matcher is not None:
        batch_matcher.batch_fill_next_token_bitmask([states[i].matcher for i in live], bitmask, live)
    else:
        for i in live:
            states[i].matcher.fill_next_token_bitmask(bitmask, i)
    return bitmask.numpy()


def advance(requests, tokens: list[int]) -> np.ndarray:
    """Feed each request's new token to its grammar (requests without one are skipped); bool [N]: the
    rows whose grammar is now done (they finish)."""
    done = np.zeros(len(requests), dtype=bool)
    for i, (request, token) in enumerate(zip(requests, tokens)):
        state = request.grammar
        if state is None:
            continue
        if not state.accept(token):
            logger.warning("request %d: token %d is outside its grammar (every token the grammar allowed was "
                           "banned by another rule); it stops here", request.request_id, token)
        done[i] = state.done
    return done
