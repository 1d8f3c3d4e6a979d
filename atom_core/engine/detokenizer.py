"""Incremental detokenization: the text of one output sequence, decoded as its tokens arrive.

Each token costs one decode of a small window, never of the whole output (the offset scheme of
``tokenizers``' ``DecodeStream`` and vLLM's detokenizers):

    window  = the tokens of the last emitted piece (context) + the tokens since (pending)
    text    = decode(window), less a trailing run of U+FFFD (a character whose bytes are incomplete)
    start   = the length of the prefix text shares with decode(context)
    if text is longer than start:
        emit text[start:]                      (the new characters)
        window = the tokens since the context (they become the next context)

So bytes of a character split over several tokens wait in the window until the character is
complete (a byte-level tokenizer decodes an incomplete character as U+FFFD), while the complete
characters before them are emitted; a token whose text depends on its left neighbour
(sentencepiece's leading space) is decoded next to it; and the window holds a few tokens. The first
window is a short suffix of the prompt, so the output's first token is decoded in context (as vLLM
does): its leading space is kept. That suffix is the shortest of 4..24 tokens that decodes without
U+FFFD, else the longest: where the prompt ends inside a character, the character belongs to the
output that completes it (``start`` stops before the context's U+FFFD).

Stop strings are searched in the new characters plus the ``max(len(stop)) - 1`` characters before
them (a stop string may span tokens); while a request runs, its visible text holds back that many
characters (unless ``include_stop_str_in_output``), so streamed pieces never show a stop string
that is then cut: the pieces of every step add up to the final text.

Legend: k = output tokens decoded; chars = characters of decoded text.
"""

from __future__ import annotations

import os
from bisect import bisect_right

INCOMPLETE_CHARACTER = "\ufffd"  # what decoding gives for the bytes of a character not yet complete
PROMPT_CONTEXT = (4, 24)  # the first window: the shortest prompt suffix of 4..24 tokens that decodes cleanly
                         # (else the longest)


