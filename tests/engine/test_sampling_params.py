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
        ({"seed": -1}, "seed"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**kwargs)
