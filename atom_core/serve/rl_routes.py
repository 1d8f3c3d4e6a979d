"""The server's routes for RL loops (``atom-core serve --enable-rl-endpoints``), behind the API key like the
OpenAI routes. They run the engine's own methods on its step thread (between two steps), with the names and
bodies the RL frameworks already send:

- vLLM's (its development-mode routes): ``POST /reset_prefix_cache``, ``POST /sleep?level=1``,
  ``POST /wake_up`` (``?tags=weights&tags=kv_cache``, none: both), ``GET /is_sleeping``;
- SGLang's: ``GET|POST /flush_cache``, ``POST /release_memory_occupation`` / ``/resume_memory_occupation``
  (``{"tags"?}``: sleep at level 1 and wake up), ``POST /update_weights_from_disk`` ``{"model_path"}`` (every ``*.safetensors`` tensor of the
  folder, Hugging Face names, read one at a time), ``POST /init_weights_update_group`` ``{"master_address",
  "master_port", "rank_offset", "world_size", "group_name"?, "backend"?}``, ``POST
  /update_weights_from_distributed`` ``{"names", "dtypes", "shapes"}``, ``POST /destroy_weights_update_group``.
  The two updates also take ``"unfinished"`` (``Engine.load_weights``: ``"refuse"``, ``"abort"``, ``"keep"``)
  or SGLang's ``"abort_all_requests": true`` (= ``"abort"``).

Answers: ``{"success": true, "message": ...}`` (SGLang's shape; ``/is_sleeping`` ``{"is_sleeping"}``,
``/reset_prefix_cache`` ``{"success": false}`` while requests hold KV blocks). Refusals are the server's
error bodies: 400 for a bad body or value, 409 for what the engine's state refuses (unfinished requests, asleep,
no group open), 501 for what the engine does not do (a method it lacks, sleep mode not enabled).

``/update_weights_from_distributed`` holds the step thread until the trainer's broadcasts arrive (the trainer
broadcasts after sending the request, as with SGLang); no request steps meanwhile.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request

from atom_core.engine.sleep_mode import WAKE_TAGS
from atom_core.serve.common import APIError, ServerContext

# What an update route takes beside its own fields. SGLang's ``flush_cache`` and ``group_name`` are accepted: the
# prefix cache is reset after every update, and an engine has one group.
UPDATE_OPTIONS = {"unfinished": str, "abort_all_requests": bool, "flush_cache": bool, "group_name": str,
                  "weight_version": (str, type(None)), "load_format": (str, type(None))}
LOAD_FORMATS = (None, "auto", "safetensors")  # /update_weights_from_disk reads *.safetensors files


class RLError(APIError):
    """A refusal of these routes: the server's error body, with SGLang's ``success`` and ``message`` beside it (its
    clients read ``result["success"]``)."""

    def body(self) -> dict:
        return {"success": False, "message": self.message, **super().body()}


def checkpoint_tensors(folder: Path) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of every ``*.safetensors`` file of ``folder``, one tensor at a time, in file order."""
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def _memory_tags(tags: list | None) -> set[str]:
    """SGLang's memory tags as ``wake_up``'s: None = all; "cuda_graph" dropped (the graphs go with the other two and
    are captured again once both are awake); 400 for another."""
    if tags is None:
        return set(WAKE_TAGS)
    unknown = [tag for tag in tags if tag not in (*WAKE_TAGS, "cuda_graph")]
    if unknown:
        raise RLError(400, f"tags must name 'weights', 'kv_cache' or 'cuda_graph', got {unknown!r}", param="tags")
    return {tag for tag in tags if tag != "cuda_graph"}


def _loaded(report) -> int:
    """Parameters loaded by one engine's ``LoadReport`` (a ``DataParallelEngine``'s list: each replica's, the same)."""
    return len((report[0] if isinstance(report, list) else report).loaded)


def _unfinished(body: dict) -> str:
    """``Engine.load_weights``' ``unfinished`` from ``unfinished`` or SGLang's ``abort_all_requests``."""
    return body.get("unfinished", "abort" if body.get("abort_all_requests") else "refuse")


def _fields(body: dict, required: dict[str, type], optional: dict[str, type]) -> dict:
    """The body's fields, each of its type (400 naming a missing, unknown or mistyped one)."""
    known = {**required, **optional}
    for name in body:
        if name not in known:
            raise RLError(400, f"unknown field {name!r}; this route takes {sorted(known)}", param=name)
    for name, kind in known.items():
        if name not in body:
            if name in required:
                raise RLError(400, f"missing field {name!r}", param=name)
        elif not isinstance(body[name], kind) or (kind is int and isinstance(body[name], bool)):
            expected = " or ".join("null" if k is type(None) else k.__name__ for k in
                                   (kind if isinstance(kind, tuple) else (kind,)))
            raise RLError(400, f"{name} must be {expected}, got {type(body[name]).__name__}", param=name)
    return body


