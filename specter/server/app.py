"""The OpenAI-compatible routes over one `Engine`: models, completions, chat completions, health, metrics.

A request flows: the gate (API key) -> read the body (JSON only, at most `max_body_bytes`) -> validate it (pydantic)
-> check the model name -> encode the prompt (chat template for messages; text on the encoder thread, so a long
prompt never holds the event loop and the streams it serves) -> check it fits the context -> take a place in the
queue (or 429) -> wait for the engine's turn -> stream pieces as server-sent events, or gather them into one answer. A client that hangs up
cancels its request wherever it is (queued or mid-round).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from specter.api import Engine, FinishReason, Piece, Prompt
from specter.config import GenerationConfig
from specter.tokenizer import GIL_FREE_CHARS
from specter.errors import ConfigError, PluginError, PromptError, RequestCancelled, SpecterError
from specter.log import debug_enabled, get_logger
from specter.server.admission import AdmissionQueue, QueueFull, Ticket
from specter.server.asgi import ClientGone, EventStream, Gate, NoResponse, sse, unless_hangup
from specter.server.metrics import CONTENT_TYPE, ServerMetrics
from specter.server.protocol import (
    Answer,
    APIRequestError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    as_json,
)

log = get_logger(__name__)

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
"""The largest request body read (`specter serve --max-body-bytes`): a context of 128k tokens as text or as token ids
is about 1 MB, so 8 MiB refuses only bodies no prompt needs, before they cost memory or tokenizer time."""


@dataclass
class ServerState:
    """Everything the routes share: the one engine, its queue, the metrics and the names it answers to."""

    engine: Engine
    model_name: str
    queue: AdmissionQueue
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    # Text prompts are encoded in arrival order on two threads, one for long texts and one for the others, so that a
    # short prompt never waits behind a megabyte's seconds of tokenizing (which the context check may then refuse); a
    # pool would grow a thread per concurrent request. `encoding` counts the prompts both hold, bounded as the queue is.
    encoder: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="specter-encode"))
    long_encoder: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="specter-encode-long"))
    encoding: int = 0
    started: int = field(default_factory=lambda: int(time.time()))

    def close(self) -> None:
        """Drop the prompts still waiting for the encoders (their requests are gone with the server)."""
        self.encoder.shutdown(wait=False, cancel_futures=True)
        self.long_encoder.shutdown(wait=False, cancel_futures=True)

    @property
    def max_context(self) -> int:
        """Prompt plus generation must fit both the engine's KV cache and the model's positions."""
        return min(self.engine.config.max_context, self.engine.spec.max_position)


@dataclass
class Job:
    """One admitted request: its prompt ids, decoding settings and place in the queue."""

    prompt_ids: list[int]
    generation: GenerationConfig
    ticket: Ticket
    arrived: float
    continuation: bool = True  # the text continues the prompt's (completions); False: a chat answer, decoded alone


def create_app(engine: Engine, *, model_name: str, max_queue: int = 64, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Gate:
    """The ASGI application serving `engine` as `model_name` (uvicorn runs it; tests may too)."""
    state = ServerState(engine, model_name, AdmissionQueue(max_queue), max_body_bytes)
    routes = [
        Route("/v1/models", _handler(state, list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", _handler(state, retrieve_model), methods=["GET"]),
        Route("/v1/completions", _handler(state, completions), methods=["POST"]),
        Route("/v1/chat/completions", _handler(state, chat_completions), methods=["POST"]),
        Route("/health", _handler(state, health), methods=["GET"]),
        Route("/metrics", _handler(state, metrics), methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    app.state.server = state
    return Gate(app, state.metrics, api_key, on_close=state.close)


async def _internal_error(request: Request, exc: Exception) -> Response:
    """An unexpected error in OpenAI's error shape, not Starlette's plain-text page (Starlette raises it on after this
    answer, and the gate logs it with its traceback)."""
    error = APIRequestError(500, "internal server error; the server logged the cause", type="server_error")
    return JSONResponse(error.body(), status_code=500)


def _handler(state: ServerState, route: Any) -> Any:
    async def endpoint(request: Request) -> Response | EventStream | NoResponse:
        try:
            return await route(state, request)
        except APIRequestError as error:
            return JSONResponse(error.body(), status_code=error.status, headers=error.headers)
        except ClientDisconnect:  # hung up while its body was being read: no one to answer, nothing went wrong
            log.debug("server.client_gone", path=request.url.path)
            return NoResponse()
    endpoint.__name__ = route.__name__
    return endpoint


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (unknown path, wrong method) in OpenAI's error shape."""
    assert isinstance(exc, HTTPException), "registered for HTTPException only"
    error = APIRequestError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                            code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


