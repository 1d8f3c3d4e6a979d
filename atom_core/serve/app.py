"""The OpenAI-compatible HTTP server: a FastAPI app over an ``AsyncEngine``.

    app = create_app(AsyncEngine(Engine.from_pretrained()), ServerConfig(model_name="demo"))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, vLLM's
``POST /tokenize`` and ``POST /detokenize`` (these five behind ``Authorization: Bearer <api_key>`` when
the server has a key), ``GET /health``, vLLM's ``GET|POST /ping`` (SageMaker's liveness probe: /health's
answer) and ``GET /version``, ``GET /metrics`` (these four open, as vLLM leaves them); with ``enable_rl_endpoints`` the RL
routes of ``atom_core.serve.rl_routes`` (behind the key). Bodies are read up
to ``max_request_bytes`` (413 past it) and parsed here (not by FastAPI), so every refusal is an OpenAI error
body ``{"error": {"message", "type", "param", "code"}}``: 400 malformed JSON / wrong types / bad values /
too-long prompt, 401 missing or wrong key, 404 unknown model or route, 413 body too large, 503 waiting queue
full.

A client that disconnects aborts its requests (streaming or not): the response task is cancelled,
which aborts the engine requests and frees their blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager, suppress

try:
    from fastapi import FastAPI, Request
except ImportError as e:  # the base install: say which extra, not a bare ModuleNotFoundError
    raise ImportError(f'atom_core.serve.app needs the serve extra ({e.name} is not installed): '
                      f'pip install "atom_core[serve]"') from e
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from atom_core import __version__
from atom_core.engine.async_engine import AsyncEngine, EngineClosedError, EngineStepError
from atom_core.engine.distributed import DistributedEngineError
from atom_core.serve.chat import ChatJob, chat_prompt
from atom_core.serve.common import APIError, ServerConfig, ServerContext, error_body, now
from atom_core.serve.completions import CompletionJob
from atom_core.serve.metrics import CONTENT_TYPE, ServerMetrics
from atom_core.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, RequestError,
                                      TokenizeChatRequest, TokenizeCompletionRequest, parse_request)
from atom_core.serve.rl_routes import add_rl_routes

logger = logging.getLogger(__name__)


class SSEResponse(StreamingResponse):
    """Server-sent events that stop when the client goes away.

    Starlette notices a disconnect only on its next write under ASGI 2.4 servers; this watches
    ``http.disconnect`` while streaming and cancels the body at once (which aborts the request),
    and calls ``on_close`` whatever happened (also when the body never started)."""

    def __init__(self, content, on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        async def disconnected():
            while (await receive())["type"] != "http.disconnect":
                pass

        streaming = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({streaming, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watching):
                task.cancel()
            results = await asyncio.gather(streaming, watching, return_exceptions=True)
            with suppress(Exception):
                await self.body_iterator.aclose()
            self.on_close()
        error = results[0]
        if isinstance(error, Exception) and not isinstance(error, OSError):  # OSError: the client went away
            raise error


async def _until_disconnect(request: Request, work):
    """``await work``, cancelled if the client disconnects first (then None)."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watching = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watching.cancel()
        await asyncio.gather(task, watching, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _prepare_structured_output(engine) -> None:
    """With the grammar library installed, import it and build the engine's grammar compiler before serving: at
    the first structured request, the import held the interpreter lock for most of a second (0.73 s measured),
    stalling every running stream."""
    import importlib.util

    if getattr(engine, "tokenizer", None) is None or importlib.util.find_spec("xgrammar") is None:
        return
    if hasattr(type(engine), "grammar_compiler"):
        engine.grammar_compiler  # noqa: B018 - built on first access
    else:  # a data-parallel front checks constraints (its replicas compile them)
        from atom_core.engine.structured_output import import_xgrammar

        import_xgrammar()


def create_app(async_engine: AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    """The server's app. Its lifespan starts the async engine's step thread and shuts it down."""
    config = config or ServerConfig()
    served_names = list(dict.fromkeys([config.model_name, *config.model_aliases]))
    if config.max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {config.max_request_bytes}")
    metrics = ServerMetrics(async_engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(_prepare_structured_output, async_engine.engine)
        async_engine.start()
        yield
        await async_engine.shutdown()

    app = FastAPI(title="atom_core", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    # Browsers' cross-origin requests (a preflight OPTIONS is answered here, before any route or API key).
    app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                       allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                       allow_credentials=config.allow_credentials)
    ctx = ServerContext(async_engine, config, metrics)
    app.state.ctx = ctx

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return _error(APIError(e.status_code, message))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error", code="internal_error"),
                            status_code=500)

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            metrics.rejected.labels(reason="unauthorized").inc()
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def read_body(request: Request) -> bytes:
        limit = config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise APIError(400, f"bad Content-Length {declared!r}")
            if int(declared) > limit:
                raise APIError(413, f"the body has {declared} bytes; this server takes at most {limit}",
                               code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"the body exceeds this server's limit of {limit} bytes", code="request_too_large")
        return bytes(body)

    def invalid(e: RequestError) -> APIError:
        """A request the protocol refuses: counted as rejected, answered with a 400."""
        metrics.rejected.labels(reason="invalid").inc()
        return APIError(400, e.message, param=e.param, code=e.code)

    def parse(model, body: bytes):
        try:
            req = parse_request(model, body)
        except RequestError as e:
            raise invalid(e) from None
        if req.model in served_names:  # any served name is the model; responses give the first (vLLM's rule)
            req.model = config.model_name
        return req

    async def run_job(request: Request, model, job_class):
        authorize(request)
        req = parse(model, await read_body(request))
        try:
            # Off the event loop: tokenizing (and rendering a chat template) a long prompt takes seconds, during
            # which the loop would answer no other request (the tokenizer releases the interpreter lock).
            job = await asyncio.to_thread(job_class, ctx, req)
        except RequestError as e:  # (what building the sampling parameters refuses)
            raise invalid(e) from None
        except APIError as e:
            if e.status == 400:
                metrics.rejected.labels(reason="invalid").inc()
            raise
        await job.start()
        if job.req.stream:
            return SSEResponse(job.events(), on_close=job.abort)
        try:
            result = await _until_disconnect(request, job.response())
        except EngineStepError as e:
            raise APIError(500, str(e), code="engine_error") from None
        except EngineClosedError as e:
            raise APIError(503, str(e), code="shutting_down") from None
        finally:
            job.abort()
        if result is None:  # the client left: nobody reads this
            return Response(status_code=499)
        return JSONResponse(result)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run_job(request, CompletionRequest, CompletionJob)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run_job(request, ChatCompletionRequest, ChatJob)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        created = now()
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "atom_core",
                                            "max_model_len": ctx.max_model_len, "vocab_size": ctx.vocab_size}
                                           for name in served_names]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: a text (``prompt``) or a conversation (``messages``) to the token ids the completion or chat
        endpoint would run; ``count``, ``max_model_len``, ``tokens`` and, on request, ``token_strs``."""
        authorize(request)
        body = await read_body(request)
        try:
            is_chat = isinstance(data := json.loads(body), dict) and "messages" in data
        except ValueError:
            is_chat = False  # parse() names the JSON error
        req = parse(TokenizeChatRequest if is_chat else TokenizeCompletionRequest, body)
        ctx.check_model(req.model)
        tokens = await asyncio.to_thread(chat_prompt, ctx, req) if is_chat else \
            await asyncio.to_thread(ctx.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        strs = [ctx.tokenizer.backend.id_to_token(t) for t in tokens] if req.return_token_strs else None
        return {"count": len(tokens), "max_model_len": ctx.max_model_len, "tokens": tokens, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's: the text of ``tokens`` (special tokens kept, as vLLM decodes them here)."""
        authorize(request)
        req = parse(DetokenizeRequest, await read_body(request))
        ctx.check_model(req.model)
        if ctx.tokenizer is None:
            raise APIError(400, "this model has no tokenizer (tokenizer.json)", param="tokens")
        ctx.check_token_ids(req.tokens, "tokens")
        return {"prompt": ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's, for SageMaker: /health's answer
    @app.get("/health")
    async def health():
        try:
            async_engine.check_health()
        except EngineClosedError as e:
            raise APIError(503, str(e), code="engine_not_running") from None
        except DistributedEngineError as e:  # a worker rank or replica exited: no request can run any more
            raise APIError(503, str(e), code="engine_failed") from None
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    if config.enable_rl_endpoints:
        add_rl_routes(app, ctx, authorize)
    return app
