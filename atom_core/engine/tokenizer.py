"""Text <-> token ids, from a checkpoint folder's ``tokenizer.json`` (HF ``tokenizers``), and the
folder's chat templates (``engine.chat_template``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)
# Texts longer than this are tokenized with the interpreter lock released (Tokenizer.encode).
GIL_FREE_CHARS = 16384
# What a folder holds when its tokenizer is saved in a slow tokenizer's files only: transformers can load
# it (and write tokenizer.json: AutoTokenizer.from_pretrained(folder).save_pretrained(folder)); atom_core cannot.
SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model")


def _read_tokenizer_config(file: Path) -> dict:
    """``tokenizer_config.json`` as a dict; ValueError naming the file when it is not a JSON object."""
    try:
        settings = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:  # bytes that are not UTF-8 text land here too
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(settings, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(settings).__name__}")
    return settings


class Tokenizer:
    """A thin wrapper over ``tokenizers.Tokenizer``: ``encode(text) -> ids``, ``decode(ids) -> text``,
    ``apply_chat_template(messages) -> ids``.

    A ``tokenizer.json`` the ``tokenizers`` library cannot parse, or a ``tokenizer_config.json`` that
    is not a JSON object, raises ValueError naming the file.

    Special tokens around a prompt come from ``tokenizer.json``'s post-processor alone (Llama-3's BOS):
    transformers 5 drops ``tokenizer_config.json``'s ``add_bos_token`` / ``add_eos_token`` whenever a
    ``tokenizer.json`` is present, for every tokenizer class, and so does atom_core (a warning says so
    where the key asks for a BOS the post-processor does not add: transformers 4's Llama and Gemma classes
    added one there).
    """

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(path)
        file = folder / "tokenizer.json" if folder.is_dir() else folder
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {file}; pass token-id prompts or a folder with one")
        try:
            self._tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception for every parse error
            raise ValueError(f"{file}: not a tokenizer the tokenizers library can read ({e})") from e
        self.bos_token_id = None
        self.eos_token_id = None  # tokenizer_config.json's eos_token, where it names a token of the vocabulary
        self.chat_templates: dict[str, str] = {}  # name -> Jinja source ("default" for a single one)
        self.special_tokens: dict[str, str] = {}  # bos_token, eos_token, ...: what a chat template sees
        config = file.with_name("tokenizer_config.json")
        settings = _read_tokenizer_config(config) if config.is_file() else {}
        if settings or (file.parent / "chat_template.jinja").is_file():
            from atom_core.engine.chat_template import read_chat_templates, special_tokens_of

            self.chat_templates = read_chat_templates(file.parent, settings)
            self.special_tokens = special_tokens_of(settings)
        if settings:
            self.bos_token_id = self._token_id(settings.get("bos_token"))
            self.eos_token_id = self._token_id(settings.get("eos_token"))
            if settings.get("add_bos_token") is True and not self._post_processor_adds_bos():
                logger.warning("%s sets add_bos_token, but %s's post-processor adds no BOS: prompts get none "
                               "(transformers 5 ignores the key when tokenizer.json is present, and so does "
                               "atom_core; transformers 4's Llama / Gemma tokenizers added one). Add a "
                               "TemplateProcessing post-processor to tokenizer.json if the model expects it",
                               config, file.name)

    def _post_processor_adds_bos(self) -> bool:
        """Whether encoding text with special tokens puts the BOS token first (False without a BOS token)."""
        if self.bos_token_id is None:
            return False
        encoding = self._tok.encode("a", add_special_tokens=True)
        return bool(encoding.ids) and encoding.ids[0] == self.bos_token_id and bool(encoding.special_tokens_mask[0])

    def _token_id(self, token) -> int | None:
        """The id of a tokenizer_config.json special token entry (a string or {"content": ...}), or None."""
        if isinstance(token, dict):
            token = token.get("content")
        return self._tok.token_to_id(token) if isinstance(token, str) else None

    @classmethod
    def maybe_from(cls, folder: str | Path) -> Tokenizer | None:
        """The folder's tokenizer; None without a tokenizer.json (a warning when the folder has a slow
        tokenizer's files instead: string prompts and text then fail)."""
        folder = Path(folder)
        if (folder / "tokenizer.json").is_file():
            return cls(folder)
        slow = [name for name in SLOW_TOKENIZER_FILES if (folder / name).is_file()]
        if slow:
            logger.warning("%s has %s but no tokenizer.json, the only tokenizer file atom_core reads: no tokenizer "
                           "(prompts must be token ids, outputs have no text). transformers writes one: "
                           "AutoTokenizer.from_pretrained(folder).save_pretrained(folder)", folder, ", ".join(slow))
        return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with what tokenizer.json's post-processor adds (Llama-3's BOS) when
        ``add_special_tokens`` (a chat template writes its own): transformers' ``encode``
        (docs/sampling.md, "Prompts and the BOS token").

        A text of more than ``GIL_FREE_CHARS`` characters goes through ``encode_batch``, the same pipeline,
        which lets other Python threads run while it tokenizes (``encode`` holds the interpreter lock: a
        7 MB prompt stopped a server's other requests for 6 s)."""
        if len(text) > GIL_FREE_CHARS:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: list[dict], *, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, chat_template: str | None = None,
                            tools: list[dict] | None = None, documents: list[dict] | None = None, tokenize: bool = True,
                            **template_kwargs):
        """One conversation (a list of {"role", "content", ...} messages) rendered by the chat template
        (``chat_template``: a template name or a template itself; default: the checkpoint's) and,
        with ``tokenize``, its token ids (no special tokens added: the template writes them), as
        transformers' ``apply_chat_template``; ``continue_final_message`` leaves the final message open (its
        text ends the prompt; needs ``add_generation_prompt=False``). Raises ``ChatTemplateError`` (a
        ValueError)."""
        from atom_core.engine.chat_template import choose_template, render

        text = render(choose_template(self.chat_templates, chat_template, tools), conversation,
                      add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                      tools=tools, documents=documents, special_tokens=self.special_tokens, **template_kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @property
    def backend(self):
        """The underlying ``tokenizers.Tokenizer`` (what a grammar library reads the vocabulary from)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()