def add_rl_routes(app: FastAPI, ctx: ServerContext, authorize: Callable[[Request], None]) -> None:
    """Register the routes of the module docstring on ``app``."""
    async_engine = ctx.async_engine

    async def call(name: str, *args, **kwargs):
        """``engine.<name>(*args, **kwargs)`` (a property: its value) on the step thread; the engine's refusals as
        the server's errors."""
        if not hasattr(type(async_engine.engine), name):
            raise RLError(501, f"this server's engine ({type(async_engine.engine).__name__}: replicas in processes of "
                               f"their own) has no {name}; serve one engine in the server's process "
                               f"(--data-parallel-size 1, --no-engine-process)", code="not_implemented")

        def run(engine):
            attribute = getattr(engine, name)
            return attribute(*args, **kwargs) if callable(attribute) else attribute

        try:
            return await async_engine.run_on_engine(run)
        except NotImplementedError as e:
            raise RLError(501, str(e), code="not_implemented") from None
        except (ValueError, TypeError) as e:
            raise RLError(400, str(e)) from None
        except RuntimeError as e:
            raise RLError(409, str(e), code="conflict") from None

    def check_sleep_mode() -> None:
        if getattr(async_engine.engine, "enable_sleep_mode", True) is False:
            raise RLError(501, "this server's engine was started without sleep mode (--enable-sleep-mode)",
                          code="not_implemented")

    async def json_body(request: Request) -> dict:
        authorize(request)
        raw = await request.body()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except ValueError as e:
            raise RLError(400, f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise RLError(400, f"the body must be a JSON object, got {type(body).__name__}")
        return body

    def done(message: str = "") -> dict:
        return {"success": True, "message": message}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        authorize(request)
        reset = await call("reset_prefix_cache")
        return {"success": bool(reset), "message": "" if reset else "requests hold KV blocks: nothing was reset"}

    @app.post("/sleep")
    async def sleep(request: Request):
        authorize(request)
        check_sleep_mode()
        level = request.query_params.get("level", "1")
        if not level.isdigit():
            raise RLError(400, f"level must be 1 or 2, got {level!r}", param="level")
        await call("sleep", int(level))
        return done(f"asleep at level {level}")

    @app.post("/wake_up")
    async def wake_up(request: Request):
        authorize(request)
        check_sleep_mode()
        tags = request.query_params.getlist("tags") or None
        await call("wake_up", tags)
        return done()

    @app.get("/is_sleeping")
    async def is_sleeping(request: Request):
        authorize(request)
        check_sleep_mode()
        return {"is_sleeping": bool(await call("is_sleeping"))}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request):
        """SGLang's: 200 once reset; 409 while requests hold KV blocks (its clients retry until a 200)."""
        authorize(request)
        if not await call("reset_prefix_cache"):
            raise RLError(409, "requests hold KV blocks: nothing was reset", code="conflict")
        return done("cache flushed")

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request):
        """SGLang's: everything at once (``sleep(1)``: the weights kept on the host); ``tags`` naming only some of
        "weights" / "kv_cache" / "cuda_graph" is not built (501)."""
        body = _fields(await json_body(request), {}, {"tags": (list, type(None))})
        check_sleep_mode()
        tags = _memory_tags(body.get("tags"))
        if tags != set(WAKE_TAGS):
            raise RLError(501, f"releasing only {sorted(tags)} is not built: sleep frees the weights and the KV "
                               "cache together (tags null or all of them)", param="tags", code="not_implemented")
        await call("sleep", 1)
        return done()

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request):
        """SGLang's: ``wake_up`` of each of ``tags`` still asleep (null: all; "cuda_graph" is captured again once
        both are awake), the weights first."""
        body = _fields(await json_body(request), {}, {"tags": (list, type(None))})
        check_sleep_mode()
        tags = _memory_tags(body.get("tags"))
        for tag in (tag for tag in WAKE_TAGS if tag in tags):  # (a tag already awake: wake_up does nothing)
            await call("wake_up", [tag])
        return done()

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await json_body(request)
        folder = Path(_fields(body, {"model_path": str}, UPDATE_OPTIONS)["model_path"])
        if not folder.is_dir() or not any(folder.glob("*.safetensors")):
            raise RLError(400, f"model_path {str(folder)!r} is not a folder holding *.safetensors files",
                          param="model_path")
        mode = _unfinished(body)
        if mode != "refuse" and "unfinished" not in inspect.signature(async_engine.engine.load_weights).parameters:
            raise RLError(501, f"this server's engine ({type(async_engine.engine).__name__}) refuses updates while "
                               "requests are unfinished; serve one engine in the server's process "
                               "(--data-parallel-size 1, --no-engine-process) for 'abort' or 'keep'",
                          param="unfinished", code="not_implemented")
        if body.get("load_format") not in LOAD_FORMATS:
            raise RLError(400, f"load_format must be one of {LOAD_FORMATS}, got {body['load_format']!r}",
                          param="load_format")
        report = await call("load_weights", checkpoint_tensors(folder), **({} if mode == "refuse" else
                                                                           {"unfinished": mode}))
        return done(f"loaded {_loaded(report)} tensors from {folder}")

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body = await json_body(request)
        args = dict(_fields(body, {"master_address": str, "master_port": int, "rank_offset": int, "world_size": int},
                            {"backend": str, "group_name": str}))
        await call("init_weight_update_group", args.pop("master_address"), args.pop("master_port"),
                   args.pop("rank_offset"), args.pop("world_size"), **args)
        return done()

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body = await json_body(request)
        args = _fields(body, {"names": list, "dtypes": list, "shapes": list}, UPDATE_OPTIONS)
        report = await call("update_weights_from_distributed", args["names"], args["dtypes"], args["shapes"],
                            unfinished=_unfinished(body))
        return done(f"loaded {_loaded(report)} tensors")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        _fields(await json_body(request), {}, {"group_name": str})
        await call("destroy_weight_update_group")
        return done()
