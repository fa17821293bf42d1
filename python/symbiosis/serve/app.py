"""symbiosis-serve's HTTP API: OpenAI's completions, chat completions and models, vLLM's adapter
loading, health and Prometheus metrics, over one Engine that batches every model's requests
together ([Multi-adapter batches]). docs/serving.md is the user's page.

[Serving text]
Prompts are tokenized in Python by the checkpoint's own transformers tokenizer (AutoTokenizer): a
chat template is Jinja that only transformers renders as transformers does (apply_chat_template),
and rendering and tokenizing with the same object gives exactly the ids a transformers user gets.
The output's text is the engine's ([Serving engine]): the C++ tokenizer, held to AutoTokenizer,
decodes it as it grows on the stepping thread and ends a request at a stop string with the token
that completes it. Token strings in logprobs are AutoTokenizer's decode of each id.
"""
import asyncio
import contextlib
import json
import os
import secrets
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Dict, List, Optional, Sequence, Set, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..client import Error
from .engine import Engine, SamplingParams, TokenEvent
from .metrics import Metrics
from .protocol import ApiError, GenerationRequest, parse_adapter_body, parse_chat, parse_completion

RETRY_AFTER_S = 1  # what a 429 asks a client to wait
DISCONNECT_POLL_S = 0.1  # how often a non-streaming request looks whether its client has gone


class Keys:
    """API keys ([Adapter keys]): each key may use every model (None) or the named ones only; such a
    key sees only those in /v1/models, is refused others with 403 whether they exist or not (so it
    learns nothing of other customers' adapters), and may not load or unload adapters. No keys: the
    server is open."""

    def __init__(self, allowed: Optional[Dict[str, Optional[Set[str]]]]):
        self._allowed = allowed

    def models_of(self, request: Request) -> Optional[Set[str]]:
        """The models the request's key may use (None: all); 401 without a known key."""
        if self._allowed is None:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "this server needs an API key: send the header 'Authorization: Bearer KEY'")
        if key.strip() not in self._allowed:
            raise ApiError(401, "the API key is not one this server knows")
        return self._allowed[key.strip()]


