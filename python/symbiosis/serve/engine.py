"""The serving engine for asyncio: the C++ runtime's Generator stepping on its own thread
([Serving engine] in python/serving_binding.cpp), each request's tokens an async stream.

    engine = Engine("/models/llama", client, max_sequences=16, max_tokens=2048)
    engine.load_adapter("alice", "runs/alice/adapter")
    async for event in engine.stream([1, 15043], SamplingParams(max_new_tokens=8), adapter="alice").events:
        print(event.token, event.text, event.finish_reason)
"""
import asyncio
import dataclasses
import threading
import weakref
from typing import AsyncIterator, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .. import _C
from ..client import Client


class TokenEvent(NamedTuple):
    """One event of a request: a produced token (-1 for an end without one: "cancelled" or "error"),
    its log-probability (when asked), the most likely tokens at its place as (id, log-probability)
    (when asked), the text it makes final, and, on its last event, why it ended ("stop", "length",
    "cancelled", "error") and the error."""

    token: int
    logprob: float
    top_logprobs: List[Tuple[int, float]]
    text: str
    finish_reason: Optional[str]
    error: str


@dataclasses.dataclass
class SamplingParams:
    """How one request generates (client_runtime/inference/sampling.h): temperature 0 is greedy;
    top_k 0 takes every token; stop_token_ids and stop (strings, [Stop strings]) end it, the stop
    string left out of the text; logprobs asks each token's log-probability, top_logprobs the most
    likely tokens' too."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: Sequence[int] = ()
    stop: Sequence[str] = ()
    logprobs: bool = False
    top_logprobs: int = 0


class Stream(NamedTuple):
    """A request submitted by Engine.stream: its id (for Engine.cancel) and its events."""

    request: int
    events: AsyncIterator[TokenEvent]


class Engine:
    """A Generator of `checkpoint`'s model, split over `client` (None: monolithic), serving the base
    and the adapters loaded into it in the same batches ([Multi-adapter batches]). Its methods may
    be called from any thread; stream() from an asyncio event loop. Raises symbiosis.Error naming
    what is wrong."""

    def __init__(self, checkpoint: str, client: Optional[Client], *, device: str = "cpu", dtype: str = "fp32",
                 max_sequences: int = 16, max_tokens: int = 2048, max_waiting: int = 4096, max_loras: int = 8,
                 max_lora_rank: int = 64, capture_decode: bool = True, decode_halves: bool = False):
        self._native = _C.ServingEngine(str(checkpoint), client._native if client is not None else None, device,
                                        dtype, max_sequences, max_tokens, max_waiting, max_loras, max_lora_rank,
                                        capture_decode, decode_halves)
        self._streams = _Streams(self._native)
        # The stepping thread stops when this Engine goes, or at the interpreter's exit at the latest.
        self._shutdown = weakref.finalize(self, self._streams.close)

    def load_adapter(self, name: str, path: str) -> None:
        """Serves the LoRA adapter at `path` (a PEFT folder, or a symbiosis-finetune run or checkpoint
        folder: its newest adapter) as `name` from the next step on."""
        self._native.load_adapter(name, str(path))

    def load_adapter_contents(self, name: str, folder: str, config_json: str, tensors: Dict[str, torch.Tensor]) -> None:
        """The same from an adapter's files' contents in memory, as a trainer that just wrote them
        to `folder` hands them over: `config_json` (adapter_config.json) and `tensors` (those of
        adapter_model.safetensors, by name, on the CPU). Checked as the files would be; messages
        name `folder`."""
        self._native.load_adapter_contents(name, str(folder), config_json, tensors)

    def unload_adapter(self, name: str) -> None:
        """Forgets `name`; its requests already submitted finish on it."""
        self._native.unload_adapter(name)

    @property
    def adapters(self) -> List[str]:
        return list(self._native.adapters)

    @property
    def running(self) -> int:
        """Requests holding a cache slot, as of the last step."""
        return self._native.running

    @property
    def waiting(self) -> int:
        """Requests submitted and waiting for a cache slot."""
        return self._native.waiting

    def shutdown(self) -> None:
        """Ends every request ("cancelled") and stops the stepping thread."""
        self._shutdown()

    def cancel(self, request: int) -> None:
        """Ends the request at the next step boundary (its last event "cancelled"); finished or
        unknown ids are ignored."""
        self._native.cancel(request)

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams, adapter: str = "") -> "Stream":
        """Submits the request at once (raising symbiosis.Error when it is refused); its events come
        as they are produced through the Stream's events, the last with finish_reason set. Called in
        a running event loop. Leaving the iteration early (a client gone) cancels the request, which
        frees its cache slot at the next step boundary."""
        request, events = self._streams.open(
            self._native.submit, [int(t) for t in prompt_ids], adapter, params.max_new_tokens, params.temperature,
            params.top_k, params.top_p, params.seed, [int(t) for t in params.stop_token_ids], list(params.stop),
            params.logprobs, params.top_logprobs)
        return Stream(request, self._events(request, events))

    async def _events(self, request: int, events: "asyncio.Queue[TokenEvent]") -> AsyncIterator[TokenEvent]:
        finished = False
        try:
            while not finished:
                event = await events.get()
                finished = event.finish_reason is not None
                yield event
        finally:
            if not finished:
                self._streams.leave(request)
                self._native.cancel(request)


class _Streams:
    """[Serving engine] (python/serving_binding.cpp): the streams waiting for an engine's events, by
    request id, each with its event loop and queue; and the loop that watches the engine's
    notify_fd and hands the events out (the last loop to open a stream). The lock keeps a
    request's events from being taken before its stream is known."""

    def __init__(self, native):
        self._native = native
        self._lock = threading.Lock()
        self._waiting: Dict[int, Tuple[asyncio.AbstractEventLoop, "asyncio.Queue[TokenEvent]"]] = {}
        self._watching: Optional[asyncio.AbstractEventLoop] = None

    def open(self, submit, *request) -> Tuple[int, "asyncio.Queue[TokenEvent]"]:
        """Submits a request (submit(*request) returns its id) from the running loop, whose queue
        gets its events."""
        loop = asyncio.get_running_loop()
        if self._watching is not loop:
            self._unwatch()
            loop.add_reader(self._native.notify_fd, self.take)
            self._watching = loop
        events: "asyncio.Queue[TokenEvent]" = asyncio.Queue()
        with self._lock:
            request_id = submit(*request)
            self._waiting[request_id] = (loop, events)
        return request_id, events

    def leave(self, request: int) -> None:
        with self._lock:
            self._waiting.pop(request, None)

    def take(self) -> None:
        """Every event waiting, to its stream's queue (on the watching loop)."""
        with self._lock:
            for request, *fields in self._native.take_events():
                event = TokenEvent(*fields)
                stream = self._waiting.get(request)
                if stream is None:  # its stream was left: nobody waits for it
                    continue
                if event.finish_reason is not None:
                    del self._waiting[request]
                loop, queue = stream
                if loop is self._watching:
                    queue.put_nowait(event)
                elif not loop.is_closed():
                    loop.call_soon_threadsafe(queue.put_nowait, event)

    def close(self) -> None:
        """Stops the stepping thread: every request left ends "cancelled", and its stream is told."""
        self._native.shutdown()
        loop = self._watching
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._last_events)
            except RuntimeError:  # closed meanwhile
                pass

    def _last_events(self) -> None:
        self.take()
        self._unwatch()

    def _unwatch(self) -> None:
        loop, self._watching = self._watching, None
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._stop_watching, loop)
        except RuntimeError:  # closed meanwhile
            pass

    def _stop_watching(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._watching is not loop:  # unless it watches again since
            loop.remove_reader(self._native.notify_fd)
