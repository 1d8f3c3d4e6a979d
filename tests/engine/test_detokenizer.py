"""Incremental detokenization: streamed ``new_text`` adds up to the final text, characters split over
tokens come out whole, the first output token is decoded next to the prompt, stop strings are found
across token boundaries, and the decode work per step does not grow with the output."""

import random

import pytest
import torch

from atom_core import ops
from atom_core.engine import Engine, SamplingParams
from atom_core.engine.detokenizer import INCOMPLETE_CHARACTER, Detokenizer
from atom_core.engine.engine import DEMO_MODEL
from atom_core.engine.tokenizer import Tokenizer

MULTI_BYTE = "naïve café — 日本語 €5 😀 done"


@pytest.fixture(scope="module")
def demo_engine():
    with ops.use_backend("torch"):
        yield Engine.from_pretrained(device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def demo_tokenizer():
    return Tokenizer(DEMO_MODEL)


@pytest.fixture(scope="module")
def metaspace_tokenizer(tmp_path_factory):
    """A sentencepiece-style tokenizer (Metaspace: a word's leading space is part of its token, and the
    decoder drops the space before a sequence's first word), trained on a few lines."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    lines = ["the quick brown fox jumps over the lazy dog", "naïve café 日本語 costs €5", "hello world"] * 5
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>"]))
    folder = tmp_path_factory.mktemp("metaspace")
    tok.save(str(folder / "tokenizer.json"))
    return Tokenizer(folder)


def stream(engine, prompts, params):
    """{request id: (new_text of every step, text of every step, final output)} of add_request + step()."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    pieces = {rid: [] for rid in ids}
    texts = {rid: [] for rid in ids}
    final = {}
    with ops.use_backend("torch"):
        while engine.has_unfinished_requests():
            for out in engine.step():
                pieces[out.request_id].append(out.new_text)
                texts[out.request_id].append(out.text)
                if out.finished:
                    final[out.request_id] = out
    return [(pieces[rid], texts[rid], final[rid]) for rid in ids]


def test_streamed_pieces_add_up_to_the_final_text_for_random_demo_outputs(demo_engine, demo_tokenizer):
    rng = random.Random(0)
    prompts = ["The file", "Return the number of", "If the", "A"] * 3
    params = []
    for i in range(len(prompts)):  # high temperatures draw raw byte tokens: characters split over tokens
        stop = [rng.choice(["e ", "the", ".", "on", "\n"])] if i % 3 else None
        params.append(SamplingParams(temperature=rng.choice([1.0, 2.0, 4.0]), seed=i, max_tokens=40, stop=stop,
                                     include_stop_str_in_output=i % 4 == 1))
    results = stream(demo_engine, prompts, params)
    split_characters = stopped = 0
    for (pieces, texts, out), sp in zip(results, params):
        assert "".join(pieces) == out.text
        assert [texts[k] == "".join(pieces[:k + 1]) for k in range(len(pieces))] == [True] * len(pieces)
        decoded = demo_tokenizer.decode(out.token_ids)
        split_characters += "" in pieces[:-1] and INCOMPLETE_CHARACTER not in decoded
        if out.finish_reason == "length":
            assert out.text == decoded.rstrip(INCOMPLETE_CHARACTER)  # a byte-level tokenizer needs no context
        elif out.stop_reason is not None:
            stopped += 1
            stop = out.stop_reason
            cut = decoded.find(stop) + (len(stop) if sp.include_stop_str_in_output else 0)
            assert out.text == decoded[:cut] and decoded.find(stop) >= 0
            # while running, no piece showed the part of a stop string that is then cut
            assert all(stop not in t for t in texts[:-1]) or sp.include_stop_str_in_output
    assert split_characters and stopped >= 3  # the cases at hand were met


def test_characters_split_over_tokens_come_out_whole(demo_tokenizer):
    ids = demo_tokenizer.encode(MULTI_BYTE, add_special_tokens=False)
    detokenizer = Detokenizer(demo_tokenizer, demo_tokenizer.encode("Price:"))
    pieces = [detokenizer.add(token) for token in ids]
    assert "".join(pieces) == MULTI_BYTE
    assert pieces.count("") >= 5 and not any(INCOMPLETE_CHARACTER in p for p in pieces)
    assert pieces[pieces.index("日") - 2:pieces.index("日")] == ["", ""]  # three byte tokens, one character
    # an output that ends inside a character: the final text stops before it
    before_euro = MULTI_BYTE[:MULTI_BYTE.index("€")]
    cut = next(k for k in range(len(ids)) if demo_tokenizer.decode(ids[:k]) == before_euro + INCOMPLETE_CHARACTER)
    detokenizer = Detokenizer(demo_tokenizer, [0])
    detokenizer.decode_until(ids, cut)
    assert detokenizer.text(detokenizer.num_chars) == before_euro


class BytesTokenizer:
    """Tokens that are byte strings; a sequence decodes as its bytes joined (invalid UTF-8 as U+FFFD), less one
    leading space (a sentencepiece decoder's rule), so a token's text may depend on what precedes it."""

    def __init__(self, *tokens: bytes):
        self.tokens = tokens

    def decode(self, token_ids, skip_special_tokens=True):
        return b"".join(self.tokens[i] for i in token_ids).decode("utf-8", errors="replace").removeprefix(" ")


def test_a_character_the_prompt_starts_belongs_to_the_output_that_completes_it():
    """Every prompt suffix decodes with U+FFFD (the prompt ends inside 語): the first window is the longest suffix,
    and the output's text starts with the character it completes, with no U+FFFD."""
    tok = BytesTokenizer(b"Say", b" \xe6\x97\xa5\xe6\x9c\xac", b"\xe8", b"\xaa\x9e", b" now")
    detokenizer = Detokenizer(tok, [0, 1, 2])
    assert tok.decode([0, 1, 2]) == "Say 日本" + INCOMPLETE_CHARACTER
    assert [detokenizer.add(t) for t in (3, 4)] == ["語", " now"]


def test_a_literal_replacement_character_ending_the_prompt_keeps_the_first_tokens_leading_space():
    tok = BytesTokenizer(b"Replace", b" \xef\xbf\xbd", b" hello", b" world")  # U+FFFD itself, whole
    detokenizer = Detokenizer(tok, [0, 1])
    assert "".join(detokenizer.add(t) for t in (2, 3)) == " hello world"


def test_a_token_with_whole_characters_and_the_first_byte_of_another_gives_the_whole_ones_at_once():
    tok = BytesTokenizer(b"Say", b" \xe6\x97\xa5\xe6\x9c\xac\xe8", b"\xaa\x9e")  # " 日本" + 語's first byte
    detokenizer = Detokenizer(tok, [0])
    assert detokenizer.add(1) == " 日本"
    assert detokenizer.text(detokenizer.num_chars) == " 日本"  # an output cut here ends with them
    assert detokenizer.add(2) == "語"


def test_the_first_output_token_is_decoded_next_to_the_prompt(metaspace_tokenizer):
    tok = metaspace_tokenizer
    full = tok.encode("the quick brown fox")
    prompt_len = len(tok.encode("the quick"))
    prompt, output = full[:prompt_len], full[prompt_len:]
    assert tok.decode(output) == "brown fox"  # decoded alone, the leading space is dropped
    detokenizer = Detokenizer(tok, prompt)
    pieces = [detokenizer.add(t) for t in output]
    assert "".join(pieces) == " brown fox" == tok.decode(full)[len(tok.decode(prompt)):]
    text = "naïve café 日本語 costs €5"  # whole characters in this vocabulary
    detokenizer = Detokenizer(tok, tok.encode("hello"))
    assert "".join(detokenizer.add(t) for t in tok.encode(text)) == " " + text


def test_skip_special_tokens(demo_tokenizer):
    ids = demo_tokenizer.encode("one", add_special_tokens=False) + [0] + demo_tokenizer.encode(" two",
                                                                                          add_special_tokens=False)
    for skip, want in ((True, "one two"), (False, "one<|endoftext|> two")):
        detokenizer = Detokenizer(demo_tokenizer, [5], skip_special_tokens=skip)
        assert "".join(detokenizer.add(t) for t in ids) == want


def boundary_stop(tokenizer, output):
    """A stop string of the last 2 characters of one token's text and the first 2 of the next."""
    for i in range(len(output) - 1):
        a, b = tokenizer.decode(output[i:i + 1]), tokenizer.decode(output[i + 1:i + 2])
        if len(a.strip()) >= 2 and len(b.strip()) >= 2:
            return a[-2:] + b[:2], i + 2
    raise AssertionError("no two neighbouring tokens with text")


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_a_token_boundary_ends_the_text(demo_engine, demo_tokenizer, include):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with ops.use_backend("torch"):
        reference = demo_engine.generate("The file", greedy, use_tqdm=False)[0]
    stop, tokens_needed = boundary_stop(demo_tokenizer, reference.token_ids[3:])
    decoded = demo_tokenizer.decode(reference.token_ids)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=["never seen", stop],
                            include_stop_str_in_output=include)
    (pieces, texts, out), = stream(demo_engine, ["The file"], [params])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == decoded[:decoded.find(stop) + (len(stop) if include else 0)] == "".join(pieces)
    assert len(out.token_ids) <= 3 + tokens_needed  # it stopped at the token that completed the string


