"""``DataParallelEngine``'s sleep mode over two replicas (CPU; real replica processes, each built with
``enable_sleep_mode=True``): level 1 and wake generates as before on both replicas; level 2, wake the weights,
``load_weights`` of B, wake the pool generates B's tokens on both; asleep, a request is refused; a replica that
cannot sleep (sleep mode off) is named and every replica stays awake. A and B as in test_weight_update_dp.py."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_weight_update_dp import DP, GREEDY, _greedy_by_replica, _served, qwen3  # noqa: F401

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")


@pytest.fixture(scope="module")
def sleepy_front(tiny_qwen3):
    """Two replicas built from A with sleep mode on."""
    with _served(tiny_qwen3[0], enable_sleep_mode=True, **DP) as engine:
        yield engine


def test_two_replicas_sleep_and_wake_at_both_levels_and_take_new_weights_while_asleep(sleepy_front, qwen3):  # noqa: F811
    prompts, state_a, state_b, want_a, want_b = qwen3
    sleepy_front.load_weights(state_a.items())
    tokens, where = _greedy_by_replica(sleepy_front, prompts)
    assert tokens == want_a and set(where) == {0, 1}

    sleepy_front.sleep(level=1)
    assert sleepy_front.is_sleeping
    with pytest.raises(RuntimeError, match="asleep"):
        sleepy_front.add_request(prompts[0], GREEDY)
    sleepy_front.wake_up()
    assert not sleepy_front.is_sleeping
    assert _greedy_by_replica(sleepy_front, prompts)[0] == want_a

    sleepy_front.sleep(level=2)
    sleepy_front.wake_up(["weights"])
    assert sleepy_front.is_sleeping  # (the pools still asleep)
    sleepy_front.load_weights(state_b.items())
    sleepy_front.wake_up(["kv_cache"])
    tokens, where = _greedy_by_replica(sleepy_front, prompts)
    assert tokens == want_b and set(where) == {0, 1}


def test_replicas_without_sleep_mode_are_named_and_stay_awake(tiny_qwen3, qwen3):  # noqa: F811
    prompts, *_, want_a, _ = qwen3
    with _served(tiny_qwen3[0], **DP) as front:
        with pytest.raises(RuntimeError, match="replica 0: RuntimeError: Engine.sleep: sleep mode is off.*; replica 1: "
                                               ".*every replica is awake again"):
            front.sleep(level=1)
        assert not front.is_sleeping
        assert _greedy_by_replica(front, prompts)[0] == want_a


def test_sleep_is_refused_for_a_bad_level_and_on_a_front_marked_dp_attention(sleepy_front):
    with pytest.raises(ValueError, match="level must be 1 or 2, got 3"):
        sleepy_front.sleep(level=3)
    sleepy_front.dp_attention, dp_attention = True, sleepy_front.dp_attention
    try:
        with pytest.raises(NotImplementedError, match="dp_attention"):
            sleepy_front.sleep(level=1)
    finally:
        sleepy_front.dp_attention = dp_attention
