"""The RL routes (``--enable-rl-endpoints``, atom_core/serve/rl_routes.py) on a live server over the demo model
with sleep mode: vLLM's sleep / wake-up / prefix-cache routes and SGLang's weight-update routes drive the engine's
own methods, behind the API key, and every refusal is an error body naming the field or the engine's reason.
Off by default: the default server has none of them."""

from __future__ import annotations

import pytest

from atom_core.engine.engine import DEMO_MODEL
from tests.serve.conftest import MODEL, LiveServer, demo_engine
from tests.serve.test_server_errors import assert_error, completion, request

NO_KEY = {"X-None": "1"}  # (request() sends the key when given no headers)
OK = {"success": True, "message": ""}


@pytest.fixture(scope="module")
def rl_server():
    live = LiveServer(demo_engine(enable_sleep_mode=True), enable_rl_endpoints=True).start()
    yield live
    live.stop()


LONG_PROMPT = "Return the number of apples in the basket, " * 6  # several full KV blocks


def rl_error(status_and_body, status: int, param: str | None = "__any__") -> dict:
    """A refusal of an RL route: the server's error body, with SGLang's ``success: false`` and ``message`` beside it."""
    got, body = status_and_body
    assert got == status, body
    assert body["success"] is False and body["message"] == body["error"]["message"], body
    return assert_error((got, {"error": body["error"]}), status, param=param)


def greedy_text(server) -> str:
    status, body = request(server, "POST", "/v1/completions",
                           completion(prompt=LONG_PROMPT, max_tokens=8, temperature=0))
    assert status == 200, body
    return body["choices"][0]["text"]


def test_the_default_server_has_no_rl_route(server):
    for method, path in [("POST", "/sleep"), ("GET", "/is_sleeping"), ("POST", "/update_weights_from_disk")]:
        assert_error(request(server, method, path, {}), 404)


@pytest.mark.parametrize("method, path", [("GET", "/is_sleeping"), ("POST", "/sleep"), ("POST", "/reset_prefix_cache"),
                                          ("POST", "/update_weights_from_disk")])
def test_every_rl_route_needs_the_key(rl_server, method, path):
    assert_error(request(rl_server, method, path, {}, headers=NO_KEY), 401, code="invalid_api_key")


