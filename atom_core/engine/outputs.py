"""What the engine hands back: one ``RequestOutput`` per request per step (and at the end)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """A request's generated part so far.

    ``token_ids`` and ``text`` hold everything generated (the prompt excluded);
    ``new_token_ids`` what this step added. ``finish_reason`` is None while running, else one of
    "stop" (EOS, a stop token or a stop string), "length" (max_tokens or max_model_len), "abort".
    """

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    logprobs: list[float] | None = field(default=None)