def test_the_decode_work_per_step_does_not_grow_with_the_output(demo_engine, monkeypatch):
    tokenizer = demo_engine.tokenizer
    calls = []
    decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **kw: calls.append(len(ids)) or decode(ids, **kw))
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=300, ignore_eos=True, stop=["<never>"])
    rid = demo_engine.add_request("The file", params)
    per_step = []  # decode calls of each step that gave the request a token
    with ops.use_backend("torch"):
        while demo_engine.has_unfinished_requests():
            before = len(calls)
            outs = demo_engine.step()
            for out in outs:
                assert out.request_id == rid
                out.new_text
            if len(outs):
                per_step.append(calls[before:])
    assert len(per_step) == 300 and out.num_output_tokens == 300
    decoded_per_step = [sum(step) for step in per_step[1:]]  # after the first: the prompt's context is primed
    # A few tokens per step however long the output (the whole output would be up to 300).
    assert max(decoded_per_step) <= 24 and max(len(step) for step in per_step[1:]) <= 2
    assert max(decoded_per_step[-100:]) <= max(decoded_per_step[:100]) + 8


@pytest.mark.parametrize("slow_file", ["vocab.json", "tokenizer.model"])
def test_a_folder_with_only_a_slow_tokenizers_files_loads_none_and_says_why(tmp_path, slow_file, caplog):
    (tmp_path / slow_file).write_text("{}")
    with caplog.at_level("WARNING", logger="atom_core.engine.tokenizer"):
        assert Tokenizer.maybe_from(tmp_path) is None
    (message,) = [r.getMessage() for r in caplog.records]
    assert f"has {slow_file} but no tokenizer.json" in message and "save_pretrained(folder)" in message


def test_a_folder_without_tokenizer_files_loads_none_silently(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="atom_core.engine.tokenizer"):
        assert Tokenizer.maybe_from(tmp_path) is None
    assert not caplog.records


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_a_text_past_the_gil_free_length_encodes_to_the_ids_of_the_plain_encode(demo_tokenizer, add_special_tokens):
    """Texts longer than GIL_FREE_CHARS go through the tokenizers library's encode_batch (which lets other
    threads run); the ids must be those of its encode, at the boundary and past it."""
    from atom_core.engine.tokenizer import GIL_FREE_CHARS

    rng = random.Random(3)
    words = ["hello", " world", ",", " the", " number", " of", "\n", " 42", " émigré", " 🙂", "  "]
    text = "".join(rng.choice(words) for _ in range(GIL_FREE_CHARS))
    for cut in (GIL_FREE_CHARS, GIL_FREE_CHARS + 1, len(text)):
        expected = demo_tokenizer._tok.encode(text[:cut], add_special_tokens=add_special_tokens).ids
        assert demo_tokenizer.encode(text[:cut], add_special_tokens=add_special_tokens) == expected