class Server:
    """The API over `engine`; `tokenizer` is the checkpoint's AutoTokenizer ([Serving text]).
    base_name: the base model's name in `model` fields (vLLM's --served-model-name); max_model_len:
    positions per request; eos_token_ids: what ends a request unless it asks ignore_eos."""

    def __init__(self, engine: Engine, tokenizer, *, base_name: str, checkpoint: str, max_model_len: int,
                 eos_token_ids: Sequence[int], keys: Keys):
        self.engine = engine
        self.tokenizer = tokenizer
        self.base_name = base_name
        self.checkpoint = checkpoint
        self.max_model_len = max_model_len
        self.eos_token_ids = list(eos_token_ids)
        self.keys = keys
        self.metrics = Metrics(engine)
        self.adapter_paths: Dict[str, str] = {}  # by name, as loaded
        self.created = int(time.time())
        self.vocab_size = len(tokenizer)

    # --- models ---------------------------------------------------------------------------------

    def load_adapter(self, name: str, path: str) -> None:
        if name == self.base_name:
            raise ApiError(400, f"'lora_name' is '{name}', the base model's name: an adapter needs another",
                           param="lora_name")
        try:
            self.engine.load_adapter(name, path)
        except Error as error:
            raise ApiError(400, f"adapter '{name}' from {path}{_base_of(path)} was not loaded for this server's model "
                                f"{self.checkpoint}: {error}", param="lora_path") from None
        self.adapter_paths[name] = path

    def unload_adapter(self, name: str) -> None:
        if name not in self.adapter_paths:
            raise ApiError(404, f"adapter '{name}' is not loaded; loaded: {self._names(sorted(self.adapter_paths))}",
                           param="lora_name")
        self.engine.unload_adapter(name)
        del self.adapter_paths[name]

    @staticmethod
    def _names(names: List[str]) -> str:
        return ", ".join(names) or "none"

    def _models(self, allowed: Optional[Set[str]]) -> List[str]:
        models = [self.base_name] + sorted(self.adapter_paths)
        return [m for m in models if allowed is None or m in allowed]

    def _adapter_of(self, model: str, allowed: Optional[Set[str]]) -> str:
        """The engine's adapter name for `model` ("" for the base); 403 or 404 naming what may be used."""
        if allowed is not None and model not in allowed:
            raise ApiError(403, f"model '{model}' is not one this API key may use; it may use "
                                f"{self._names(self._models(allowed))}", param="model")
        if model == self.base_name:
            return ""
        if model not in self.adapter_paths:
            raise ApiError(404, f"model '{model}' does not exist; this server serves "
                                f"{self._names(self._models(allowed))}", param="model")
        return model

    # --- generation -----------------------------------------------------------------------------

    def _encode(self, text: str) -> List[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def _chat_prompt(self, request: GenerationRequest) -> List[int]:
        try:
            ids = self.tokenizer.apply_chat_template(
                request.messages, add_generation_prompt=request.add_generation_prompt, tokenize=True, return_dict=False)
        except ValueError as error:  # no chat template
            raise ApiError(400, f"model '{request.model}' cannot chat: {error}", param="messages") from None
        except Exception as error:  # the template's own refusal (raise_exception in Jinja), or a bad message
            raise ApiError(400, f"the chat template refused 'messages': {error}", param="messages") from None
        return list(ids)

    def _sequences(self, request: GenerationRequest, prompts: List[List[int]], seeded: bool,
                   chat: bool) -> List[Tuple[int, SamplingParams]]:
        """(prompt index, sampling) of each choice: n per prompt, choice i seeded with seed + i."""
        sequences = []
        for p, prompt in enumerate(prompts):
            if len(prompt) >= self.max_model_len:
                raise ApiError(400, f"the prompt is {len(prompt)} tokens, and this model's context is "
                                    f"{self.max_model_len} tokens (--max-model-len): it leaves no room to generate",
                               param="messages" if chat else "prompt")
            params = SamplingParams(**vars(request.params))
            if chat and not request.max_tokens_given:
                params.max_new_tokens = self.max_model_len - len(prompt)
            elif len(prompt) + params.max_new_tokens > self.max_model_len:
                raise ApiError(400, f"the prompt ({len(prompt)} tokens) + max_tokens ({params.max_new_tokens}) = "
                                    f"{len(prompt) + params.max_new_tokens} tokens, more than this model's context "
                                    f"of {self.max_model_len} tokens (--max-model-len)", param="max_tokens")
            if not request.ignore_eos:
                params.stop_token_ids = list(params.stop_token_ids) + self.eos_token_ids
            for _ in range(request.n):
                choice = SamplingParams(**vars(params))
                choice.seed = (params.seed + len(sequences)) if seeded else secrets.randbits(63)
                sequences.append((p, choice))
        return sequences

    def _start(self, request: GenerationRequest, adapter: str, prompts: List[List[int]],
               sequences: List[Tuple[int, SamplingParams]]) -> Tuple[List[int], List[AsyncIterator[TokenEvent]]]:
        """Submits every sequence, all or none (a refusal cancels those submitted): their request
        ids, to cancel once the response is over (ended ones are ignored), and their events."""
        arrived = time.monotonic()
        requests, streams = [], []
        try:
            for p, params in sequences:
                stream = self.engine.stream(prompts[p], params, adapter)
                requests.append(stream.request)
                streams.append(self.metrics.metered(stream.events, request.model, arrived, len(prompts[p])))
        except Error as error:
            self._cancel(requests)
            message = str(error)
            if "is full" in message:
                raise ApiError(429, f"the server is full: {message}", retry_after=RETRY_AFTER_S) from None
            raise ApiError(400, message) from None
        return requests, streams

    def _cancel(self, requests: List[int]) -> None:
        for request in requests:
            self.engine.cancel(request)

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _completion_logprobs(self, events: List[TokenEvent], offset: int) -> Dict[str, Any]:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for event in events:
            if event.token < 0:
                continue
            text = self._token_text(event.token)
            tokens.append(text)
            token_logprobs.append(event.logprob)
            top = {self._token_text(t): p for t, p in event.top_logprobs}
            top.setdefault(text, event.logprob)
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, events: List[TokenEvent]) -> Dict[str, Any]:
        def entry(token: int, logprob: float) -> Dict[str, Any]:
            text = self._token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [dict(entry(e.token, e.logprob), top_logprobs=[entry(t, p) for t, p in e.top_logprobs])
                            for e in events if e.token >= 0]}

    @staticmethod
    def _finish_reason(event: TokenEvent) -> str:
        if event.finish_reason == "error":
            raise ApiError(500, f"generation failed: {event.error}")
        if event.finish_reason == "cancelled":
            raise ApiError(503, "the server is shutting down", retry_after=RETRY_AFTER_S)
        return event.finish_reason

    async def generate(self, http: Request, chat: bool) -> Response:
        allowed = self.keys.models_of(http)
        body = await _json_body(http)
        parse = parse_chat if chat else parse_completion
        request, seeded = parse(body, self.vocab_size)
        adapter = self._adapter_of(request.model, allowed)
        prompts = [self._chat_prompt(request)] if chat else \
            [p if isinstance(p, list) else self._encode(p) for p in request.prompts]
        sequences = self._sequences(request, prompts, seeded, chat)
        requests, streams = self._start(request, adapter, prompts, sequences)
        kind = "chatcmpl" if chat else "cmpl"
        response_id = f"{kind}-{uuid.uuid4().hex}"
        usage_prompt = sum(len(p) for p in prompts)
        if request.stream:
            return StreamingResponse(self._stream(request, chat, response_id, requests, streams, usage_prompt),
                                     media_type="text/event-stream")
        try:
            results = await _unless_disconnected(http, asyncio.gather(*(_collect(s) for s in streams)))
        finally:
            self._cancel(requests)
        if results is None:  # the client has gone: its sequences are cancelled, nobody reads an answer
            return Response(status_code=499)
        choices = []
        completion_tokens = 0
        for index, events in enumerate(results):
            text = "".join(e.text for e in events)
            finish = self._finish_reason(events[-1])
            produced = sum(1 for e in events if e.token >= 0)
            completion_tokens += produced
            logprobs = None
            if request.logprobs is not None:
                logprobs = self._chat_logprobs(events) if chat else self._completion_logprobs(events, 0)
            if chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": logprobs, "finish_reason": finish})
            else:
                choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})
        return JSONResponse({
            "id": response_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": request.model, "choices": choices,
            "usage": {"prompt_tokens": usage_prompt, "completion_tokens": completion_tokens,
                      "total_tokens": usage_prompt + completion_tokens}})

    async def _stream(self, request: GenerationRequest, chat: bool, response_id: str, requests: List[int],
                      streams: List[AsyncIterator[TokenEvent]], usage_prompt: int) -> AsyncIterator[str]:
        """Server-sent events: a chunk per token of each choice (chat: a first one with the role),
        the last with its finish reason, a usage chunk when asked, then [DONE]. A client that
        disconnects closes this generator: every choice's request is cancelled at once."""
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        offsets = [0] * len(streams)

        def chunk(choices: List[Dict[str, Any]], **extra) -> str:
            return "data: " + json.dumps({"id": response_id, "object": kind, "created": created,
                                          "model": request.model, "choices": choices, **extra}) + "\n\n"

        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(streams))])
            completion_tokens = 0
            async with contextlib.aclosing(_merged(streams)) as events:
                async for index, event in events:
                    completion_tokens += event.token >= 0
                    finish = None
                    if event.finish_reason is not None:
                        try:
                            finish = self._finish_reason(event)
                        except ApiError as error:
                            yield "data: " + json.dumps(error.body()) + "\n\n"
                            break
                    if not event.text and finish is None and request.logprobs is None:
                        continue
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = self._chat_logprobs([event]) if chat else \
                            self._completion_logprobs([event], offsets[index])
                    offsets[index] += len(event.text)
                    if chat:
                        delta = {"content": event.text} if event.text or finish is None else {}
                        yield chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])
                    else:
                        yield chunk([{"index": index, "text": event.text, "logprobs": logprobs,
                                      "finish_reason": finish}])
                else:
                    if request.include_usage:
                        yield chunk([], usage={"prompt_tokens": usage_prompt, "completion_tokens": completion_tokens,
                                               "total_tokens": usage_prompt + completion_tokens})
            yield "data: [DONE]\n\n"
        finally:
            self._cancel(requests)

    # --- the application ------------------------------------------------------------------------

    def app(self) -> FastAPI:
        app = FastAPI(title="symbiosis-serve", docs_url=None, redoc_url=None, openapi_url=None,
                      lifespan=self._lifespan)

        @app.exception_handler(ApiError)
        async def api_error(_: Request, error: ApiError) -> JSONResponse:
            headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
            return JSONResponse(error.body(), status_code=error.status, headers=headers)

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4")

        @app.get("/v1/models")
        async def models(http: Request) -> JSONResponse:
            allowed = self.keys.models_of(http)
            data = [{"id": name, "object": "model", "created": self.created, "owned_by": "symbiosis",
                     "root": self.checkpoint if name == self.base_name else self.adapter_paths[name],
                     "parent": None if name == self.base_name else self.base_name}
                    for name in self._models(allowed)]
            return JSONResponse({"object": "list", "data": data})

        @app.post("/v1/completions")
        async def completions(http: Request) -> Response:
            return await self.generate(http, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(http: Request) -> Response:
            return await self.generate(http, chat=True)

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(http: Request) -> Response:
            self._require_admin(http)
            fields = parse_adapter_body(await _json_body(http), ("lora_name", "lora_path"))
            name = fields["lora_name"]
            if name in self.adapter_paths:
                raise ApiError(400, f"adapter '{name}' is already loaded (from {self.adapter_paths[name]}); "
                                    "unload it first", param="lora_name")
            await asyncio.get_running_loop().run_in_executor(None, self.load_adapter, name, fields["lora_path"])
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(http: Request) -> Response:
            self._require_admin(http)
            name = parse_adapter_body(await _json_body(http), ("lora_name",))["lora_name"]
            self.unload_adapter(name)
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

        return app

    def _require_admin(self, http: Request) -> None:
        if self.keys.models_of(http) is not None:
            raise ApiError(403, "this API key may not load or unload adapters (a key for every model may)")

    @contextlib.asynccontextmanager
    async def _lifespan(self, _: FastAPI):
        yield
        await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)


