"""A checkpoint folder's JSON files that cannot be read raise ValueError naming the file:
config.json (through load_model), tokenizer.json and tokenizer_config.json (engine.tokenizer)."""

import json
import shutil
from pathlib import Path

import pytest

import atom_core
from atom_core.engine.tokenizer import Tokenizer
from atom_core.models import load_model
from tests.models.test_loader import hf_tensors, write_single

DEMO_MODEL = Path(atom_core.__file__).parent / "demo_model"

NOT_JSON = [b"{not json", b"\xff\xfe\x00\x01", b""]  # broken text, bytes that are not UTF-8, an empty file


@pytest.mark.parametrize("content", NOT_JSON)
def test_load_model_with_corrupt_config_json_names_the_file(tmp_path, content):
    folder = write_single(tmp_path / "m", hf_tensors())
    (folder / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=r"config.json: not valid JSON") as err:
        load_model(folder, device="cpu")
    assert str(folder / "config.json") in str(err.value)


@pytest.fixture
def tokenizer_folder(tmp_path):
    """A copy of the demo model's tokenizer files."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL / name, tmp_path / name)
    assert Tokenizer(tmp_path).encode("hello")  # the copy works before it is broken
    return tmp_path


@pytest.mark.parametrize("content", NOT_JSON + [b'{"model": {"type": "NoSuchModel"}}'])
def test_corrupt_tokenizer_json_names_the_file(tokenizer_folder, content):
    (tokenizer_folder / "tokenizer.json").write_bytes(content)
    with pytest.raises(ValueError, match="not a tokenizer the tokenizers library can read") as err:
        Tokenizer(tokenizer_folder)
    assert str(tokenizer_folder / "tokenizer.json") in str(err.value)


@pytest.mark.parametrize("content,match", [(b"{not json", "not valid JSON"), (b"\xff\xfe\x00", "not valid JSON"),
                                           (b"[1, 2]", "expected a JSON object, got list")])
def test_corrupt_tokenizer_config_json_names_the_file(tokenizer_folder, content, match):
    (tokenizer_folder / "tokenizer_config.json").write_bytes(content)
    with pytest.raises(ValueError, match=match) as err:
        Tokenizer(tokenizer_folder)
    assert str(tokenizer_folder / "tokenizer_config.json") in str(err.value)


def _without_post_processor(folder: Path) -> None:
    settings = json.loads((folder / "tokenizer.json").read_text())
    settings["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(settings))


@pytest.mark.parametrize("add_bos_token", [True, "yes"])
def test_add_bos_token_adds_no_bos_as_in_transformers_5_and_warns_when_true(tokenizer_folder, caplog, add_bos_token):
    from transformers import AutoTokenizer

    _without_post_processor(tokenizer_folder)
    settings = {"add_bos_token": add_bos_token, "bos_token": "<|endoftext|>"}
    (tokenizer_folder / "tokenizer_config.json").write_text(json.dumps(settings))
    with caplog.at_level("WARNING", logger="atom_core.engine.tokenizer"):
        tokenizer = Tokenizer(tokenizer_folder)
    assert tokenizer.bos_token_id == 0
    assert tokenizer.encode("hi") == AutoTokenizer.from_pretrained(tokenizer_folder).encode("hi")
    assert tokenizer.encode("hi")[0] != tokenizer.bos_token_id
    warned = [r.getMessage() for r in caplog.records if "add_bos_token" in r.getMessage()]
    assert len(warned) == (add_bos_token is True) and all("post-processor adds no BOS" in w for w in warned)


def test_no_warning_where_the_post_processor_adds_the_bos(tokenizer_folder, caplog):
    settings = {"add_bos_token": True, "bos_token": {"content": "<|endoftext|>", "special": True}}  # (a dict too)
    (tokenizer_folder / "tokenizer_config.json").write_text(json.dumps(settings))
    with caplog.at_level("WARNING", logger="atom_core.engine.tokenizer"):
        tokenizer = Tokenizer(tokenizer_folder)
    assert tokenizer.encode("hi")[0] == tokenizer.bos_token_id == 0
    assert not [r for r in caplog.records if "add_bos_token" in r.getMessage()]