class Detokenizer:
    """The decoded output of one sequence, grown token by token.

    Args:
        tokenizer: has ``decode(token_ids, skip_special_tokens=...) -> str``.
        prompt_token_ids: the prompt (a short suffix of it is the first window's context).
        skip_special_tokens: leave special tokens out of the text.
        stop_strings: searched with :meth:`find_stop`; while running, ``max(len) - 1`` characters
            are held back from the visible text (none with ``include_stop_str_in_output``).

    ``ends[k]`` is the length of the decoded text after k output tokens, so the text as of any
    earlier step stays available (outputs are snapshots of their step).
    """

    __slots__ = ("_tokenizer", "skip_special_tokens", "stop_strings", "include_stop_str", "holdback", "_prompt",
                 "_window", "_context_len", "_context_text", "_pieces", "_piece_ends", "_joined",
                 "_joined_pieces", "ends", "_searched", "final_tokens", "final_chars")

    def __init__(self, tokenizer, prompt_token_ids, *, skip_special_tokens: bool = True,
                 stop_strings: tuple[str, ...] = (), include_stop_str_in_output: bool = False):
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop_strings = tuple(stop_strings)
        self.include_stop_str = include_stop_str_in_output
        longest = max((len(s) for s in self.stop_strings), default=0)
        self.holdback = 0 if include_stop_str_in_output or not longest else longest - 1
        self._prompt = prompt_token_ids  # primes the first window on the first token (nothing decoded before)
        self._window: list[int] = []
        self._context_text = ""
        self._context_len = 0
        self._pieces: list[str] = []
        self._piece_ends: list[int] = []  # cumulative characters after each piece
        self._joined = ""  # "".join(pieces[:_joined_pieces]), extended when the whole text is read
        self._joined_pieces = 0
        self.ends = [0]
        self._searched = 0  # characters already searched for stop strings
        self.final_tokens: int | None = None  # output tokens whose text counts, once finished
        self.final_chars: int | None = None  # where a stop string cut the final text

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _prime(self) -> None:
        prompt, self._prompt = list(self._prompt), None
        shortest, longest = PROMPT_CONTEXT
        sizes = range(min(shortest, len(prompt)), min(longest, len(prompt)) + 1)
        for size in sizes:
            text = self._decode(prompt[-size:]) if size else ""
            if INCOMPLETE_CHARACTER not in text or size == sizes[-1]:
                self._window, self._context_text = prompt[-size:] if size else [], text
                self._context_len = len(self._window)
                return

    # ------------------------------------------------------------------ decoding

    @property
    def num_tokens(self) -> int:
        """Output tokens decoded so far."""
        return len(self.ends) - 1

    @property
    def num_chars(self) -> int:
        """Characters decoded so far (complete characters only)."""
        return self.ends[-1]

    def add(self, token_id: int) -> str:
        """Decode one more output token; returns the characters it completed (maybe "")."""
        if self._prompt is not None:
            self._prime()
        window = self._window
        window.append(token_id)
        text = self._decode(window).rstrip(INCOMPLETE_CHARACTER)
        context = self._context_text
        start = len(context) if text.startswith(context) else len(os.path.commonprefix((text, context)))
        piece = ""
        if len(text) > start:
            piece = text[start:]
            self._window = window = window[self._context_len:]  # the new tokens are the next context
            self._context_len = len(window)
            self._context_text = self._decode(window)
            self._pieces.append(piece)
            self._piece_ends.append(self.ends[-1] + len(piece))
        self.ends.append(self.ends[-1] + len(piece))
        return piece

    def decode_until(self, output_token_ids, count: int) -> None:
        """Decode the output tokens before position ``count`` not decoded yet (``output_token_ids``:
        indexable by output position, e.g. an :class:`OutputTokens`)."""
        for k in range(self.num_tokens, count):
            self.add(output_token_ids[k])

    def chars(self, start: int, stop: int) -> str:
        """Decoded text[start:stop] (``stop <= num_chars``), reading only the pieces it spans."""
        if start >= stop:
            return ""
        if stop <= len(self._joined):
            return self._joined[start:stop]
        first = bisect_right(self._piece_ends, start)  # the piece holding character `start`
        base = self._piece_ends[first - 1] if first else 0
        return "".join(self._pieces[first:bisect_right(self._piece_ends, stop - 1) + 1])[start - base:stop - base]

    def text(self, stop: int) -> str:
        """Decoded text[:stop], extending a joined copy (reading the whole text is O(its length))."""
        if stop > len(self._joined):
            self._joined += "".join(self._pieces[self._joined_pieces:])
            self._joined_pieces = len(self._pieces)
        return self._joined[:stop]

    # ------------------------------------------------------------------ stop strings and the end

    def find_stop(self) -> tuple[str, int] | None:
        """Search the characters decoded since the last search (with the ``len(stop) - 1`` before
        them) for the stop strings: ``(stop string, where the final text ends)`` for the earliest
        match (the final text ends before it, or after it with ``include_stop_str_in_output``), or None."""
        end, searched = self.num_chars, self._searched
        self._searched = end
        if end == searched or not self.stop_strings:
            return None
        start = max(0, searched - max(len(s) for s in self.stop_strings) + 1)
        window = self.chars(start, end)
        best = None
        for stop in self.stop_strings:
            i = window.find(stop, max(0, searched - start - len(stop) + 1))  # must end in the new characters
            if i >= 0 and (best is None or i < best[1]):
                best = (stop, i)
        if best is None:
            return None
        stop, i = best
        return stop, start + i + (len(stop) if self.include_stop_str else 0)

    def skip_stop_search(self) -> None:
        """Mark everything decoded so far as searched (stop strings are not checked before min_tokens)."""
        self._searched = self.num_chars

    def finish(self, num_text_tokens: int, final_chars: int | None = None) -> None:
        """The sequence ended: its text is that of its first ``num_text_tokens`` output tokens (the
        stop token's text left out), cut at ``final_chars`` when a stop string ended it. Nothing is
        decoded here: the rest is decoded when the text is read."""
        self.final_tokens, self.final_chars = num_text_tokens, final_chars

    def visible_chars(self, output_tokens, num_tokens: int, finished: bool) -> int:
        """Length of the text shown after ``num_tokens`` output tokens: while running, the decoded
        text less the held-back characters; once finished, the final text. Decodes what it needs
        from ``output_tokens`` (indexable by output position)."""
        if finished and self.final_tokens is not None:
            num_tokens = min(num_tokens, self.final_tokens)
        self.decode_until(output_tokens, num_tokens)
        if finished:
            return self.ends[num_tokens] if self.final_chars is None else self.final_chars
        return max(0, self.ends[num_tokens] - self.holdback)


class OutputTokens:
    """``request.token_ids`` seen from the output's first position (no copy)."""

    __slots__ = ("_token_ids", "_offset")

    def __init__(self, token_ids: list[int], num_prompt_tokens: int):
        self._token_ids, self._offset = token_ids, num_prompt_tokens

    def __getitem__(self, k: int) -> int:
        return self._token_ids[self._offset + k]