# ---- routes -------------------------------------------------------------------------------------------
async def list_models(state: ServerState, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def retrieve_model(state: ServerState, request: Request) -> Response:
    name = request.path_params["model"]
    if name != state.model_name:
        raise _unknown_model(state, name)
    return JSONResponse(_model_card(state))


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.started, "owned_by": "specter",
            "max_model_len": state.max_context}


async def health(state: ServerState, request: Request) -> Response:
    return JSONResponse({"status": "ok", "model": state.model_name, **live_values(state)})


async def metrics(state: ServerState, request: Request) -> Response:
    live = live_values(state)
    gauges = {
        "specter_queue_depth": ("Requests waiting for the engine.", live["queue_depth"]),
        "specter_requests_running": ("Requests holding the engine.", live["running"]),
        "specter_event_loop_tasks": ("Tasks alive on the server's event loop.", live["tasks"]),
        "specter_expert_slots_held": ("Expert cache slots protected or pinned (0 between requests).", live["held_slots"]),
    }
    return Response(state.metrics.render(gauges), media_type=CONTENT_TYPE)


async def completions(state: ServerState, request: Request) -> Response | EventStream | NoResponse:
    body = await _parse(state, request, CompletionRequest)
    _check_model(state, body)
    prompt_ids = await _encode(state, body.single_prompt(), "prompt")
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_TOKENS
    how = "" if body.max_tokens is not None else " (OpenAI's default for completions: none was given)"
    return await _serve(state, request, body, prompt_ids, max_tokens, ("prompt", "max_tokens", how),
                        Answer(False, state.model_name, _id("cmpl")))


async def chat_completions(state: ServerState, request: Request) -> Response | EventStream | NoResponse:
    body = await _parse(state, request, ChatCompletionRequest)
    _check_model(state, body)
    prompt_ids = await _encode(state, [message.as_template_message() for message in body.messages], "messages")
    limit = body.token_limit()
    max_tokens = limit if limit is not None else max(1, state.max_context - len(prompt_ids))  # OpenAI: up to the context
    answer = Answer(True, state.model_name, _id("chatcmpl"))
    return await _serve(state, request, body, prompt_ids, max_tokens, ("messages", body.token_limit_param()), answer)


# ---- a request, from checked body to answer ----------------------------------------------------------
async def _serve(state: ServerState, request: Request, body: SamplingRequest, prompt_ids: list[int], max_tokens: int,
                 params: tuple[str, ...], answer: Answer) -> Response | EventStream | NoResponse:
    """`params`: the request's names for its prompt and its token limit (and how the limit was set, when the client
    did not), for errors about them."""
    arrived = time.monotonic()
    _check_context(state, len(prompt_ids), max_tokens, *params)
    generation = _generation(body, max_tokens)
    job = Job(prompt_ids, generation, _admit(state), arrived, continuation=not answer.chat)
    if body.stream:
        return EventStream(_events(state, job, answer, body.include_usage()), job.ticket)
    try:
        text, reason, new_tokens = await unless_hangup(_collect(state, job), request.receive)
    except ClientGone:
        log.debug("server.client_gone", path=request.url.path)
        return NoResponse()
    except SpecterError as error:  # e.g. the engine closed under a request past the drain timeout; as streamed
        log.warning("server.request_ended", error=str(error), exc_info=debug_enabled())  # its cause: a plug-in's
        raise _ended(state, error) from None
    finally:
        job.ticket.close()
    return JSONResponse(answer.whole(text, reason, len(prompt_ids), new_tokens))


async def _pieces(state: ServerState, job: Job) -> AsyncIterator[Piece]:
    """The request's pieces, once it has the engine; what it did goes into the metrics however it ends."""
    reason: str = "cancelled"  # unless it finishes or fails: a hang-up, or shutdown after the drain timeout
    stats = None
    try:
        async with job.ticket:
            state.metrics.queue_wait.observe(time.monotonic() - job.arrived)
            async with state.engine.generate(job.prompt_ids, job.generation, continuation=job.continuation) as stream:
                stats = stream.stats
                first = True
                async for piece in stream:
                    if first and piece.token_ids:
                        state.metrics.ttft.observe(time.monotonic() - job.arrived)
                        first = False
                    yield piece
                reason = stream.finish_reason or "error"
    except Exception:
        reason = "error"
        raise
    finally:
        state.metrics.request_done(stats, reason)


async def _collect(state: ServerState, job: Job) -> tuple[str, FinishReason, int]:
    texts: list[str] = []
    new_tokens = 0
    reason: FinishReason = "length"
    async with contextlib.aclosing(_pieces(state, job)) as pieces:
        async for piece in pieces:
            texts.append(piece.text)
            new_tokens += len(piece.token_ids)
            reason = piece.finish_reason or reason
    return "".join(texts), reason, new_tokens