def _base_of(adapter_path: str) -> str:
    """", made for BASE" from the adapter's adapter_config.json, for errors ("" when it says none)."""
    try:
        with open(os.path.join(adapter_path, "adapter_config.json")) as f:
            base = json.load(f).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return ""
    return f", made for {base}," if base else ""


async def _json_body(http: Request) -> Any:
    raw = await http.body()
    try:
        return json.loads(raw)
    except ValueError as error:
        raise ApiError(400, f"the request body is not JSON: {error}") from None


async def _unless_disconnected(http: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result, or None (`work` cancelled) once the client has closed its connection, which
    is looked at every DISCONNECT_POLL_S while `work` runs: a non-streaming request's sequences are
    not decoded for a client that has gone."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await http.is_disconnected():
                return None
    finally:
        task.cancel()


async def _merged(streams: List[AsyncIterator[TokenEvent]]) -> AsyncIterator[Tuple[int, TokenEvent]]:
    """(index, event) of every stream's events as they come, until each has ended; leaving early
    closes them all. One stream (n = 1, most requests) is read as it is: each token passes one
    queue less."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]):
            async for event in streams[0]:
                yield 0, event
        return
    merged: "asyncio.Queue[Tuple[int, TokenEvent]]" = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[TokenEvent]) -> None:
        async with contextlib.aclosing(stream):
            async for event in stream:
                await merged.put((index, event))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, event = await merged.get()
            open_streams -= event.finish_reason is not None
            yield index, event
    finally:
        for task in tasks:
            task.cancel()


async def _collect(stream: AsyncIterator[TokenEvent]) -> List[TokenEvent]:
    async with contextlib.aclosing(stream):
        return [event async for event in stream]
