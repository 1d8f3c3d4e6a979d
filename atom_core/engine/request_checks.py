"""What a request must be before it is queued: its prompt as a list of token ids, and its
``SamplingParams`` checked against the model that will run it (vocabulary, ``max_model_len``,
``max_logprobs``, the tokenizer that string bad words and structured output need).

``Engine`` and ``DataParallelEngine``'s front run the same ``RequestChecks``, so both refuse the same
requests with the same messages, and nothing is queued when one is refused. How a structured-output
constraint is checked is theirs to say (``check_grammar``): the engine compiles it (the request's own
compilation is then a cache hit), the front only parses it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from atom_core.engine.sampling_params import SamplingParams
from atom_core.engine.tokenizer import Tokenizer


def encode_prompt(prompt, tokenizer: Tokenizer | None) -> list[int]:
    """A prompt as a list of Python ints: a string (through the tokenizer), a list or tuple of
    ints (numpy ints too), a 1-D integer numpy array or tensor, or vLLM's prompt dicts
    (``{"prompt": text}``, ``{"prompt_token_ids": ids}``). Bools and everything else are refused by name."""
    if isinstance(prompt, Mapping):
        prompt = _vllm_prompt(prompt)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("string prompts need a tokenizer (tokenizer.json in the model folder); "
                             "pass token ids instead")
        token_ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (np.ndarray, torch.Tensor)):
        kind = "numpy array" if isinstance(prompt, np.ndarray) else "tensor"
        is_int = (prompt.dtype.kind in "iu") if isinstance(prompt, np.ndarray) else \
            (not prompt.dtype.is_floating_point and not prompt.dtype.is_complex and prompt.dtype != torch.bool)
        if prompt.ndim != 1 or not is_int:
            raise TypeError(f"a token-id prompt given as a {kind} must be 1-D of an integer dtype, got "
                            f"shape {tuple(prompt.shape)} and dtype {prompt.dtype}")
        token_ids = prompt.tolist()
    elif isinstance(prompt, (list, tuple)):
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) for t in prompt):
            bad = next(t for t in prompt
                       if not isinstance(t, (int, np.integer)) or isinstance(t, (bool, np.bool_)))
            raise TypeError(f"a token-id prompt holds ints, got {type(bad).__name__} {bad!r}")
        token_ids = [int(t) for t in prompt]
    else:
        raise TypeError(f"a prompt is a string, a list of int token ids or a 1-D integer array, "
                        f"got {type(prompt).__name__}")
    if not token_ids:
        raise ValueError("empty prompt: a prompt needs at least one token")
    return token_ids


def _vllm_prompt(prompt: Mapping):
    """What vLLM's ``TextPrompt`` / ``TokensPrompt`` dict holds: its text or its token ids."""
    keys = set(prompt)
    if keys in ({"prompt"}, {"prompt_token_ids"}):
        return prompt["prompt" if "prompt" in keys else "prompt_token_ids"]
    raise TypeError(f"a prompt dict holds only 'prompt' (text) or only 'prompt_token_ids' (vLLM's TextPrompt / "
                    f"TokensPrompt), got keys {sorted(map(str, keys))}")


@dataclass(frozen=True)
class RequestChecks:
    """The checks of one engine's requests.

    ``check_grammar(spec)``: raises ValueError naming the problem when a structured-output constraint
    cannot be served. ``check_compiled(grammar, params)``: that an already compiled ``grammar`` (from
    ``Engine.compile_structured``) is this engine's compilation of ``params.structured_outputs``; None
    where requests cannot bring one."""

    tokenizer: Tokenizer | None
    vocab_size: int
    max_model_len: int
    max_logprobs: int
    check_grammar: Callable[[object], None]
    check_compiled: Callable[[object, SamplingParams], None] | None = None

    def check(self, prompt, params: SamplingParams, grammar=None) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the params it runs with (``max_tokens`` None or beyond the room
        ``max_model_len`` leaves after the prompt becomes that room, as vLLM stops a sequence at
        ``max_model_len``; ``logprobs`` / ``prompt_logprobs`` of -1 the vocabulary size); raises (TypeError /
        ValueError naming the problem) when the prompt or ``params`` are not valid for this model, or the
        prompt leaves no room for output."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        token_ids = encode_prompt(prompt, self.tokenizer)
        if params.truncate_prompt_tokens is not None:  # vLLM's: the last k tokens (-1: max_model_len)
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            token_ids = token_ids[-keep:]
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens leaves no room for output under "
                             f"max_model_len={self.max_model_len}")
        room = self.max_model_len - len(token_ids)
        if params.max_tokens is None or params.max_tokens > room:
            # vLLM's: a sequence stops at max_model_len (finish_reason "length"), whatever max_tokens asked
            params = dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        # (The pool always holds one request of max_model_len: plan_kv_pool refuses smaller pools.)
        vocab = self.vocab_size
        if not all(0 <= t < vocab for t in token_ids):
            bad = next(t for t in token_ids if not 0 <= t < vocab)
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad}")
        self.check_params(params, grammar)
        whole = {name: vocab for name in ("logprobs", "prompt_logprobs") if getattr(params, name) == -1}
        if whole:  # vLLM's -1: every token of the vocabulary
            params = dataclasses.replace(params, **whole)
        return token_ids, params

    def check_params(self, params: SamplingParams, grammar=None) -> None:
        """What SamplingParams cannot check alone: token ids inside this vocabulary (logit_bias,
        allowed_token_ids, stop_token_ids, bad_words), log-prob counts
        under ``max_logprobs``, stop strings and bad words that need a tokenizer, a structured output's
        constraint (or that ``grammar``, compiled already, is this engine's compilation of it)."""
        vocab = self.vocab_size

        def outside(name, token_ids):
            bad = next((t for t in token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"SamplingParams.{name}: token id {bad} is outside the vocabulary [0, {vocab})")

        if params.stop_strings and self.tokenizer is None:
            raise ValueError("SamplingParams.stop: stop strings need a tokenizer (tokenizer.json in the model "
                             "folder) to read the text; pass stop_token_ids instead")
        if params.logit_bias:
            outside("logit_bias", params.logit_bias)
        if params.allowed_token_ids is not None:
            outside("allowed_token_ids", params.allowed_token_ids)
        if params.stop_token_ids:  # (vLLM refuses them too: such a token can never be sampled)
            outside("stop_token_ids", params.stop_token_ids)
        for word in params.bad_words or ():
            if isinstance(word, str):
                if self.tokenizer is None:
                    raise ValueError("SamplingParams.bad_words: string words need a tokenizer (tokenizer.json in the "
                                     "model folder); pass token-id lists instead")
            else:
                outside("bad_words", word)
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("SamplingParams.structured_outputs: structured output needs a tokenizer "
                                 "(tokenizer.json in the model folder)")
            if grammar is None:
                self.check_grammar(params.structured_outputs)  # ValueError naming the problem
        if grammar is not None:
            if self.check_compiled is None:
                raise TypeError("a compiled grammar is taken by Engine.add_request only")
            self.check_compiled(grammar, params)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            wanted = vocab if value == -1 else value  # -1: the whole vocabulary
            if wanted is not None and wanted > self.max_logprobs:
                whole = f" (the whole vocabulary, {vocab})" if value == -1 else ""
                raise ValueError(f"SamplingParams.{name}={value}{whole}: at most max_logprobs={self.max_logprobs} "
                                 f"top alternatives (Engine(max_logprobs=...); -1 there: no limit)")
