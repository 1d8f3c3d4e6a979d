"""The stop rule's final text (as vLLM gives it) and the checkpoint's generation_config.json."""

import json
import shutil

import pytest
import torch

from atom_core.engine import Engine, SamplingParams
from atom_core.engine.engine import DEMO_MODEL
from atom_core.engine.request import Request
from atom_core.engine.stop_rule import StopRule
from atom_core.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(DEMO_MODEL)


def ids(tokenizer, text):
    """The text's token ids without the BOS token the tokenizer adds to prompts."""
    return tokenizer.encode(text, add_special_tokens=False)


def finished_text(tokenizer, output, **params):
    rule = StopRule(eos_token_ids=[0], max_model_len=100, tokenizer=tokenizer)
    request = Request(0, [5, 6], SamplingParams(**params), seed=0)
    request.length_limit = rule.length_limit(request)
    request.token_ids += output
    return rule.finish_reason(request), request.text


def test_a_stop_tokens_text_is_left_out_and_the_token_kept(tokenizer):
    body = ids(tokenizer, "Return the number")
    stop = ids(tokenizer, " of")[-1]  # an ordinary, non-special token
    reason, text = finished_text(tokenizer, body + [stop], stop_token_ids=[stop], max_tokens=50)
    assert reason == "stop" and text == tokenizer.decode(body)
    assert tokenizer.decode(body + [stop]) != text  # the token had text of its own


def test_a_final_text_ends_before_a_character_whose_bytes_are_incomplete(tokenizer):
    body, euro = ids(tokenizer, "price: "), ids(tokenizer, "€")
    assert len(euro) > 1 and tokenizer.decode(body + euro[:1]).endswith("\ufffd")  # the case at hand
    output = body + euro[:1]
    reason, text = finished_text(tokenizer, output, max_tokens=len(output))
    assert reason == "length" and text == tokenizer.decode(body)
    output = body + euro
    assert finished_text(tokenizer, output, max_tokens=len(output))[1] == "price: €"  # complete: kept


def test_stop_strings_cut_the_text_before_them(tokenizer):
    output = ids(tokenizer, "Return the number of items")
    reason, text = finished_text(tokenizer, output, stop=[" number"], max_tokens=50)
    assert reason == "stop" and text == "Return the"


def _checkpoint_with(tmp_path, generation_config):
    folder = tmp_path / "model"
    shutil.copytree(DEMO_MODEL, folder)
    (folder / "generation_config.json").write_text(generation_config)
    return folder


def test_generation_config_adds_eos_ids_and_gives_the_default_sampling_params(tmp_path):
    folder = _checkpoint_with(tmp_path, json.dumps({"eos_token_id": [7, 9], "temperature": 0.3, "top_p": 0.5,
                                                    "top_k": 20, "max_new_tokens": 11, "do_sample": True,
                                                    "repetition_penalty": 1.05}))
    engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32)
    assert {7, 9} <= engine.eos_token_ids and 0 in engine.eos_token_ids  # config.json's EOS stays
    assert engine.default_sampling_params == SamplingParams(temperature=0.3, top_p=0.5, top_k=20, max_tokens=11,
                                                            repetition_penalty=1.05)
    # what the file set, apart from what it left out (a server's chat default length reads max_tokens here)
    assert engine.generation_defaults == {"temperature": 0.3, "top_p": 0.5, "top_k": 20, "max_tokens": 11,
                                          "repetition_penalty": 1.05}
    assert Engine.from_pretrained(device="cpu").generation_defaults == {"temperature": 0.8, "top_p": 0.9, "top_k": 0}
    rid = engine.add_request([1, 2, 3])
    assert engine._requests[rid][0].params == engine.default_sampling_params


@pytest.mark.parametrize("content, message", [("{not json", "not valid JSON"),
                                              ('{"eos_token_id": "x"}', "eos_token_id must be"),
                                              ('{"temperature": -1}', "SamplingParams.temperature")])
def test_a_bad_generation_config_is_refused_naming_the_file(tmp_path, content, message):
    folder = _checkpoint_with(tmp_path, content)
    with pytest.raises(ValueError, match=f"generation_config.json.*{message}"):
        Engine.from_pretrained(folder, device="cpu", dtype=torch.float32)


def test_generation_config_vllm_keeps_the_eos_ids_and_drops_the_sampling_defaults(tmp_path):
    folder = _checkpoint_with(tmp_path, json.dumps({"eos_token_id": [7, 9], "temperature": 0.3}))
    engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, generation_config="vllm")
    assert {7, 9} <= engine.eos_token_ids
    assert engine.default_sampling_params == SamplingParams() and engine.generation_defaults == {}


