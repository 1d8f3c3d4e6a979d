import pytest

from atom_core.engine import SamplingParams


def test_defaults_and_greedy():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.max_tokens) == (1.0, -1, 1.0, 0.0, 16)
    assert not p.greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(stop="\n").stop_strings == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop_strings == ("a", "b")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": -2}, "seed"),
        ({"logprobs": -2}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**kwargs)


def test_seed_minus_one_is_no_seed_and_max_tokens_none_is_kept_for_the_engine():
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-1) == SamplingParams()
    p = SamplingParams(max_tokens=None, min_tokens=5)
    assert p.max_tokens is None and p.min_tokens == 5


def test_vllm_fields_defaults_and_normalised_values():
    p = SamplingParams()
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens) == (1, 0.0, 0.0, 1.0, 0)
    assert p.logit_bias is p.allowed_token_ids is p.bad_words is p.prompt_logprobs is None
    assert p.skip_special_tokens and not p.include_stop_str_in_output
    assert not p.uses_penalties and not p.uses_token_bias
    q = SamplingParams(logit_bias={"5": 1, 7: -2.5}, allowed_token_ids=(3, 4), bad_words=["x", (1, 2)], min_tokens=2)
    assert q.logit_bias == {5: 1.0, 7: -2.5}  # JSON keys (strings) are token ids too
    assert q.allowed_token_ids == [3, 4] and q.bad_words == ["x", [1, 2]]
    assert q.uses_penalties and q.uses_token_bias  # the allow-list lives in the penalty state
    assert SamplingParams(repetition_penalty=1.1).uses_penalties and not SamplingParams(min_tokens=0).uses_token_bias


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"), ({"n": 2.0}, "n"), ({"n": True}, "n"), ({"n": 2, "temperature": 0}, "n"),
        ({"n": 3, "temperature": 1e-6}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"), ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"), ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": [1, 2]}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"), ({"logit_bias": {"a": 1.0}}, "logit_bias"),
        ({"logit_bias": {True: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: 1e39}}, "logit_bias"), ({"logit_bias": {1: -1e300}}, "logit_bias"),  # inf in float32
        ({"logit_bias": {"\u00b2": 1.0}}, "logit_bias"), ({"logit_bias": {"\u0663": 1.0}}, "logit_bias"),  # not ASCII
        ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [1, -1]}, "allowed_token_ids"),
        ({"allowed_token_ids": 3}, "allowed_token_ids"),
        ({"bad_words": "word"}, "bad_words"), ({"bad_words": [" "]}, "bad_words"), ({"bad_words": [[]]}, "bad_words"),
        ({"bad_words": [[1, -2]]}, "bad_words"), ({"bad_words": [3]}, "bad_words"),
        ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"), ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"detokenize": 0}, "detokenize"), ({"spaces_between_special_tokens": None}, "spaces_between_special_tokens"),
        ({"detokenize": False, "stop": "x"}, "stop"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"), ({"truncate_prompt_tokens": -2},
                                                                    "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
        ({"guided_decoding": {"regex": "a+"}, "structured_outputs": {"regex": "b+"}}, "guided_decoding"),
    ],
)
def test_invalid_vllm_fields_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**kwargs)


def test_a_top_p_that_float32_rounds_to_zero_is_refused():
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p=.*float32's smallest"):
        SamplingParams(top_p=6e-144)  # the sampling op takes float32: it would be 0 there
    assert SamplingParams(top_p=1e-40).top_p == 1e-40  # a float32 subnormal: still > 0


def test_guided_decoding_is_read_into_structured_outputs_and_replace_keeps_working():
    import dataclasses

    from atom_core.engine.sampling_params import GuidedDecodingParams

    p = SamplingParams(guided_decoding=GuidedDecodingParams(regex="a+"))
    assert p.structured_outputs == GuidedDecodingParams(regex="a+") and p.guided_decoding is None
    assert p == SamplingParams(structured_outputs={"regex": "a+"})
    assert dataclasses.replace(p, structured_outputs={"choice": ["x"]}).structured_outputs.choice == ["x"]
