"""The host side of logits processing: what each request adds to its logits, and each step's
inputs of the penalty ops (``atom_core.ops.penalties``), built by the scheduler.

Two representations, chosen by how the data changes:

* **Dense, on the device** (penalties and ``allowed_token_ids``): each such request holds a
  token-state slot, a row of the runner's ``token_state [S, V]`` int32 (output count, in-prompt
  bit, banned bit per token). The row is set once when the request is admitted (``SlotInit``: from
  its prompt, its output so far (after a preemption) and its allow-list), then the runner counts
  each sampled token into it on the device. So the state follows the pending-token mechanism of
  async scheduling by construction: a step's count update is queued right after its sampling,
  before the next step's penalties, and no token has to reach the host first.
* **Sparse, rebuilt each step on the host** (``logit_bias``, ``bad_words``, ``min_tokens``): a list
  of (row, token, value) entries, with -inf for a ban. A bad word whose match depends on the
  row's last token while that token is still on the device (async scheduling) becomes a
  conditional entry: ``(source, required)``, applied only when the previous step's sampled token
  ``source`` equals ``required``.

Rows that use neither cost nothing: the scheduler builds ``LogitsProcessing`` only while some
running row uses one of them (the running batch counts them).

Legend: B = rows of the step, E = bias entries, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from atom_core.engine.sampling_params import SamplingParams

BAN = float("-inf")


@dataclass(slots=True)
class RequestProcessing:
    """What one request adds to its logits, resolved once when it is added.

    bias_token_ids / bias_values: ``logit_bias`` as arrays (int64 / float32 [K]), or None.
    bad_words: token sequences whose last token is banned after the others.
    min_tokens_ban: int64, the ids banned while the output is shorter than ``min_tokens`` (EOS, with
        ``ignore_eos`` too, as in vLLM, and the stop token ids, within the vocabulary), or None.
    allowed_token_ids: int64, or None (all allowed).
    """

    bias_token_ids: np.ndarray | None = None
    bias_values: np.ndarray | None = None
    bad_words: list[tuple[int, ...]] = field(default_factory=list)
    min_tokens_ban: np.ndarray | None = None
    allowed_token_ids: np.ndarray | None = None


def bad_words_token_ids(words, tokenizer) -> list[tuple[int, ...]]:
    """``SamplingParams.bad_words`` as token sequences. A token-id list is taken as is; a string is
    tokenized as vLLM does: the word (left-stripped) alone, and with a leading space when that
    gives another first token and the same number of tokens (the word inside a text)."""
    sequences = []
    for word in words:
        if not isinstance(word, str):
            sequences.append(tuple(word))
            continue
        if tokenizer is None:
            raise ValueError(f"SamplingParams.bad_words={words!r}: string words need a tokenizer; pass token-id "
                             f"lists instead")
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences


def request_processing(params: SamplingParams, eos_token_ids, vocab_size: int,
                       tokenizer=None) -> RequestProcessing | None:
    """The request's ``RequestProcessing``, or None when it adds nothing to its logits."""
    if not (params.uses_penalties or params.uses_token_bias):
        return None
    processing = RequestProcessing()
    if params.logit_bias:
        processing.bias_token_ids = np.fromiter(params.logit_bias, dtype=np.int64, count=len(params.logit_bias))
        processing.bias_values = np.fromiter(params.logit_bias.values(), dtype=np.float32,
                                             count=len(params.logit_bias))
    if params.bad_words:
        processing.bad_words = bad_words_token_ids(params.bad_words, tokenizer)
    if params.min_tokens > 0:
        ban = set(params.stop_token_ids or ()) | set(eos_token_ids)  # (vLLM bans EOS whatever ignore_eos)
        ban = sorted(t for t in ban if 0 <= t < vocab_size)
        processing.min_tokens_ban = np.array(ban, dtype=np.int64) if ban else None
    if params.allowed_token_ids is not None:
        processing.allowed_token_ids = np.array(sorted(set(params.allowed_token_ids)), dtype=np.int64)
    return processing


@dataclass(slots=True)
class SlotInit:
    """Set token-state slot ``slot`` from a sequence's tokens (int64 arrays) before the step's penalties."""

    slot: int
    prompt_token_ids: np.ndarray
    output_token_ids: np.ndarray
    allowed_token_ids: np.ndarray | None


