"""Text <-> token ids, from a checkpoint folder's ``tokenizer.json`` (HF ``tokenizers``)."""

from __future__ import annotations

import json
from pathlib import Path


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
    """A thin wrapper over ``tokenizers.Tokenizer``: ``encode(text) -> ids``, ``decode(ids) -> text``.

    A ``tokenizer.json`` the ``tokenizers`` library cannot parse, or a ``tokenizer_config.json`` that
    is not a JSON object (or whose ``add_bos_token``/``bos_token`` cannot be used), raises ValueError
    naming the file.
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
        self.add_bos_token = False
        self.bos_token_id = None
        config = file.with_name("tokenizer_config.json")
        if config.is_file():
            settings = _read_tokenizer_config(config)
            add_bos = settings.get("add_bos_token", False)
            if not isinstance(add_bos, bool) and add_bos is not None:
                raise ValueError(f"{config}: add_bos_token must be true or false, got {add_bos!r}")
            self.add_bos_token = bool(add_bos)
            bos = settings.get("bos_token")
            if isinstance(bos, dict):
                bos = bos.get("content")
            self.bos_token_id = self._tok.token_to_id(bos) if isinstance(bos, str) else None
            if self.add_bos_token and self.bos_token_id is None:
                # Prompts would silently lose the token the model was trained to see first.
                raise ValueError(f"{config}: add_bos_token is true, but bos_token {bos!r} is not a token of {file}")

    @classmethod
    def maybe_from(cls, folder: str | Path) -> Tokenizer | None:
        return cls(folder) if (Path(folder) / "tokenizer.json").is_file() else None

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()
