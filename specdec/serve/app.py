"""The FastAPI app: OpenAI's /v1/chat/completions, /v1/completions and /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.models.errors import SpecdecError
from specdec.runtime import Engine, GenerationConfig, GenerationResult
from specdec.runtime.batch import BatchEngine
from specdec.serve.admission import Admission, Draining, Overloaded, QueueTimeout
from specdec.serve.config import ServeConfig
from specdec.serve.generation import Generation
from specdec.serve.guard import BodyTooLarge, RequestGuard, is_loopback
from specdec.serve.metrics import ServerMetrics
from specdec.runtime.grammar import GrammarError
from specdec.serve import logprobs_format, protocol, structured
from specdec.serve import tokenize as tokenizer_routes
from specdec.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest

log = logging.getLogger("specdec.serve")
# The playground page at / (plain files shipped in the package; nothing fetched from another host).
STATIC = Path(__file__).with_name("static")
STATIC_TYPES = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8",
                "index.html": "text/html; charset=utf-8"}
# Events a generation sends beside its text pieces: a step's tokens (specdec_tokens), its logprobs, and how many
# tokens the text so far holds; none ends the stream.
SIDE_EVENTS = ("tokens", "logprobs", "covers")
DISCONNECT_POLL_SECONDS = 0.1


class ServerState:
    """What the routes share: the engine (once loaded), admission, metrics, the thread pool."""

    def __init__(self, config: ServeConfig, engine: Engine | None):
        self.config = config
        self.engine = engine
        self.load_error: str | None = None
        self.admission = Admission(config.running_limit, config.max_queue)
        self.metrics = ServerMetrics(config.served_model_name)
        # One thread per admitted request: with batching it only carries the request's text to the event loop
        # (and waits there while the request waits in the engine's queue).
        self.executor = ThreadPoolExecutor(max_workers=config.running_limit + config.max_queue,
                                           thread_name_prefix="specdec-gen")
        self.active: set[Generation] = set()
        self.batch: BatchEngine | None = None
        if engine is not None:
            self._start_batching(engine)

    def load_engine(self) -> None:
        """Load the artifact, time `auto`'s call costs and the batched calls (blocking; call in a thread)."""
        # Batching: the target's two graphs (plain steps, ragged-rows steps) take turns on one thread pool.
        engine = Engine.load(self.config.artifact, provider=self.config.provider,
                             threads=self.config.engine_threads(), shared_threads=self.config.max_batch > 1)
        engine.time_call_costs()  # before /health says ok, so that no request waits for it
        self._start_batching(engine)
        self.engine = engine

    def _start_batching(self, engine: Engine) -> None:
        if self.config.max_batch <= 1:
            return
        if engine.target.device == "cpu":
            batch = self._batch_engine(engine)
            times = batch.time_batch_calls()
        else:
            batch, times = self._device_batch(engine)
            if batch is None:
                return
        self.batch = batch
        # The queue is the engine's own (before any request: /v1 answers 503 until the engine is loaded), so
        # that it admits from all of it: with the prefix cache, the request a freed slot holds most of.
        self.admission = Admission(self.config.max_batch + self.config.max_queue, 0, serving=self.config.max_batch)
        log.info("batch engine: %d KV slots x %d positions, %.0f MB; batched call ms by rows: %s", self.batch.max_batch,
                 self.batch.arena.capacity, self.batch.arena.nbytes / 2 ** 20,
                 ", ".join(f"{rows}: {seconds * 1e3:.1f}" for rows, seconds in times.items()))
        draft_arena = self.batch.draft_arena
        if draft_arena is not None:
            log.info("draft model: %d KV slots, %.0f MB; %s", self.batch.max_batch, draft_arena.nbytes / 2 ** 20,
                     "a step's draft calls share one ragged-rows call" if draft_arena.ragged
                     else "each drafting request's calls run alone (no draft ragged-rows graph of this many rows)")
        rows = engine.target.spec.ragged_rows
        if self.batch.arena.ragged:
            log.info("drafts share the step's call (ragged-rows graph); ms by tokens: %s", ", ".join(
                f"{tokens}: {seconds * 1e3:.1f}" for tokens, seconds in self.batch.ragged_costs.table().items()))
        else:
            log.info("each speculating request is verified in a call of its own (%s)",
                     f"the artifact's ragged-rows graph has {rows} rows: --max-batch {rows} uses it" if rows
                     else "the artifact has no ragged-rows graph: re-export with --batch-rows")

    def _batch_engine(self, engine: Engine) -> BatchEngine:
        return BatchEngine(engine, self.config.max_batch, self.config.kv_capacity,
                           on_step=self.metrics.observe_batch, prefix_cache=self.config.prefix_cache,
                           prefill_budget=self.config.prefill_budget,
                           prefill_itl_factor=self.config.prefill_itl_factor or None,
                           reply_reuse_share=self.config.reply_reuse_share,
                           reprefill_when_idle=self.config.reprefill_when_idle)

    def _device_batch(self, engine: Engine) -> tuple[BatchEngine | None, dict[int, float]]:
        """Return (the batch engine on a GPU session, its batched calls' seconds by rows), or (None, {}) logged
        where making or timing it fails: it has not run on a GPU yet (docs/GPU.md), and an edge box that serves
        with the defaults must start."""
        batch = None
        try:
            batch = self._batch_engine(engine)
            return batch, batch.time_batch_calls()
        except Exception as err:  # noqa: BLE001 - any failure of the device's calls means serving without batches
            if batch is not None:
                batch.shutdown()
            log.warning("no batch engine on %s (%s): each of up to %d requests runs its own generation",
                        engine.target.device, str(err).splitlines()[0][:200], self.config.running_limit)
            return None, {}

    def raise_if_unhealthy(self) -> None:
        """Raise RuntimeError when this server cannot serve: its engine failed to load or its scheduler died."""
        if self.load_error:
            raise RuntimeError(self.load_error)
        if self.batch is not None and not self.batch.alive:
            raise RuntimeError("the batch engine's scheduler thread has stopped")

    @property
    def generator(self) -> Engine | BatchEngine | None:
        """Return what runs a request's generation: the batch engine, else the engine itself."""
        return self.batch or self.engine

    def update_load(self) -> None:
        """Refresh the running/waiting gauges (the batch engine's slots and queue, else admission's counts), the
        KV usage and the prefix-cache counters."""
        if self.batch is None:
            self.metrics.set_load(self.admission.running, self.admission.waiting, None)
            return
        self.metrics.set_load(self.batch.num_running, self.admission.waiting + self.batch.num_waiting,
                              self.batch.kv_usage)
        if self.batch.prefix_cache:
            self.metrics.set_prefix_cache(self.batch.prefix_tokens_queried, self.batch.prefix_tokens_reused)


