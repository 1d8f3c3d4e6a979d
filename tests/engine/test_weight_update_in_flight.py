"""Weight updates while requests are unfinished (``load_weights(..., unfinished=...)``): ``"keep"`` lets running
requests go on over their KV on the new weights and publishes none of their blocks; ``"abort"`` aborts them first;
``"refuse"`` (the default) is pinned in test_weight_update.py. A and B as there (tiny random HF models, fp32, CPU).
"""

from __future__ import annotations

import pytest

from atom_core.engine import Engine
from tests.engine.test_engine_parity import prompts_for
from tests.engine.test_weight_update import ARGS, GREEDY, _greedy, _torch_ops  # noqa: F401 (_torch_ops: autouse)

LENGTHS = (7, 13)


def _run_with_update_after(engine, prompts, steps, update):
    """Add ``prompts``, run ``steps`` steps, call ``update()``, then step to the end; the tokens of each request."""
    ids = [engine.add_request(prompt, GREEDY) for prompt in prompts]
    tokens = {i: [] for i in ids}
    for _ in range(steps):
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    update()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[i] for i in ids]


def test_keep_with_the_same_weights_changes_no_token(pair, tiny_qwen3):
    folder_a, _, hf_b = pair
    _, hf_a = tiny_qwen3
    prompts = prompts_for(hf_b.config.vocab_size, LENGTHS)
    want = _greedy(Engine.from_pretrained(folder_a, **ARGS), prompts)
    engine = Engine.from_pretrained(folder_a, **ARGS)
    got = _run_with_update_after(engine, prompts, 4,
                                 lambda: engine.load_weights(hf_a.state_dict().items(), unfinished="keep"))
    assert got == want


def test_keep_runs_on_with_the_new_weights_and_its_blocks_are_never_reused(pair):
    folder_a, folder_b, hf_b = pair
    prompts = prompts_for(hf_b.config.vocab_size, LENGTHS)
    only_a = _greedy(Engine.from_pretrained(folder_a, **ARGS), prompts)
    engine = Engine.from_pretrained(folder_a, **ARGS)
    got = _run_with_update_after(engine, prompts, 4,
                                 lambda: engine.load_weights(hf_b.state_dict().items(), unfinished="keep"))
    assert [len(t) for t in got] == [GREEDY.max_tokens] * len(prompts)
    assert [t[:3] for t in got] == [t[:3] for t in only_a]  # tokens of the steps before the update: A's
    assert got != only_a, "B must change the continuations for the test to mean anything"
    assert engine.block_manager.num_cached_blocks == 0  # the requests held through the update published nothing
    out = engine.generate([prompts[1]], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert out.token_ids == _greedy(Engine.from_pretrained(folder_b, **ARGS), [prompts[1]])[0]


def test_abort_aborts_every_unfinished_request_then_loads(pair):
    folder_a, folder_b, hf_b = pair
    prompts = prompts_for(hf_b.config.vocab_size, LENGTHS)
    engine = Engine.from_pretrained(folder_a, **ARGS)
    ids = [engine.add_request(prompt, GREEDY) for prompt in prompts]
    engine.step()
    engine.add_request(prompts[0], GREEDY)  # still waiting
    engine.load_weights(hf_b.state_dict().items(), unfinished="abort")
    assert not engine.has_unfinished_requests() and ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert _greedy(engine, prompts) == _greedy(Engine.from_pretrained(folder_b, **ARGS), prompts)


def test_an_unknown_unfinished_mode_is_refused_naming_the_modes_before_anything_loads(pair):
    folder_a, _, hf_b = pair
    engine = Engine.from_pretrained(folder_a, **ARGS)
    with pytest.raises(ValueError, match=r"unfinished must be one of \('refuse', 'abort', 'keep'\), got 'wait'"):
        engine.load_weights(iter(()), unfinished="wait")