async def _events(state: ServerState, job: Job, answer: Answer, include_usage: bool) -> AsyncIterator[bytes]:
    """Server-sent events: a chunk per piece with text, the last with finish_reason, usage if asked, [DONE]."""
    new_tokens = 0
    if answer.chat:  # OpenAI opens a chat stream with the assistant's role
        yield sse(answer.chunk(None, first=True, with_usage=include_usage))
    try:
        async with contextlib.aclosing(_pieces(state, job)) as pieces:
            async for piece in pieces:
                new_tokens += len(piece.token_ids)
                if piece.text or piece.finished:
                    yield sse(answer.chunk(piece.text, piece.finish_reason, with_usage=include_usage))
    except SpecterError as error:  # e.g. the engine closed under a request past the drain timeout
        log.warning("server.stream_ended", error=str(error), exc_info=debug_enabled())
        yield sse(_ended(state, error).body())
        return
    except Exception:
        log.exception("server.stream_failed")
        yield sse(APIRequestError(500, "internal server error; the server logged the cause", type="server_error").body())
        return
    if include_usage:
        yield sse(answer.usage_chunk(len(job.prompt_ids), new_tokens))
    yield sse("[DONE]")


# ---- checks -------------------------------------------------------------------------------------------
async def _parse(state: ServerState, request: Request, model: type[BaseModel]) -> Any:
    raw = await _read_body(state, request)
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        raise _validation_error(error) from None


def _validation_error(error: ValidationError) -> APIRequestError:
    """The first problem, named by its field (OpenAI's `param`), with pydantic's reason and the value given, as the
    client wrote it (JSON: true, null, "abc"; not Python's True, None, 'abc')."""
    item = error.errors(include_url=False)[0]
    if item["type"] == "json_invalid":
        return APIRequestError(400, f"the body is not valid JSON: {item.get('ctx', {}).get('error', item['msg'])}",
                               code="invalid_json")
    if item["type"] in ("model_type", "model_attributes_type") and not item["loc"]:
        return APIRequestError(400, "the body must be a JSON object", code="invalid_json")
    where = ".".join(str(part) for part in item["loc"])
    param = str(item["loc"][0]) if item["loc"] else None  # OpenAI names the top-level field
    if item["type"] == "missing":
        return APIRequestError(400, f"'{where}' is required", param=param, code="missing_required_parameter")
    if item["type"] in ("model_type", "model_attributes_type"):  # pydantic's message would name our class
        return APIRequestError(400, f"'{where}' must be a JSON object (got {as_json(item.get('input'), 80)})",
                               param=param, code="invalid_value")
    return APIRequestError(400, f"'{where}': {item['msg']} (got {as_json(item.get('input'), 80)})", param=param,
                           code="invalid_value")


def _check_model(state: ServerState, body: SamplingRequest) -> None:
    if body.model != state.model_name:
        raise _unknown_model(state, body.model)


def _unknown_model(state: ServerState, name: str) -> APIRequestError:
    """A model name the server does not serve (in a body or a /v1/models path), named beside the one it does."""
    return APIRequestError(404, f"the model {as_json(name, 200)} does not exist; this server serves "
                                f"{as_json(state.model_name, None)}", param="model", code="model_not_found")


async def _read_body(state: ServerState, request: Request) -> bytes:
    """The body, if it is JSON and at most `state.max_body_bytes`. A POST of another type is refused: OpenAI's API
    takes JSON only, and a browser sends a cross-site text/plain or form POST without asking first, so a page the
    user visits could otherwise start generations on a server bound to their loopback."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        got = as_json(media_type, 60) if media_type else "no Content-Type"
        raise APIRequestError(415, f"the body must be JSON, sent with 'Content-Type: application/json' (got {got})",
                              code="unsupported_media_type")
    limit = state.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:  # refused before a byte is read
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():  # a body sent without a length (chunked) is counted as it comes
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> APIRequestError:
    return APIRequestError(413, f"the body is larger than this server's limit of {limit} bytes (specter serve "
                                "--max-body-bytes); send a shorter prompt", code="request_too_large")


async def _encode(state: ServerState, prompt: Prompt, param: str) -> list[int]:
    try:
        if isinstance(prompt, list) and all(isinstance(item, int) for item in prompt):
            _check_prompt_length(state, len(prompt), param)  # before a pass per id: megabytes of ids hold the loop
            prompt_ids = state.engine.encode(prompt)  # token ids: checked, nothing to tokenize
            vocab = state.engine.spec.vocab_size  # (a text's ids the engine checked against it: `Tokenizer.within`)
            if any(not 0 <= token < vocab for token in prompt_ids):
                raise APIRequestError(400, f"token ids must lie in 0..{vocab - 1}", param=param, code="invalid_value")
        else:
            prompt_ids = await _encode_text(state, prompt)
    except (PromptError, ConfigError) as error:  # no tokenizer, no chat template, a template that refuses
        raise APIRequestError(400, _public(state, str(error)), param=param) from None
    if not prompt_ids:
        raise APIRequestError(400, f"the {param} is empty; give at least one token", param=param)
    return prompt_ids


async def _encode_text(state: ServerState, prompt: Prompt) -> list[int]:
    """Text or messages, encoded on an encoder thread (long texts on their own); as many may wait for the two as for
    the engine, then 429."""
    if state.encoding > state.queue.max_waiting:
        raise _busy(state, state.encoding)
    lane = state.long_encoder if _text_chars(prompt) > GIL_FREE_CHARS else state.encoder
    state.encoding += 1
    try:
        return await asyncio.get_running_loop().run_in_executor(lane, state.engine.encode, prompt)
    finally:
        state.encoding -= 1


def _text_chars(prompt: Prompt) -> int:
    """The characters a text or chat prompt gives the tokenizer, but for its template's own."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(message.get("content") or "") for message in prompt if isinstance(message, dict))