def test_generation_config_folder_is_read_instead_of_the_checkpoints(tmp_path):
    folder = _checkpoint_with(tmp_path, json.dumps({"eos_token_id": [7], "temperature": 0.3}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": [9], "max_new_tokens": 5}))
    engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, generation_config=other)
    assert 9 in engine.eos_token_ids and 7 not in engine.eos_token_ids
    assert engine.generation_defaults == {"max_tokens": 5}
    assert engine.default_sampling_params == SamplingParams(max_tokens=5)
    (other / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(ValueError, match=f"{other / 'generation_config.json'}: .*SamplingParams.temperature"):
        Engine.from_pretrained(folder, device="cpu", dtype=torch.float32, generation_config=other)


@pytest.mark.parametrize("value", ["greedy", "NO_FILE"])
def test_generation_config_that_is_no_value_or_folder_is_refused_before_loading(tmp_path, value, monkeypatch):
    import atom_core.models

    value = str(tmp_path) if value == "NO_FILE" else value
    monkeypatch.setattr(atom_core.models, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    for data_parallel_size in (1, 2):
        with pytest.raises(ValueError, match="expected 'auto', 'vllm' or a folder holding a generation_config.json"):
            Engine.from_pretrained(device="cpu", generation_config=value, data_parallel_size=data_parallel_size)


def test_generation_config_names_what_transformers_applies_and_the_engine_does_not(tmp_path, caplog):
    folder = _checkpoint_with(tmp_path, json.dumps({"do_sample": False, "temperature": 0.6, "no_repeat_ngram_size": 3,
                                                    "num_beams": 1, "bad_words_ids": [[5]], "min_new_tokens": None}))
    with caplog.at_level("WARNING", logger="atom_core.engine.generation_config"):
        Engine.from_pretrained(folder, device="cpu", dtype=torch.float32)
    (message,) = [r.getMessage() for r in caplog.records if r.name == "atom_core.engine.generation_config"]
    assert "do_sample=False (transformers decodes greedily; here the temperature 0.6 applies" in message
    assert "no_repeat_ngram_size=3" in message and "bad_words_ids=[[5]]" in message
    assert "num_beams" not in message and "min_new_tokens" not in message  # their "off" values


def test_a_generation_config_transformers_reads_as_ours_logs_nothing(tmp_path, caplog):
    folder = _checkpoint_with(tmp_path, json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.9,
                                                    "num_beams": 1, "eos_token_id": [7]}))
    with caplog.at_level("WARNING", logger="atom_core.engine.generation_config"):
        Engine.from_pretrained(folder, device="cpu", dtype=torch.float32)
    assert not [r for r in caplog.records if r.name == "atom_core.engine.generation_config"]


def test_only_the_models_own_eos_token_has_no_stop_reason(tmp_path, tokenizer):
    """vLLM's stop_reason: None for the tokenizer's eos_token, the id for an EOS id only generation_config.json
    names (vLLM makes those stop token ids)."""
    folder = _checkpoint_with(tmp_path, json.dumps({"eos_token_id": [7, 9]}))
    engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32)
    own = tokenizer.eos_token_id
    assert own is not None and own in engine.eos_token_ids
    reasons = {}
    for eos in (own, 9):
        request = Request(0, [5, 6], SamplingParams(max_tokens=50), seed=0)
        request.length_limit = engine.stop_rule.length_limit(request)
        request.token_ids += [11, eos]
        reasons[eos] = (engine.stop_rule.finish_reason(request), request.stop_reason)
    assert reasons == {own: ("stop", None), 9: ("stop", 9)}


def test_without_a_named_eos_token_the_model_configs_eos_ids_have_no_stop_reason():
    rule = StopRule(eos_token_ids=[3, 4], max_model_len=100)
    rule.eos_token_ids = rule.eos_token_ids | {8}  # as from_pretrained adds generation_config.json's
    reasons = []
    for eos in (3, 4, 8):
        request = Request(0, [5, 6], SamplingParams(max_tokens=50), seed=0)
        request.length_limit = rule.length_limit(request)
        request.token_ids.append(eos)
        reasons.append((rule.finish_reason(request), request.stop_reason))
    assert reasons == [("stop", None), ("stop", None), ("stop", 8)]


def test_the_tokenizers_eos_token_stops_though_config_json_names_another(tmp_path, tokenizer):
    """A chat fine-tune whose config.json still names the base model's EOS: vLLM stops on the tokenizer's
    eos_token (here the demo tokenizer's, with config.json naming token 7 only)."""
    folder = _checkpoint_with(tmp_path, json.dumps({}))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"eos_token_id": 7}))
    own = tokenizer.eos_token_id
    assert own not in (7, None)
    engine = Engine.from_pretrained(folder, device="cpu", dtype=torch.float32)
    assert engine.eos_token_ids == {7, own}
    out, = engine.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=8, logit_bias={own: 100.0}),
                           use_tqdm=False)
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([own], "stop", None)
    out, = engine.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=3, min_tokens=2,
                                                    logit_bias={own: 100.0}), use_tqdm=False)
    assert out.token_ids[-1] == own and len(out.token_ids) == 3 and own not in out.token_ids[:2]