def create_app(config: ServeConfig, engine: Engine | None = None, load_in_background: bool = True,
               on_load_error: Callable[[str], None] | None = None) -> FastAPI:
    """Return the app. Without `engine`, it loads `config.artifact` at startup: in the background
    (GET /health answers 503 until it is loaded) or, with load_in_background=False, before serving."""
    config.validate()
    state = ServerState(config, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = None
        if state.engine is None:
            loader = asyncio.get_running_loop().run_in_executor(None, _load, state, on_load_error)
            if not load_in_background:
                await loader
        try:
            yield
        finally:
            await _shutdown(state)
            if loader is not None and not loader.done():
                await asyncio.wait([loader], timeout=1.0)

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.specdec = state
    app.add_middleware(RequestGuard, keys=config.api_keys, public_metrics=config.public_metrics,
                       check_host=is_loopback(config.host), max_body_bytes=config.max_body_bytes)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, err: BodyTooLarge) -> JSONResponse:
        return JSONResponse(err.body, status_code=413)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(protocol.error_body(str(err.detail), kind, None, None), status_code=err.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        return JSONResponse(protocol.error_body(str(err), "invalid_request_error"), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, err: Exception) -> JSONResponse:
        log.error("internal error on %s: %s: %s", request.url.path, type(err).__name__, err)
        return JSONResponse(protocol.error_body("internal server error", "server_error"), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        if state.engine is None:
            detail = state.load_error or "loading"
            return JSONResponse({"status": detail}, status_code=503, headers={"Retry-After": "1"})
        if state.admission.draining:
            return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "1"})
        if state.batch is not None and not state.batch.alive:
            return JSONResponse({"status": "batch scheduler stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/")
    async def page() -> Response:
        return Response((STATIC / "index.html").read_bytes(), media_type="text/html; charset=utf-8")

    @app.get("/static/{name}")
    async def static(name: str) -> Response:
        if name not in STATIC_TYPES:
            raise APIError(404, f"no file /static/{name}", type="not_found_error")
        return Response((STATIC / name).read_bytes(), media_type=STATIC_TYPES[name])

    @app.get("/metrics")
    async def metrics() -> Response:
        state.update_load()
        return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict[str, Any]:
        return {"id": config.served_model_name, "object": "model", "created": 0, "owned_by": "specdec",
                "max_model_len": state.engine.max_positions if state.engine else None}

    @app.get("/openapi.json")
    async def openapi() -> JSONResponse:
        return JSONResponse(protocol.openapi_schema())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = _parse(protocol.TokenizeRequest, _json(await request.body()))
        _check_model(body.model, config)
        return JSONResponse(await asyncio.to_thread(tokenizer_routes.tokenize, _ready(state), body))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = _parse(protocol.DetokenizeRequest, _json(await request.body()))
        _check_model(body.model, config)
        return JSONResponse(await asyncio.to_thread(tokenizer_routes.detokenize, _ready(state), body))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(tokenizer_routes.tokenizer_info(_ready(state)))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id != config.served_model_name:
            raise APIError(404, f"the model '{model_id}' does not exist; this server serves "
                                f"'{config.served_model_name}'", type="not_found_error", param="model",
                           code="model_not_found")
        return JSONResponse(model_card())

    # Parsing, templating and tokenising run on a worker thread: a large body never stalls the event loop.
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        raw = await request.body()
        body, ids, plan = await asyncio.to_thread(_chat_input, _ready(state), raw)
        return await _complete(state, request, body, [ids], chat=True, param="messages", tools=plan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        raw = await request.body()
        body, prompts, texts = await asyncio.to_thread(_completion_input, _ready(state), raw)
        return await _complete(state, request, body, prompts, chat=False, param="prompt",
                               echoed=texts if body.echo else None)

    return app


def _chat_input(engine: Engine, raw: bytes) -> tuple[ChatCompletionRequest, list[int], structured.ToolPlan | None]:
    """Return the parsed chat request, its prompt ids (chat template applied, tools rendered) and its ToolPlan;
    raise APIError for bad input."""
    body = _parse(ChatCompletionRequest, _json(raw))
    if not engine.codec.has_chat_template:
        raise APIError(400, "this model's tokenizer has no chat template: send plain prompts to /v1/completions",
                       param="messages", code="no_chat_template")
    if len(body.messages) > protocol.MAX_MESSAGES:  # before templating and tokenising them all
        raise APIError(400, f"at most {protocol.MAX_MESSAGES} messages per request", param="messages")
    plan = structured.tool_plan(body)
    knows_tools = engine.codec.knows_tools
    messages = structured.chat_messages_with_tools(protocol.chat_messages(body), plan, knows_tools)
    try:
        text = engine.codec.chat_prompt(messages, [t.as_openai() for t in plan.tools] if plan and knows_tools else None)
    except SpecdecError as err:
        raise APIError(400, str(err), param="messages") from None
    return body, engine.codec.encode(text, add_special_tokens=False), plan


def _completion_input(engine: Engine, raw: bytes) -> tuple[CompletionRequest, list[list[int]], list[str]]:
    """Return the parsed completion request, each prompt's ids and each prompt's text (what `echo` returns: the
    prompt as sent, or its ids decoded); raise APIError for bad input."""
    body = _parse(CompletionRequest, _json(raw))
    prompt = body.prompt
    prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
    if not prompts:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if len(prompts) > protocol.MAX_PROMPTS:
        raise APIError(400, f"at most {protocol.MAX_PROMPTS} prompts per request", param="prompt")
    vocab = engine.manifest.tokenizer.vocab_size
    ids, texts = [], []
    for one in prompts:
        tokens = engine.codec.encode(one) if isinstance(one, str) else list(one)
        if not tokens:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if any(not 0 <= token < vocab for token in tokens):
            raise APIError(400, f"prompt token ids must be in 0..{vocab - 1}", param="prompt")
        ids.append(tokens)
        texts.append(one if isinstance(one, str) else engine.codec.decode(tokens))
    return body, ids, texts


def _load(state: ServerState, on_load_error: Callable[[str], None] | None) -> None:
    try:
        state.load_engine()
        log.info("engine loaded: %s (%s)", state.config.artifact, state.engine.provider if state.engine else "?")
    except Exception as err:  # a SpecdecError says what to change; anything else is still one line
        state.load_error = f"engine failed to load: {err}"
        log.error(state.load_error)
        if on_load_error is not None:
            on_load_error(state.load_error)


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"request body is not valid JSON: {err}") from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply") from None


def _parse(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        parsed = model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param) from None
    refused = parsed.unsupported() if hasattr(parsed, "unsupported") else None
    if refused:
        raise APIError(400, refused[1], param=refused[0], code="unsupported_parameter")
    return parsed


def _ready(state: ServerState) -> Engine:
    if state.engine is None:
        raise APIError(503, state.load_error or "the model is still loading", type="server_error",
                       code="model_not_ready", headers={"Retry-After": "1"})
    return state.engine


def _generation_config(state: ServerState, body: Any, ids: list[int], param: str, chat: bool,
                       tools: structured.ToolPlan | None = None) -> GenerationConfig:
    engine, config = state.engine, state.config
    assert engine is not None
    prompt_length = len(ids)
    room = engine.max_positions - prompt_length
    if room < 1:
        raise APIError(400, f"prompt of {prompt_length} tokens leaves no room in the model's "
                            f"{engine.max_positions} positions", param=param, code="context_length_exceeded")
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens or config.max_tokens_default
    if max_tokens > room:
        raise APIError(400, f"{prompt_length} prompt tokens + max_tokens {max_tokens} exceed the model's "
                            f"{engine.max_positions} positions", param="max_tokens", code="context_length_exceeded")
    if state.batch is not None:
        try:
            state.batch.check_fits(prompt_length, max_tokens)
        except SpecdecError as err:
            raise APIError(400, str(err), param=param, code="context_length_exceeded") from None
    stops = body.stop_strings()
    if len(stops) > protocol.MAX_STOP_STRINGS:
        raise APIError(400, f"at most {protocol.MAX_STOP_STRINGS} stop strings", param="stop")
    if any(len(stop) > protocol.MAX_STOP_LENGTH for stop in stops):  # each generated token scans every stop string
        raise APIError(400, f"stop strings are at most {protocol.MAX_STOP_LENGTH} characters", param="stop")
    if len(body.stop_token_ids or ()) > protocol.MAX_STOP_TOKEN_IDS:
        raise APIError(400, f"at most {protocol.MAX_STOP_TOKEN_IDS} stop_token_ids", param="stop_token_ids")
    generation = GenerationConfig(
        max_new_tokens=max_tokens,
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=body.logit_bias_pairs(),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        temperature=1.0 if body.temperature is None else body.temperature,  # OpenAI's default
        top_k=max(body.top_k or 0, 0),
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=secrets.randbits(31) if body.seed is None else body.seed,
        reproducible=body.seed is not None,  # OpenAI's seed: the same answer again, whatever the load
        num_draft_tokens=config.num_draft_tokens if body.num_draft_tokens is None else body.num_draft_tokens,
        drafter=body.drafter or config.drafter,
        stop_strings=stops,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logprobs=body.alternatives(chat),
        prediction=body.prediction.text() or None if body.prediction is not None else None,
        grammar=_grammar(body, tools),
        cache_salt=body.cache_salt,
    )
    try:
        engine.checked_prompt(ids, generation)  # settings, grammar, and token ids against the vocabulary
    except GrammarError as err:
        raise APIError(400, str(err), param=_grammar_field(body) if tools is None or not tools.constrained
                       else "tools") from None
    except SpecdecError as err:  # "num_draft_tokens must be ...": a message that opens with a field names it
        field = str(err).split(" ", 1)[0]
        raise APIError(400, str(err), param=field if field in type(body).model_fields else None) from None
    return generation


def _grammar(body: Any, tools: structured.ToolPlan | None):
    """Return the GrammarSpec of a request: its output format's, or its required tool call's (never both)."""
    asked = structured.grammar_of(body)
    calls = tools.grammar() if tools is not None else None
    if asked is not None and calls is not None:
        raise APIError(400, "a required tool call and an output format cannot both constrain the answer",
                       param="response_format")
    return asked or calls


def _grammar_field(body: Any) -> str:
    """Return the name of the field that asked for the request's grammar (for a 400's param)."""
    fields = ("response_format", "structured_outputs", *structured.GUIDED)
    return next((field for field in fields if getattr(body, field, None) is not None), "response_format")


async def _complete(state: ServerState, request: Request, body: Any, prompts: list[list[int]], chat: bool,
                    param: str, tools: structured.ToolPlan | None = None,
                    echoed: list[str] | None = None) -> Response:
    arrival = time.perf_counter()
    config = state.config
    _check_model(body.model, config)
    if len(prompts) * (body.n or 1) > protocol.MAX_REQUEST_CHOICES:
        raise APIError(400, f"{len(prompts)} prompts x n={body.n or 1} make more than {protocol.MAX_REQUEST_CHOICES} "
                            "choices", param="n")
    if body.max_tokens == 0:
        if echoed is None:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo on /v1/completions: the prompt "
                                "scored, nothing generated)", param="max_tokens")
        return await _scored(state, request, body, prompts, echoed, arrival)
    # a grammar compiles here (its tokenizer adapter on first use): on a worker thread, like parsing
    configs = await asyncio.to_thread(
        lambda: [_generation_config(state, body, ids, param, chat, tools) for ids in prompts])
    choices = _choices(configs, body)
    deadline = arrival + config.request_timeout
    metrics, model = state.metrics, config.served_model_name
    runs: list[_Run] = []  # one a choice, each admitted and started in turn
    run: _Run | None = None
    waited = 0.0
    try:
        # Each choice takes a place in turn; earlier ones generate meanwhile and give theirs back as they end.
        for prompt_index, choice_config in choices:
            run = None
            waited += await _admit_unless_gone(state, request, deadline)
            run = _Run(state, prompts[prompt_index], choice_config, arrival, deadline,
                       tokens=bool(body.specdec_tokens and body.stream))
            runs.append(run)
            waited += await _start_unless_gone(run, request, deadline)  # a batch engine's own queue
        if echoed is not None:  # each prompt scored once, while its choices generate
            top = configs[0].logprobs
            echoes = await asyncio.to_thread(lambda: [_echo(state.engine, ids, text, top)
                                                      for ids, text in zip(prompts, echoed)])
            for run, (prompt_index, _) in zip(runs, choices):
                run.echo(echoes[prompt_index])
    except ClientGone:  # left while queued: dropped before its prefill, nobody to answer
        _close_all(runs, "disconnect_queued")
        if run is None:
            metrics.cancelled.labels(model, "disconnect_queued").inc()
        return Response(status_code=499)
    except (Overloaded, Draining, QueueTimeout) as err:
        _close_all(runs, "deadline" if isinstance(err, QueueTimeout) else "rejected")
        raise _refusal(state, err, counted=run is not None) from None
    except BaseException:
        _close_all(runs, "error")
        raise
    prompt_tokens = sum(len(ids) for ids in prompts)
    metrics.queue_time.labels(model).observe(waited)
    metrics.prompt_tokens.labels(model).inc(prompt_tokens)
    state.update_load()
    want_stats = body.specdec_stats if body.specdec_stats is not None else config.stats_in_response
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _StreamResponse(_sse(runs, chat, include_usage, want_stats, tools, prompt_tokens),
                               lambda reason: _close_all(runs, reason), config.write_timeout,
                               media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _whole_response(request, runs, chat, tools, want_stats, prompt_tokens)


async def _whole_response(request: Request, runs: list["_Run"], chat: bool, tools: structured.ToolPlan | None,
                          want_stats: bool, prompt_tokens: int) -> JSONResponse:
    """Return the non-streamed body of every choice, once all have finished (all cancelled if the client leaves)."""
    watcher = asyncio.create_task(_watch_disconnect(request, runs))
    try:
        outcomes = await asyncio.gather(*(run.result() for run in runs), return_exceptions=True)
    finally:
        watcher.cancel()
        _close_all(runs, "disconnect")
    failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
    if failed is not None:
        raise failed
    bodies = [_choice(run, result, index, chat, tools) for index, (run, result) in enumerate(zip(runs, outcomes))]
    extra = None
    if want_stats:
        extra = {"specdec": _stats(outcomes[0]) if len(outcomes) == 1 else [_stats(r) for r in outcomes]}
    usage = protocol.total_usage(prompt_tokens, [run.usage(result) for run, result in zip(runs, outcomes)])
    return JSONResponse(protocol.completion_response(
        chat, protocol.new_id("chatcmpl" if chat else "cmpl"), runs[0].model, bodies, usage, extra))


def _refusal(state: ServerState, err: Exception, counted: bool) -> APIError:
    """Return the error answering an admission refusal (Overloaded, Draining, QueueTimeout), counted in the metrics
    (`counted`: a run's close counts a deadline itself)."""
    metrics, model = state.metrics, state.config.served_model_name
    if isinstance(err, Overloaded):
        metrics.rejected.labels(model, "overloaded").inc()
        return APIError(429, str(err), type="rate_limit_exceeded", code="server_overloaded",
                        headers={"Retry-After": str(err.retry_after)})
    if isinstance(err, Draining):
        metrics.rejected.labels(model, "draining").inc()
        return APIError(503, "server is shutting down", type="server_error", code="draining")
    if not counted:
        metrics.cancelled.labels(model, "deadline").inc()
    return APIError(504, f"request deadline of {state.config.request_timeout:g} s passed while queued",
                    type="timeout_error", code="deadline_exceeded")


async def _scored(state: ServerState, request: Request, body: Any, prompts: list[list[int]], echoed: list[str],
                  arrival: float) -> Response:
    """Answer `echo` with max_tokens 0: every prompt scored (its tokens' logprobs, where asked) under one admission
    place, nothing generated; each of a prompt's n choices is that prompt, finish_reason "length"."""
    engine, model = _ready(state), state.config.served_model_name
    if any(len(ids) > engine.max_positions for ids in prompts):
        raise APIError(400, f"a prompt is longer than the model's {engine.max_positions} positions", param="prompt",
                       code="context_length_exceeded")
    n, top = body.n or 1, body.alternatives(False)
    try:
        await _admit_unless_gone(state, request, arrival + state.config.request_timeout)
    except ClientGone:
        state.metrics.cancelled.labels(model, "disconnect_queued").inc()
        return Response(status_code=499)
    except (Overloaded, Draining, QueueTimeout) as err:
        raise _refusal(state, err, counted=False) from None
    try:
        echoes = await asyncio.to_thread(lambda: [_echo(engine, ids, text, top) for ids, text in zip(prompts, echoed)])
    finally:
        state.admission.release(time.perf_counter() - arrival)
    prompt_tokens = sum(len(ids) for ids in prompts)
    state.metrics.prompt_tokens.labels(model).inc(prompt_tokens)
    usage, id_ = protocol.usage(prompt_tokens, 0), protocol.new_id("cmpl")
    scored = [echoes[index // n] for index in range(len(prompts) * n)]
    if not body.stream:
        return JSONResponse(protocol.completion_response(False, id_, model, [
            protocol.response_choice(False, index, echo.text, "length", echo.logprobs)
            for index, echo in enumerate(scored)], usage))

    async def stream() -> AsyncIterator[str]:
        created = int(time.time())
        for index, echo in enumerate(scored):
            yield _data(protocol.chunk(False, id_, created, model, text=echo.text, logprobs=echo.logprobs, index=index))
            yield _data(protocol.chunk(False, id_, created, model, finish="length", index=index))
        if body.stream_options and body.stream_options.include_usage:
            yield _data(protocol.chunk(False, id_, created, model, usage_=usage))
        yield "data: [DONE]\n\n"

    return _StreamResponse(stream(), lambda reason: None, state.config.write_timeout,
                           media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _check_model(model: str | None, config: ServeConfig) -> None:
    """Raise a 404 where a request names a model this server does not serve."""
    if model is not None and model != config.served_model_name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves "
                            f"'{config.served_model_name}'", type="not_found_error", param="model",
                       code="model_not_found")


def _choices(configs: list[GenerationConfig], body: Any) -> list[tuple[int, GenerationConfig]]:
    """Return (prompt index, settings) of each choice: n per prompt, a prompt's choice j sampled from seed + j where
    the client set a seed (the same answers again, each prompt's as if sent alone: a harness's batch size changes
    nothing), else from a seed of its own."""
    n = body.n or 1
    if n == 1:
        return list(enumerate(configs))  # each prompt's own settings, its seed as _generation_config drew it
    return [(p, dataclasses.replace(config, seed=(body.seed + j) % 2 ** 63 if body.seed is not None
                                    else secrets.randbits(31)))
            for p, config in enumerate(configs) for j in range(n)]


@dataclasses.dataclass(frozen=True)
class Echo:
    """A completion's prompt ahead of its answer (`echo`): its text, and its tokens' logprobs where asked."""

    text: str
    logprobs: dict[str, Any] | None  # the legacy completions shape, text offsets from 0


def _echo(engine: Engine, prompt_ids: list[int], text: str, top: int | None) -> Echo:
    """Return the Echo of one prompt: one target pass over it when logprobs are asked (top: their alternatives)."""
    if top is None:
        return Echo(text, None)
    scored = engine.prompt_logprobs(prompt_ids, top)
    return Echo(text, logprobs_format.completion_logprobs(
        logprobs_format.prompt_entries(prompt_ids, scored, engine.codec.decode)))


def _choice(run: "_Run", result: GenerationResult, index: int, chat: bool,
            tools: structured.ToolPlan | None) -> dict[str, Any]:
    """Return choice `index` of a non-streamed body: the answer's text (after the echoed prompt), or the calls it
    makes."""
    text = result.text
    calls = structured.parse_calls(text, tools) if tools is not None else None
    finish = "tool_calls" if calls else protocol.FINISH_REASONS.get(result.finish_reason, "stop")
    if calls is None and tools is not None and tools.constrained:
        calls = structured.begun_calls(text)  # cut by max_tokens: as far as they went, as the stream sends them
    logprobs = run.choice_logprobs(run.logprob_entries[:len(result.token_ids)], chat)
    if run.echoed is not None:
        text, logprobs = run.echoed.text + text, logprobs_format.joined(run.echoed.logprobs, logprobs)
    return protocol.response_choice(chat, index, text, finish, logprobs,
                                    [call.as_openai() for call in calls] if calls else None)


def _close_all(runs: list["_Run"], reason: str) -> None:
    """End every choice's run (each frees its slot once; a finished one only that)."""
    for run in runs:
        run.close(reason)


class ClientGone(Exception):
    """The client closed its connection before its request was admitted."""


async def _admit_unless_gone(state: ServerState, request: Request, deadline: float) -> float:
    """Return the seconds waited for a slot; raise ClientGone if the client leaves first (the body is read
    by now, so the only message left to receive is the disconnect), or admission's own errors."""
    admit = asyncio.ensure_future(state.admission.acquire(timeout=deadline - time.perf_counter()))
    # admitted in the same instant the client left: the slot goes back
    await _unless_gone(admit, request, undo=lambda: state.admission.release())
    return admit.result()


async def _start_unless_gone(run: "_Run", request: Request, deadline: float) -> float:
    """Return the seconds until the engine started the request (~0 unless a batch engine queued it); raise
    ClientGone if the client leaves first, QueueTimeout if the deadline passes first."""
    start = time.perf_counter()
    started = asyncio.ensure_future(run.generation.started.wait())
    if not await _unless_gone(started, request, timeout=deadline - start):
        raise QueueTimeout()
    return time.perf_counter() - start


async def _unless_gone(waiting: asyncio.Future, request: Request, timeout: float | None = None,
                       undo: Callable[[], None] | None = None) -> bool:
    """Wait for `waiting` (at most `timeout` seconds); return True once it is done (its errors are raised),
    False at the timeout. Raise ClientGone if the client leaves first (the body is read by now, so the only
    message left to receive is the disconnect): `waiting` is cancelled, or undone if it completed meanwhile."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({waiting, gone}, timeout=None if timeout is None else max(timeout, 0.0),
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        left = gone.done() and not gone.cancelled()
        gone.cancel()
    if waiting.done():
        waiting.result()
        return True
    waiting.cancel()
    try:
        await waiting
        if undo is not None:
            undo()
    except asyncio.CancelledError:
        pass
    if left:
        raise ClientGone()
    return False


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Run:
    """One admitted request: its Generation, its timings, and the release of its slot (exactly once)."""

    def __init__(self, state: ServerState, ids: list[int], config: GenerationConfig, arrival: float,
                 deadline: float, tokens: bool = False):
        self.state, self.arrival, self.deadline = state, arrival, deadline
        # specdec_tokens: a decode stream of its own turns each committed token into its piece of text
        self._token_text = state.engine.codec.decode_stream() if tokens else None
        self.metrics, self.model = state.metrics, state.config.served_model_name
        self.prompt_tokens = len(ids)
        self.config = config
        self.logprob_entries: list[logprobs_format.TokenEntry] = []  # every committed token's, when asked for
        self._logprob_offset = 0  # completions' text_offset of the next streamed entry
        self.echoed: Echo | None = None  # the prompt ahead of the answer (completions' echo)
        # The admission place goes back when the generation ends, not when its client has read it all: a slow
        # reader, or a response of several choices still generating, holds no place a finished generation used.
        self._holds_place = True
        self.generation = Generation(state.generator, ids, config, on_iteration=self._on_iteration,
                                     on_end=self._give_place)
        self.generation.start(state.executor)
        state.active.add(self.generation)
        self.first_piece_at: float | None = None
        self.last_piece_at: float | None = None
        self.final: tuple[str, Any] | None = None  # the generation's last event, once received
        self._closed = False

    def _on_iteration(self, iteration) -> None:  # on the generation's thread
        self.metrics.observe_iteration(iteration)
        if iteration.committed:
            self.metrics.generation_tokens.labels(self.model).inc(len(iteration.committed))
        if self._token_text is not None:
            self.generation.emit("tokens", _iteration_tokens(iteration, self._token_text, self.state.engine.codec))
        if iteration.logprobs is not None:
            entries = logprobs_format.entries(iteration.committed, iteration.logprobs, self.state.engine.codec.decode)
            self.logprob_entries.extend(entries)
            self.generation.emit("logprobs", entries)  # ahead of the iteration's text pieces, on the same queue

    def echo(self, echoed: Echo) -> None:
        """Put the prompt ahead of this choice's answer: its text offsets then start after the prompt's text."""
        self.echoed = echoed
        self._logprob_offset = len(echoed.text)

    def usage(self, result: GenerationResult) -> dict[str, Any]:
        """Return OpenAI's usage of a finished request (prediction tokens counted where it sent a prediction)."""
        predicted = result.stats.prediction_tokens() if self.config.prediction else None
        return protocol.usage(self.prompt_tokens, len(result.token_ids), predicted)

    def choice_logprobs(self, entries: list[logprobs_format.TokenEntry], chat: bool) -> dict[str, Any] | None:
        """Return a choice's logprobs object for `entries` (None where the request did not ask for logprobs)."""
        if self.config.logprobs is None:
            return None
        if chat:
            return logprobs_format.chat_logprobs(entries)
        body = logprobs_format.completion_logprobs(entries, self._logprob_offset)
        self._logprob_offset += sum(len(entry.token) for entry in entries)
        return body

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
        """Yield ("piece", text) events, then one final event; cancels on the deadline."""
        queue = self.generation.events
        while True:
            remaining = self.deadline - time.perf_counter()
            try:
                kind, value = await asyncio.wait_for(queue.get(), timeout=max(remaining, 0.001))
            except asyncio.TimeoutError:
                self.generation.cancel("deadline")
                continue  # the thread answers with ("cancelled", "deadline") within one iteration
            if kind in SIDE_EVENTS:
                yield kind, value
                continue
            if kind == "piece":
                if not value:
                    continue
                now = time.perf_counter()
                if self.first_piece_at is None:
                    self.first_piece_at = now
                    self.metrics.ttft.labels(self.model).observe(now - self.arrival)
                    self.metrics.observe_ttft_parts(self.generation.timeline, self.arrival, now)
                else:
                    self.metrics.itl.labels(self.model).observe(now - self.last_piece_at)
                self.last_piece_at = now
            if kind != "piece":
                self.final = (kind, value)
            yield kind, value
            if kind != "piece":
                return

    async def result(self) -> GenerationResult:
        """Return the finished generation's result; raise APIError if it was cancelled or failed."""
        async for kind, value in self.events():
            if kind != "piece" and kind not in SIDE_EVENTS:
                return self._final(kind, value)
        raise AssertionError("unreachable")

    def _final(self, kind: str, value: Any) -> GenerationResult:
        if kind == "done":
            self.metrics.e2e.labels(self.model).observe(time.perf_counter() - self.arrival)
            self.metrics.success.labels(self.model, protocol.FINISH_REASONS.get(value.finish_reason, "stop")).inc()
            return value
        if kind == "cancelled":
            if value == "deadline":
                raise APIError(504, f"request deadline of {self.state.config.request_timeout:g} s passed",
                               type="timeout_error", code="deadline_exceeded")
            raise APIError(503, f"generation cancelled ({value})", type="server_error", code="cancelled")
        if isinstance(value, SpecdecError):
            raise APIError(400, str(value))
        log.error("generation failed: %s: %s", type(value).__name__, value)
        raise APIError(500, "generation failed", type="server_error")

    def close(self, reason: str = "disconnect") -> None:
        """End the request: cancel the generation if it still runs (counting why), free the slot once."""
        if self._closed:
            return
        self._closed = True
        generation = self.generation
        if self.final is None:  # still running: the client went away, or the request failed before the end
            generation.cancel(reason)
            self.metrics.cancelled.labels(self.model, generation.cancel_reason or reason).inc()
        elif self.final[0] == "cancelled":
            self.metrics.cancelled.labels(self.model, self.final[1]).inc()
        self.state.active.discard(generation)
        self._give_place()

    def _give_place(self) -> None:
        """Give the admission place back, once (the generation ended, or the request was closed first)."""
        if not self._holds_place:
            return
        self._holds_place = False
        self.state.admission.release(time.perf_counter() - self.arrival)
        self.state.update_load()


async def _watch_disconnect(request: Request, runs: list[_Run]) -> None:
    """Cancel a non-streamed request's generations when its client goes away."""
    await _disconnected(request)
    for run in runs:
        run.generation.cancel("disconnect")


def _stats(result: GenerationResult) -> dict[str, Any]:
    data = result.stats.as_dict()
    data["draft_lengths"] = {str(k): v for k, v in data.get("draft_lengths", {}).items()}
    return data


def _sse(runs: list[_Run], chat: bool, include_usage: bool, want_stats: bool,
         tools: structured.ToolPlan | None, prompt_tokens: int) -> AsyncIterator[str]:
    async def stream() -> AsyncIterator[str]:
        id_ = protocol.new_id("chatcmpl" if chat else "cmpl")
        created, model = int(time.time()), runs[0].model
        usages: list[dict[str, Any] | None] = [None] * len(runs)  # each choice's, once it has finished
        choices = [_choice_chunks(run, index, chat, id_, created, want_stats, tools, usages)
                   for index, run in enumerate(runs)]
        try:
            async for chunk in _merged(choices):
                yield _data(chunk)
        except APIError as err:  # the status line is gone: the error travels as an event, as vLLM does
            yield _data(err.body())
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            yield _data(protocol.chunk(chat, id_, created, model, usage_=protocol.total_usage(
                prompt_tokens, [usage or protocol.usage(run.prompt_tokens, 0) for usage, run in zip(usages, runs)])))
        yield "data: [DONE]\n\n"

    return stream()


async def _choice_chunks(run: _Run, index: int, chat: bool, id_: str, created: int, want_stats: bool,
                         tools: structured.ToolPlan | None, usages: list[dict[str, Any] | None]
                         ) -> AsyncIterator[dict[str, Any]]:
    """Yield the stream chunks of choice `index` (its run's events); its usage goes in `usages` at the end."""
    model = run.model

    def chunk(**fields: Any) -> dict[str, Any]:
        return protocol.chunk(chat, id_, created, model, index=index, **fields)

    if chat:
        yield chunk(role=True)
    if run.echoed is not None:
        yield chunk(text=run.echoed.text, logprobs=run.echoed.logprobs)
    pending: list[logprobs_format.TokenEntry] = []  # logprobs ride the text chunk that holds their tokens
    sent = 0  # logprob entries sent so far
    covers = 0  # tokens the text so far holds
    # Text that may turn out to be tool calls is held back: under "auto" until its first characters say it
    # is text, or it ends as calls. A required call streams as calls as soon as its name is whole.
    held, holding = "", tools is not None
    calls_stream = structured.CallStream() if tools is not None and tools.constrained else None
    async for kind, value in run.events():
        if kind == "piece":
            if holding:
                held += value
                if calls_stream is not None:
                    deltas = calls_stream.deltas(held)
                    if deltas:
                        yield chunk(tool_calls=deltas, logprobs=run.choice_logprobs(pending, chat))
                        sent, pending = sent + len(pending), []
                    continue
                holding = structured.may_be_calls(held)
                if holding:
                    continue
                value, held = held, ""
            count = min(max(covers - sent, 0), len(pending))
            yield chunk(text=value, logprobs=run.choice_logprobs(pending[:count], chat))
            sent, pending = sent + count, pending[count:]
            continue
        if kind == "tokens":  # asked for with specdec_tokens: an empty delta carrying them
            yield chunk(extra={"specdec_tokens": value})
            continue
        if kind == "logprobs":
            pending.extend(value)
            continue
        if kind == "covers":
            covers = value
            continue
        result = run._final(kind, value)
        usages[index] = run.usage(result)
        extra = {"specdec": _stats(result)} if want_stats else None
        pending = pending[:max(len(result.token_ids) - sent, 0)]  # none past a stop string
        logprobs = run.choice_logprobs(pending, chat) if pending else None
        calls = structured.parse_calls(result.text, tools) if holding else None
        rest = calls_stream.deltas(result.text) if calls_stream is not None else []
        last: dict[str, Any] | None = None  # the chunk before the finish, if one is due
        if calls_stream is not None and calls_stream.started:
            # the calls' last text; a call cut by max_tokens stays cut, as its finish reason says
            last = {"tool_calls": rest} if rest else None
        elif calls:  # one delta with every call whole: what the openai client's stream assembler reads
            last = {"tool_calls": [call.as_openai(i) for i, call in enumerate(calls)]}
        elif held:
            last = {"text": held}
        if last is not None:
            yield chunk(logprobs=logprobs, **last)
        finish = "tool_calls" if calls else protocol.FINISH_REASONS.get(result.finish_reason, "stop")
        yield chunk(finish=finish, extra=extra, logprobs=None if last is not None else logprobs)


async def _merged(streams: list[AsyncIterator[dict[str, Any]]]) -> AsyncIterator[dict[str, Any]]:
    """Yield the items of every stream as they come (one stream: in place, no task); the first error ends it."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    ended = object()

    async def pump(stream: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for item in stream:
                await queue.put((item, None))
        except Exception as err:  # one choice's APIError ends the response (its runs are closed with it)
            await queue.put((None, err))
            return
        await queue.put((ended, None))

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        left = len(tasks)
        while left:
            item, err = await queue.get()
            if err is not None:
                raise err
            if item is ended:
                left -= 1
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _iteration_tokens(iteration, decoder, codec) -> dict[str, Any]:
    """Return one iteration's tokens for the page: each piece of text with how it came, the drafts, the
    rejected draft's text (if any) and whether this was the prefill."""
    kinds = protocol.token_kinds(len(iteration.drafted), iteration.num_accepted, len(iteration.committed),
                                 iteration.is_bonus, iteration.rejected)
    tokens = [{"text": decoder.push(token), "kind": kind} for token, kind in zip(iteration.committed, kinds)]
    rejected = (codec.decode([iteration.drafted[iteration.num_accepted]])
                if iteration.rejected and iteration.num_accepted < len(iteration.drafted) else None)
    return {"tokens": tokens, "drafted": len(iteration.drafted), "rejected": rejected, "prefill": iteration.prefill}


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class SlowClient(Exception):
    """The client did not take a stream chunk within the write timeout."""


class _StreamResponse(StreamingResponse):
    """A StreamingResponse that calls `on_close` however it ends (finished, client gone, cancelled), and
    gives up on a client that takes no chunk for `write_timeout` seconds (its socket buffers are full)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[str], None], write_timeout: float,
                 **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close, self._write_timeout = on_close, write_timeout

    async def __call__(self, scope, receive, send) -> None:
        async def send_or_give_up(message) -> None:
            try:
                await asyncio.wait_for(send(message), timeout=self._write_timeout)
            except asyncio.TimeoutError:
                raise SlowClient() from None

        reason = "disconnect"
        try:
            await super().__call__(scope, receive, send_or_give_up)
        except* SlowClient:  # starlette's task group wraps it; uvicorn closes the connection after we return
            reason = "slow_client"
            log.warning("stream cancelled: the client took no chunk within %g s", self._write_timeout)
        finally:
            self._on_close(reason)
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


async def _shutdown(state: ServerState) -> None:
    """Stop admitting, give running generations `shutdown_grace` seconds, cancel the rest, stop the pool."""
    state.admission.draining = True
    loop = asyncio.get_running_loop()
    end = loop.time() + state.config.shutdown_grace
    while state.active and loop.time() < end:
        await asyncio.sleep(0.05)
    for generation in list(state.active):
        generation.cancel("shutdown")  # counted as cancelled when its request closes
    await loop.run_in_executor(None, lambda: state.executor.shutdown(wait=True, cancel_futures=True))
    if state.batch is not None:
        await loop.run_in_executor(None, state.batch.shutdown)