def _check_prompt_length(state: ServerState, prompt_tokens: int, prompt_param: str) -> None:
    limit = state.max_context
    if prompt_tokens >= limit:
        raise APIRequestError(400, f"the {prompt_param} has {prompt_tokens} tokens; this model's context is {limit} "
                                   "tokens and must hold the prompt plus at least one new token",
                              param=prompt_param, code="context_length_exceeded")


def _check_context(state: ServerState, prompt_tokens: int, max_tokens: int, prompt_param: str, limit_param: str,
                   how: str = "") -> None:
    """`how`: how the limit was set when the client did not send it, for the error."""
    _check_prompt_length(state, prompt_tokens, prompt_param)
    limit = state.max_context
    if prompt_tokens + max_tokens > limit:
        raise APIRequestError(400, f"{limit_param} {max_tokens}{how} plus the prompt's {prompt_tokens} tokens exceeds "
                                   f"this model's context of {limit} tokens; ask for at most {limit - prompt_tokens}",
                              param=limit_param, code="context_length_exceeded")


def _generation(body: SamplingRequest, max_tokens: int) -> GenerationConfig:
    """The engine's settings for the request: the same fields the Python API takes, so the tokens are the same."""
    try:
        return GenerationConfig.build(
            # top_p 0 keeps the most likely token alone (OpenAI takes it): greedy, which the engine spells temperature 0
            max_new_tokens=max_tokens, temperature=0.0 if body.top_p == 0 else 1.0 if body.temperature is None else body.temperature,
            top_k=body.top_k, top_p=body.top_p or None, seed=secrets.randbelow(2**31) if body.seed is None or body.seed < 0 else body.seed,
            stop_strings=body.stop_strings())
    except ConfigError as error:
        raise APIRequestError(400, str(error)) from None


def _ended(state: ServerState, error: SpecterError) -> APIRequestError:
    """A request the engine ended: the engine's own words, but for its closing, whose advice is the Python API's. A
    plug-in's failure is the server's defect (500: sent again, it fails again), the rest a 503."""
    message = ("the server is shutting down and ended this request; send it again" if isinstance(error, RequestCancelled)
               else _public(state, str(error)))
    return APIRequestError(500 if isinstance(error, PluginError) else 503, message, type="server_error")


def _public(state: ServerState, message: str) -> str:
    """An engine's message for a client: the checkpoint's directory named by the served name, as `--served-model-name`
    chose to show it: where the checkpoint lives on the server's disk is no client's business."""
    tokenizer = state.engine.tokenizer
    source = tokenizer.source if tokenizer is not None else None
    if not source or source == "<memory>" or source == state.model_name:
        return message
    return message.replace(source, f"<model {state.model_name!r}>")


def _admit(state: ServerState) -> Ticket:
    try:
        return state.queue.admit()
    except QueueFull as full:
        raise _busy(state, full.waiting, full.retry_after_s) from None


def _busy(state: ServerState, waiting: int, retry_after_s: int = 1) -> APIRequestError:
    return APIRequestError(429, f"the server is busy: {waiting} requests are waiting (--max-queue "
                                f"{state.queue.max_waiting}); retry after {retry_after_s} s",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry_after_s)})


def live_values(state: ServerState) -> dict[str, int]:
    return {"queue_depth": state.queue.waiting, "running": state.queue.running, "tasks": len(asyncio.all_tasks()),
            "held_slots": held_expert_slots(state.engine)}


def held_expert_slots(engine: Engine) -> int:
    """Cache slots a request still protects or pins: 0 whenever no request runs, or something leaked."""
    cache = engine.runtime.cache
    if cache is None:  # every expert resident: there are no slots to hold
        return 0
    return sum(len(cache.protected_experts(layer)) + len(cache.pinned_experts(layer)) for layer in range(cache.num_layers))


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
