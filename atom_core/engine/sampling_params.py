"""Per-request sampling settings, validated at construction: a value that passes here never fails a step.

The names and meanings are vLLM's (``vllm.SamplingParams``); docs/sampling.md gives each field's
definition and where it is applied. What depends on the model (token ids inside the vocabulary,
``logprobs`` under the engine's ``max_logprobs``, ``bad_words`` strings that need a tokenizer) is
checked by ``Engine.add_request``.
"""

from __future__ import annotations

import json as _json
import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from atom_core.ops.reference.sampling import GREEDY_BELOW_TEMPERATURE

FLOAT32_MAX = float(np.finfo(np.float32).max)
INT32_MAX = 2**31 - 1
SEED_LIMIT = 2**64  # seeds are 64-bit: 0 <= seed < 2**64 (torch.Generator's range)
PENALTY_LIMIT = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI's and vLLM's range)


def _is_int(value) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _is_token_list(value) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(_is_int(t) and t >= 0 for t in value)


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's ``StructuredOutputsParams``; exactly one of):

    ``json``: a JSON schema (a dict, or its JSON text); ``regex``: a regular expression the whole
    output matches; ``choice``: a list of strings, the output is one of them; ``grammar``: an EBNF
    grammar in xgrammar's dialect (GBNF-like: ``root ::= ...``); ``json_object``: True, any JSON
    object. ``disable_any_whitespace`` (default True here, False in vLLM): JSON output uses the
    separators ``", "`` and ``": "`` and no other whitespace between tokens, instead of allowing
    any run of whitespace (which a weak model can fill until ``max_tokens``).

    Checked here: the types, one kind set, the JSON text parses. Whether the schema, regex or
    grammar compiles is checked by ``Engine.add_request`` (it needs the tokenizer and the grammar
    library; see ``engine.structured_output``).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    json_schema_text: str | None = field(init=False, repr=False, default=None)

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"SamplingParams.structured_outputs.{name}={getattr(self, name)!r}: {why}")

        if self.json is False:  # (a valid JSON Schema, but no output could follow it)
            bad("json", "the schema false matches no value: nothing could be generated")
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"SamplingParams.structured_outputs: exactly one of {', '.join(STRUCTURED_KINDS)} "
                             f"must be set, got {given or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as e:
                    bad("json", f"not valid JSON ({e})")
            if not isinstance(schema, (dict, bool)):
                bad("json", "must be a JSON schema: a dict (or its JSON text)")
            try:
                text = _json.dumps(schema)
            except (TypeError, ValueError) as e:
                bad("json", f"not JSON-serializable ({e})")
            object.__setattr__(self, "json_schema_text", text)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                bad(name, "must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                bad("choice", "must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object is not None and self.json_object is not True:
            bad("json_object", "must be True (or None)")
        if not isinstance(self.disable_any_whitespace, (bool, np.bool_)):
            bad("disable_any_whitespace", "must be a bool")

    @property
    def kind(self) -> str:
        """Which of json, regex, choice, grammar, json_object is set."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


@dataclass(frozen=True)
class SamplingParams:
    """How to pick a request's tokens, how many sequences to make, what to return and when to stop.

    Sampling: temperature 0 is greedy; it must be finite and at most float32's largest value.
    top_k -1 (or 0) keeps the whole vocabulary; top_p 1.0 and min_p 0.0 turn those filters off.
    ``seed`` (0 <= seed < 2**64) makes the request's draws reproducible whatever its batch mates;
    -1 is None (vLLM's).

    ``n``: sequences made for the prompt (each its own draws; with a seed, sequence i uses
    ``seed + i``); 1 when sampling greedily. The prompt is computed once: the other sequences start after the first one's
    prompt, and take its blocks from the prefix cache.

    Logits processing, applied on the device in this order before temperature and the filters
    (vLLM's order): ``allowed_token_ids`` (every other token gets -inf), ``bad_words`` (a
    word's last token gets -inf when the output so far ends with the word's other tokens; a
    string is tokenized with and without a leading space, as vLLM), ``min_tokens`` (EOS and the
    stop token ids get -inf until the output has that many tokens), ``logit_bias`` (token id ->
    value added to its logit), then the penalties: ``repetition_penalty`` (> 0, 1 = off; every
    token of the prompt or the output has a positive logit divided by it and a negative one
    multiplied, HF's and vLLM's rule), ``frequency_penalty`` and ``presence_penalty`` (in
    [-2, 2]; subtract ``frequency_penalty * count + presence_penalty * (count > 0)`` with count =
    the token's occurrences in the output).

    What comes back: ``logprobs`` (None, or N >= 0): each output token's log-probability under
    the model, plus the N most likely tokens with theirs (``RequestOutput.top_logprobs``; N = -1:
    every token of the vocabulary, vLLM's); ``prompt_logprobs`` (None, -1 or N >= 0): the same for each
    prompt token after the first
    (such a request computes its whole prompt: no prefix-cache hit). Log-probabilities are
    ``log_softmax`` of the raw logits, before any processing (vLLM's default; the engine's
    ``logprobs_mode`` can choose the raw logits or the processed scores instead).

    Stopping: ``max_tokens`` (default 16): the most output tokens; None: as many as ``max_model_len``
    leaves after the prompt (vLLM's; ``Engine.add_request`` fills it in). ``stop``: strings that end the output (not in the text unless
    ``include_stop_str_in_output``); ``stop_token_ids``: tokens that end it (the token is in
    ``token_ids``; its text is not unless ``include_stop_str_in_output``, as in vLLM); neither is
    checked before ``min_tokens`` output tokens. ``skip_special_tokens`` (default True) leaves
    special tokens out of the text. ``detokenize=False`` (vLLM's): token ids only, the text stays "" and no
    decoding is paid for (stop strings need the text: refused with it). ``spaces_between_special_tokens``
    (vLLM's) is taken and changes nothing: only slow tokenizers insert such spaces, as in vLLM, and atom_core's
    are fast (tokenizer.json). Ints may be Python or numpy ints; bools are refused everywhere.

    Structured output: ``structured_outputs`` (a ``StructuredOutputsParams``, or a dict of its fields;
    ``guided_decoding``, vLLM's older name, is read into it): the output matches a JSON schema, a regex, one
    of a list of strings or a grammar; a sequence whose grammar is complete finishes with "stop". Needs the
    ``structured`` extra (xgrammar).

    ``truncate_prompt_tokens`` (vLLM's): keep only the prompt's last k tokens (-1: the last
    ``max_model_len``), cut before the length checks.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int | None = 16
    ignore_eos: bool = False
    stop: list[str] | tuple[str, ...] | str | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    seed: int | None = None
    logprobs: int | None = None
    # (the fields above keep their positions; the ones below came later)
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str | list[int]] | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | dict | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's older name of structured_outputs: read into it, then None (so dataclasses.replace keeps working)
    guided_decoding: StructuredOutputsParams | dict | None = field(default=None, repr=False, compare=False)
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        def as_type(name, value):
            object.__setattr__(self, name, value)

        if not _is_int(self.n) or self.n < 1:
            bad("n", "must be an int >= 1")
        as_type("n", int(self.n))
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or not 0 <= t <= FLOAT32_MAX:
            bad("temperature", f"must be a finite number in [0, {FLOAT32_MAX:.4g}] (0 = greedy)")
        as_type("temperature", float(t))
        if self.n > 1 and t < GREEDY_BELOW_TEMPERATURE:  # vLLM's and transformers' rule
            bad("n", f"must be 1 when sampling greedily (temperature {t:g} < {GREEDY_BELOW_TEMPERATURE:g}): the n "
                     f"sequences would be the same")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            bad("top_k", "must be -1 (off) or an int >= 1")
        as_type("top_k", int(self.top_k))
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0 or np.float32(self.top_p) == 0:
            bad("top_p", "must be a number in (0, 1], at least float32's smallest (1.4e-45)")
        as_type("top_p", float(self.top_p))
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be a number in [0, 1]")
        as_type("min_p", float(self.min_p))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                bad(name, f"must be a number in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}] (0 = off)")
            as_type(name, float(value))
        r = self.repetition_penalty
        if not _is_real(r) or not math.isfinite(r) or not 0 < r <= FLOAT32_MAX:
            bad("repetition_penalty", "must be a finite number > 0 (1 = off)")
        as_type("repetition_penalty", float(r))
        self._check_logit_bias(bad, as_type)
        if self.allowed_token_ids is not None:
            if not _is_token_list(self.allowed_token_ids):
                bad("allowed_token_ids", "must be None or a non-empty list of token ids (ints >= 0)")
            as_type("allowed_token_ids", [int(t) for t in self.allowed_token_ids])
        self._check_bad_words(bad, as_type)
        if self.max_tokens is not None:
            if not _is_int(self.max_tokens) or self.max_tokens < 1:
                bad("max_tokens", "must be None (the rest of the context) or an int >= 1")
            as_type("max_tokens", int(self.max_tokens))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= (self.max_tokens or math.inf):
            bad("min_tokens", f"must be an int in [0, max_tokens={self.max_tokens}]")
        as_type("min_tokens", int(self.min_tokens))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                bad(name, "must be a bool")
            as_type(name, bool(getattr(self, name)))
        if _is_int(self.seed) and self.seed == -1:  # vLLM's "no seed"
            as_type("seed", None)
        if self.seed is not None:
            if not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT:
                bad("seed", "must be None or an int in [0, 2**64)")
            as_type("seed", int(self.seed))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                if not _is_int(value) or value < -1:
                    bad(name, "must be None, -1 (the whole vocabulary) or an int >= 0 (the number of top "
                              "alternatives)")
                as_type(name, int(value))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is not None and not isinstance(stop, (list, tuple)):
            bad("stop", "must be a string or a list of strings")
        stop = tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            bad("stop", "must be a non-empty string or a list of them")
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or any(not _is_int(t) or t < 0 for t in ids)):
            bad("stop_token_ids", "must be a list of token ids (ints >= 0)")
        if ids is not None:
            as_type("stop_token_ids", [int(t) for t in ids])
        object.__setattr__(self, "stop_strings", stop)
        if stop and not self.detokenize:
            bad("stop", "stop strings are matched in the text: they need detokenize=True")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            bad("truncate_prompt_tokens", "must be None, -1 (max_model_len) or an int >= 1")
        if k is not None:
            as_type("truncate_prompt_tokens", int(k))
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                bad("guided_decoding", "and structured_outputs are the same field (guided_decoding is vLLM's older "
                                       "name): give one")
            as_type("structured_outputs", self.guided_decoding)
            as_type("guided_decoding", None)
        structured = self.structured_outputs
        if isinstance(structured, dict):
            try:
                structured = StructuredOutputsParams(**structured)
            except TypeError as e:
                bad("structured_outputs", f"not StructuredOutputsParams fields ({e})")
            as_type("structured_outputs", structured)
        elif structured is not None and not isinstance(structured, StructuredOutputsParams):
            bad("structured_outputs", "must be None, a StructuredOutputsParams or a dict of its fields")

    def _check_logit_bias(self, bad, as_type) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            bad("logit_bias", "must be None or a dict of token id -> bias")
        checked = {}
        for token, value in bias.items():
            if isinstance(token, str) and token.isascii() and token.isdigit():  # JSON keys are strings (OpenAI's)
                token = int(token)
            if not _is_int(token) or token < 0:
                bad("logit_bias", f"keys must be token ids (ints >= 0), got {token!r}")
            if not _is_real(value) or not math.isfinite(value) or abs(value) > FLOAT32_MAX:
                bad("logit_bias", f"values must be finite numbers within float32's range (|bias| <= "
                                  f"{FLOAT32_MAX:.4g}), got {value!r} for token {token}")
            checked[int(token)] = float(value)
        as_type("logit_bias", checked or None)

    def _check_bad_words(self, bad, as_type) -> None:
        words = self.bad_words
        if words is None:
            return
        if isinstance(words, str) or not isinstance(words, (list, tuple)):
            bad("bad_words", "must be None or a list of strings and/or token-id lists")
        checked = []
        for word in words:
            if isinstance(word, str):
                if not word.strip():
                    bad("bad_words", "a word must hold more than spaces")
                checked.append(word)
            elif _is_token_list(word):
                checked.append([int(t) for t in word])
            else:
                bad("bad_words", f"each entry is a non-empty string or a non-empty list of token ids, got {word!r}")
        as_type("bad_words", checked or None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def seed_int64(self) -> int | None:
        """The seed as the int64 with the same 64 bits (what the sampling op takes)."""
        if self.seed is None:
            return None
        return self.seed - SEED_LIMIT if self.seed >= 2**63 else self.seed

    @property
    def uses_penalties(self) -> bool:
        """Whether a row needs the dense per-token state on the device: a penalty or an allow-list."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or self.allowed_token_ids is not None)

    @property
    def uses_token_bias(self) -> bool:
        """Whether a row adds sparse per-token values to its logits: a bias, bad words or min_tokens."""
        return self.logit_bias is not None or self.bad_words is not None or self.min_tokens > 0