def test_sleep_and_wake_up_drive_the_engine_and_generation_resumes_unchanged(rl_server):
    before = greedy_text(rl_server)
    assert request(rl_server, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
    assert request(rl_server, "POST", "/sleep?level=1") == (200, {"success": True, "message": "asleep at level 1"})
    assert request(rl_server, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
    assert rl_server.submit(lambda e: e.is_sleeping)
    assert request(rl_server, "POST", "/wake_up?tags=weights&tags=kv_cache") == (200, OK)
    assert request(rl_server, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
    assert greedy_text(rl_server) == before


def test_a_request_while_asleep_is_a_503_naming_it_and_serves_after_wake_up(rl_server):
    assert request(rl_server, "POST", "/sleep?level=1")[0] == 200
    try:
        error = assert_error(request(rl_server, "POST", "/v1/completions", completion()), 503, code="engine_asleep")
        assert "asleep" in error["message"]
    finally:
        assert request(rl_server, "POST", "/wake_up") == (200, OK)
    greedy_text(rl_server)


def test_reset_prefix_cache_empties_the_cache(rl_server):
    greedy_text(rl_server)
    assert rl_server.submit(lambda e: e.block_manager.num_cached_blocks) > 0
    assert request(rl_server, "POST", "/reset_prefix_cache") == (200, OK)
    assert rl_server.submit(lambda e: e.block_manager.num_cached_blocks) == 0


@pytest.mark.parametrize("extra", [{}, {"unfinished": "keep"}, {"abort_all_requests": True, "flush_cache": True},
                                   {"load_format": None, "weight_version": "v2"}, {"load_format": "safetensors"}])
def test_update_weights_from_disk_loads_every_tensor_of_the_folder(rl_server, extra):
    before = greedy_text(rl_server)
    status, body = request(rl_server, "POST", "/update_weights_from_disk", {"model_path": str(DEMO_MODEL), **extra})
    assert status == 200 and body["success"] and body["message"].startswith("loaded "), body
    assert rl_server.submit(lambda e: e.block_manager.num_cached_blocks) == 0  # reset after the update
    assert greedy_text(rl_server) == before  # (the same weights)


@pytest.mark.parametrize("body, param", [({}, "model_path"), ({"model_path": 3}, "model_path"),
                                         ({"model_path": "/nonexistent"}, "model_path"),
                                         ({"model_path": str(DEMO_MODEL), "load_format": "pt"}, "load_format")])
def test_update_weights_from_disk_names_a_bad_field(rl_server, body, param):
    rl_error(request(rl_server, "POST", "/update_weights_from_disk", body), 400, param=param)


def test_an_unknown_unfinished_mode_is_a_400_naming_the_modes(rl_server):
    error = rl_error(request(rl_server, "POST", "/update_weights_from_disk",
                             {"model_path": str(DEMO_MODEL), "unfinished": "wait"}), 400)
    assert "'refuse', 'abort', 'keep'" in error["message"]


def test_the_group_routes_check_their_fields_and_destroy_without_a_group_is_a_no_op(rl_server):
    rl_error(request(rl_server, "POST", "/init_weights_update_group", {"master_address": "127.0.0.1"}), 400,
             param="master_port")
    rl_error(request(rl_server, "POST", "/init_weights_update_group",
                     {"master_address": "127.0.0.1", "master_port": True, "rank_offset": 1, "world_size": 2}),
             400, param="master_port")
    error = rl_error(request(rl_server, "POST", "/update_weights_from_distributed",
                             {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[2, 2]],
                              "weight_version": "v7"}), 409)
    assert "no weight-update group is open" in error["message"]
    assert request(rl_server, "POST", "/destroy_weights_update_group") == (200, OK)


def test_sleep_level_must_be_a_number_and_sleep_mode_must_be_on(rl_server, server):
    rl_error(request(rl_server, "POST", "/sleep?level=deep"), 400, param="level")
    rl_error(request(rl_server, "POST", "/sleep?level=3"), 400)
    with_routes_no_sleep = LiveServer(demo_engine(), enable_rl_endpoints=True).start()
    try:
        for method, path in [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")]:
            error = rl_error(request(with_routes_no_sleep, method, path), 501)
            assert "--enable-sleep-mode" in error["message"]
    finally:
        with_routes_no_sleep.stop()
    assert request(rl_server, "GET", "/v1/models")[1]["data"][0]["id"] == MODEL


def test_sglangs_memory_routes_sleep_and_wake_and_flush_cache_answers_200_once_reset(rl_server):
    before = greedy_text(rl_server)
    for method in ("GET", "POST"):
        assert request(rl_server, method, "/flush_cache") == (200, {"success": True, "message": "cache flushed"})
    assert request(rl_server, "POST", "/release_memory_occupation", {}) == (200, OK)
    assert rl_server.submit(lambda e: e.is_sleeping)
    assert request(rl_server, "POST", "/resume_memory_occupation", {"tags": ["weights", "cuda_graph"]}) == (200, OK)
    assert rl_server.submit(lambda e: e.is_sleeping)  # (the pool still asleep)
    assert request(rl_server, "POST", "/resume_memory_occupation", {"tags": None}) == (200, OK)
    assert not rl_server.submit(lambda e: e.is_sleeping)
    assert greedy_text(rl_server) == before


@pytest.mark.parametrize("body, status", [({"tags": ["kv_cache"]}, 501), ({"tags": ["cuda_graph"]}, 501),
                                          ({"tags": ["activations"]}, 400), ({"tags": "weights"}, 400)])
def test_releasing_part_of_the_memory_is_refused_naming_the_tags(rl_server, body, status):
    rl_error(request(rl_server, "POST", "/release_memory_occupation", body), status, param="tags")
    assert not rl_server.submit(lambda e: e.is_sleeping)
