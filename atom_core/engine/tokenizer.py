"""Text <-> token ids, from a checkpoint folder's ``tokenizer.json`` (HF ``tokenizers``)."""

from __future__ import annotations

import json
from pathlib import Path


class Tokenizer:
    """A thin wrapper over ``tokenizers.Tokenizer``: ``encode(text) -> ids``, ``decode(ids) -> text``."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(path)
        file = folder / "tokenizer.json" if folder.is_dir() else folder
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {file}; pass token-id prompts or a folder with one")
        self._tok = HFTokenizer.from_file(str(file))
        self.add_bos_token = False
        self.bos_token_id = None
        config = file.with_name("tokenizer_config.json")
        if config.is_file():
            settings = json.loads(config.read_text())
            self.add_bos_token = bool(settings.get("add_bos_token", False))
            bos = settings.get("bos_token")
            if isinstance(bos, dict):
                bos = bos.get("content")
            self.bos_token_id = self._tok.token_to_id(bos) if isinstance(bos, str) else None

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
