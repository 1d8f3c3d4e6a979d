"""A checkpoint's ``generation_config.json``: the EOS ids and sampling defaults its authors chose.

HF transformers and vLLM both read it: instruct checkpoints often name their end-of-turn token
only there, and give their recommended temperature / top-p there. What is taken, as vLLM does:

- ``eos_token_id`` (an int or a list): added to the model config's EOS ids;
- ``repetition_penalty``, ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``max_new_tokens`` (as
  ``max_tokens``): the defaults of ``Engine.default_sampling_params``, used when a request gives no
  ``SamplingParams``.
  (``do_sample`` is not read: as in vLLM, a temperature given there applies; a file with
  ``do_sample: false`` and no temperature leaves the default temperature.)

What transformers' ``generate`` would apply and atom_core does not (``do_sample: false``'s greedy
decoding, ``no_repeat_ngram_size``, ``num_beams``, ...) is named in one warning when the file is read:
the outputs then differ from transformers', as vLLM's do (docs/sampling.md, "Coming from transformers").

``Engine.from_pretrained(generation_config=)`` takes vLLM's values: ``"auto"`` (the checkpoint's file),
``"vllm"`` (no sampling defaults; the file's EOS ids still end sequences, as in vLLM), or a folder whose
``generation_config.json`` replaces the checkpoint's for both.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

SAMPLING_FIELDS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
                   "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}
# Fields transformers' generate applies and atom_core does not, with the value that means "off" there: a
# file setting another value decodes differently in transformers (SamplingParams' name in the comment,
# where one exists: a request can ask for it).
UNAPPLIED_FIELDS = {"no_repeat_ngram_size": 0, "num_beams": 1, "typical_p": 1.0, "epsilon_cutoff": 0.0,
                    "eta_cutoff": 0.0, "min_new_tokens": None,  # min_tokens
                    "min_length": 0, "bad_words_ids": None,  # bad_words
                    "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
                    "forced_eos_token_id": None, "sequence_bias": None, "penalty_alpha": None,
                    "exponential_decay_length_penalty": None, "diversity_penalty": 0.0}


def generation_config_of(checkpoint: str | Path, option: str | Path = "auto") -> tuple[list[int], dict]:
    """``(eos_token_ids, sampling defaults)`` for vLLM's ``generation_config`` value ``option`` (module
    docstring). Raises ValueError for a value that is none of the three, or a folder without the file."""
    if option == "auto":
        return read_generation_config(checkpoint)
    if option == "vllm":
        return read_generation_config(checkpoint)[0], {}
    if not (Path(option) / "generation_config.json").is_file():
        raise ValueError(f"generation_config={str(option)!r}: expected 'auto', 'vllm' or a folder holding a "
                         f"generation_config.json")
    return read_generation_config(option)


def read_generation_config(folder: str | Path) -> tuple[list[int], dict]:
    """``(eos_token_ids, sampling defaults)`` from ``folder/generation_config.json``; ``([], {})``
    without one. Raises ValueError naming the file when it is not valid JSON or a field has the
    wrong type."""
    file = Path(folder) / "generation_config.json"
    if not file.is_file():
        return [], {}
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    eos = data.get("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not isinstance(eos, list) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in eos):
        raise ValueError(f"{file}: eos_token_id must be an int >= 0 or a list of them, got {data['eos_token_id']!r}")
    defaults = {ours: data[theirs] for theirs, ours in SAMPLING_FIELDS.items() if data.get(theirs) is not None}
    unapplied = [f"{name}={data[name]!r}" for name, off in UNAPPLIED_FIELDS.items()
                 if name in data and data[name] not in (off, None, [])]
    if data.get("do_sample") is False and defaults.get("temperature", 1.0) != 0:
        unapplied.insert(0, f"do_sample=False (transformers decodes greedily; here the temperature "
                            f"{defaults.get('temperature', 1.0)} applies, as in vLLM: pass temperature=0 for greedy)")
    if unapplied:
        logger.warning("%s sets what transformers' generate applies and atom_core does not: %s",
                       file, "; ".join(unapplied))
    return eos, defaults
