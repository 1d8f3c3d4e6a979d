"""``generate`` and ``chat``: the offline API (vLLM's ``LLM.generate`` / ``LLM.chat``) over ``add_request``
and ``step``, shared by ``Engine`` and the data-parallel front ``DataParallelEngine``.

The class that mixes it in provides ``tokenizer``, ``add_request(prompt, params, prompt_text=)``,
``_check_request(prompt, params) -> (token ids, params)``, ``step()``, ``abort(id)``,
``has_unfinished_requests()`` and ``_num_unfinished()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from atom_core.engine.outputs import RequestOutput
from atom_core.engine.request import prompt_text_of
from atom_core.engine.sampling_params import SamplingParams

# chat's template arguments that chat_template_kwargs may replace (vLLM's LLM.chat); the other names of
# chat_template.template_call_arguments() are what apply_chat_template and the renderer fill themselves.
_REPLACEABLE_TEMPLATE_ARGUMENTS = frozenset({"chat_template", "add_generation_prompt", "continue_final_message",
                                             "tools", "documents"})


class OfflineAPI:
    """``generate`` and ``chat`` (module docstring)."""

    def generate(self, prompts: str | Sequence[int] | Iterable[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts to completion; one output per prompt, in prompt order (generated part only).

        ``prompts``: a string, one token-id list or one of vLLM's prompt dicts (one prompt), or a list
        of them; ``sampling_params``: one for all, or one per prompt (None: the engine's defaults, from the
        checkpoint's generation config). Every prompt is checked before any is queued. With ``n > 1`` a prompt's output is its
        sequence 0, and its ``outputs`` holds all n in index order. ``generate`` runs only its own
        prompts: it refuses while requests added with ``add_request`` are unfinished (step them or abort
        them first), so no output of theirs is consumed here. When it raises (a step failed, or
        KeyboardInterrupt), it aborts its prompts still queued or running first.
        """
        if isinstance(prompts, (str, Mapping, np.ndarray, torch.Tensor)) or (
                isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]  # one prompt
        prompts = list(prompts)
        return self._generate(prompts, [prompt_text_of(prompt) for prompt in prompts], sampling_params, use_tqdm)

    def _generate(self, prompts: list, prompt_texts: list[str | None],
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                  use_tqdm: bool) -> list[RequestOutput]:
        """``generate`` of a list of prompts, each with its text (its outputs' ``prompt``)."""
        if self.has_unfinished_requests():
            raise RuntimeError(f"generate() runs only its own prompts, but {self._num_unfinished()} requests added "
                               f"with add_request are unfinished: run step() until they finish, or abort them")
        params_list = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                       else [sampling_params] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        checked = []
        for i, (prompt, sp) in enumerate(zip(prompts, params_list)):
            try:
                checked.append(self._check_request(prompt, sp))
            except (TypeError, ValueError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
        ids: list[int] = []
        try:
            for (token_ids, sp), text in zip(checked, prompt_texts):
                ids.append(self.add_request(token_ids, sp, prompt_text=text))
            order = {rid: i for i, rid in enumerate(ids)}
            finished: dict[int, list[RequestOutput]] = {rid: [] for rid in ids}
            with tqdm(total=sum(sp.n for _, sp in checked), desc="generate", disable=not use_tqdm) as bar:
                while self.has_unfinished_requests():
                    for out in self.step().finished():
                        if out.request_id in order:
                            finished[out.request_id].append(out)
                            bar.update(1)
        except BaseException:
            for rid in ids:
                self.abort(rid)  # a no-op for the finished (and the failed) ones
            raise
        results = []
        for rid in sorted(finished, key=order.__getitem__):
            group = sorted(finished[rid], key=lambda out: out.index)
            if len(group) > 1:
                for out in group:
                    out._group = group
            results.append(group[0])
        return results

    def get_tokenizer(self):
        """The engine's ``Tokenizer`` (``encode``, ``decode``, ``apply_chat_template``; None without
        tokenizer.json): vLLM's ``LLM.get_tokenizer``."""
        return self.tokenizer

    def chat(self, messages: Sequence[Mapping] | Sequence[Sequence[Mapping]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: Mapping | None = None) -> list[RequestOutput]:
        """``generate`` on conversations rendered by the checkpoint's chat template (vLLM's ``LLM.chat``).

        ``messages``: one conversation (a list of {"role": ..., "content": ...} dicts) or a list of
        them; ``sampling_params`` as for ``generate`` (one, or one per conversation). ``chat_template``: a
        template name or a template itself (default: the checkpoint's). ``add_generation_prompt`` opens the
        assistant's turn; ``continue_final_message`` (with ``add_generation_prompt=False``) leaves the final
        message open for the model to go on writing it. ``tools`` and ``chat_template_kwargs`` (further
        variables, e.g. ``{"enable_thinking": False}``) are passed to the template; as in vLLM, an entry of
        ``chat_template_kwargs`` named like one of the arguments above takes its place. Returns one output per
        conversation. Raises ``ChatTemplateError`` (a ValueError) when a template is missing or refuses a
        conversation, before anything is queued.
        """
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (tokenizer.json and a chat template in the model folder)")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages: a conversation (a non-empty list of message dicts) or a list of them")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise TypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        conversations = list(messages) if isinstance(messages[0], (list, tuple)) else [messages]
        # vLLM's LLM.chat: the named arguments, then chat_template_kwargs over them (its entries win).
        arguments = {"chat_template": chat_template, "add_generation_prompt": add_generation_prompt,
                     "continue_final_message": continue_final_message, "tools": tools,
                     **(chat_template_kwargs or {})}
        from atom_core.engine.chat_template import ChatTemplateError, template_call_arguments

        reserved = sorted(set(arguments) & (template_call_arguments() - _REPLACEABLE_TEMPLATE_ARGUMENTS))
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs: {', '.join(map(repr, reserved))} cannot be set (chat "
                                    "renders the conversations it is given, to text, then tokenizes it)")
        # Rendered to text, then encoded as apply_chat_template(tokenize=True) does: the text is the outputs' prompt.
        texts = [self.tokenizer.apply_chat_template(conversation, tokenize=False, **arguments)
                 for conversation in conversations]
        prompts = [self.tokenizer.encode(text, add_special_tokens=False) for text in texts]
        return self._generate(prompts, texts, sampling_params, use_tqdm)