@dataclass(slots=True)
class LogitsProcessing:
    """One step's logits processing (numpy; None fields = nothing of that kind this step).

    slots: int64 [B], each row's token-state slot, -1 = no penalties; with the penalties
        presence_penalty, frequency_penalty, repetition_penalty (float32 [B]). None when no row
        of the step has a slot.
    slot_inits: slots to set before this step's penalties (rows admitted by this step).
    bias_rows, bias_token_ids: int64 [E]; bias_values: float32 [E] (-inf = ban); applied before
        the penalties (vLLM's order). None when E = 0.
    bias_sources, bias_required: int64 [E]: an entry with ``bias_sources[e] >= 0`` applies only
        when ``previous_sampled[bias_sources[e]] == bias_required[e]`` (the previous step's sampled
        tokens, as ``ScheduledStep.pending_sources``); None when every entry applies.
    mask_rows: int64 [G], the step rows constrained by a grammar (structured output), and
        token_bitmask: int32 [G, ceil(V / 32)], their allowed next tokens (``ops.apply_token_mask_``),
        applied first; None when no row of the step samples a constrained token.
    """

    slots: np.ndarray | None = None
    presence_penalty: np.ndarray | None = None
    frequency_penalty: np.ndarray | None = None
    repetition_penalty: np.ndarray | None = None
    slot_inits: list[SlotInit] = field(default_factory=list)
    bias_rows: np.ndarray | None = None
    bias_token_ids: np.ndarray | None = None
    bias_values: np.ndarray | None = None
    bias_sources: np.ndarray | None = None
    bias_required: np.ndarray | None = None
    mask_rows: np.ndarray | None = None
    token_bitmask: np.ndarray | None = None


def step_processing(batch, requests, rows) -> LogitsProcessing | None:
    """The logits processing of a step over ``rows`` of ``batch`` (a ``RunningBatch``; ``requests``
    are the rows' requests, in step order), or None when no row of the step uses any."""
    out = LogitsProcessing()
    if batch.new_slots:
        out.slot_inits = [SlotInit(slot, np.array(r.prompt_token_ids, dtype=np.int64),
                                   np.array(r.output_token_ids, dtype=np.int64), r.processing.allowed_token_ids)
                          for r, slot in batch.new_slots]
        batch.new_slots = []
    if batch.num_using_penalties:
        slots = batch.token_state_slot[rows]
        if (slots >= 0).any():
            out.slots = slots
            out.presence_penalty = batch.presence_penalty[rows]
            out.frequency_penalty = batch.frequency_penalty[rows]
            out.repetition_penalty = batch.repetition_penalty[rows]
    if batch.num_using_token_bias:
        _bias_entries(out, batch, requests, rows)
    if out.slots is None and out.bias_rows is None and not out.slot_inits:
        return None
    return out


def _bias_entries(out: LogitsProcessing, batch, requests, rows) -> None:
    """The sparse entries of the rows that use logit_bias, bad_words or min_tokens (a Python loop
    over those rows only)."""
    flat = np.arange(batch.max_num_seqs)[rows]  # batch row of each step row
    step_rows = np.flatnonzero(batch.uses_token_bias[flat])
    entry_rows, tokens, values, sources, required = [], [], [], [], []
    conditional = False

    def add(i, token_ids, value, source=-1, need=-1):
        n = len(token_ids)
        entry_rows.append(np.full(n, i, dtype=np.int64))
        tokens.append(np.asarray(token_ids, dtype=np.int64))
        values.append(value if isinstance(value, np.ndarray) else np.full(n, value, dtype=np.float32))
        sources.append(np.full(n, source, dtype=np.int64))
        required.append(np.full(n, need, dtype=np.int64))

    for i in step_rows.tolist():
        request, row = requests[i], int(flat[i])
        processing, params = request.processing, request.params
        num_output = int(batch.num_tokens[row] - batch.num_prompt_tokens[row])  # the sampled token's index
        if processing.bias_token_ids is not None:
            add(i, processing.bias_token_ids, processing.bias_values)
        if processing.min_tokens_ban is not None and num_output < params.min_tokens:
            add(i, processing.min_tokens_ban, BAN)
        if processing.bad_words:
            pending = int(batch.pending_index[row])  # >= 0: the last output token is still on the device
            token_ids = request.token_ids
            for word in processing.bad_words:
                prefix = len(word) - 1
                if prefix > num_output:
                    continue
                if pending < 0 or prefix == 0:
                    if prefix == 0 or token_ids[len(token_ids) - prefix:] == list(word[:-1]):
                        add(i, word[-1:], BAN)
                elif prefix == 1 or token_ids[len(token_ids) - prefix + 1:] == list(word[:-2]):
                    add(i, word[-1:], BAN, pending, word[-2])  # if the pending token is the word's one before last
                    conditional = True
    if not entry_rows:
        return
    out.bias_rows = np.concatenate(entry_rows)
    out.bias_token_ids = np.concatenate(tokens)
    out.bias_values = np.concatenate(values).astype(np.float32, copy=False)
    if conditional:
        out.bias_sources = np.concatenate(sources)
        out.bias_required = np.concatenate(required)
