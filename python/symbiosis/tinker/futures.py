"""The Tinker API's futures ([Tinker futures]).

[Tinker futures]
Every operation that computes (create_model, forward_backward, optim_step, save, load, sample)
answers its POST at once with {"request_id": ...}; the SDK then asks POST /retrieve_future for the
result, and asks again at once whenever the answer is {"type": "try_again"}. So retrieve_future
waits for the result itself, up to LONG_POLL_S (under the SDK's 45 s timeout), before it says
try_again: a client waits in one request, not in a loop of them. A result is JSON, or protobuf
bytes for forward_backward and sample ([Tinker wire]); a failure is {"error": message, "category":
"user" | "server"}, which the SDK raises as RequestFailedError with that message. Results are kept
KEEP_S after they are done, so a client that lost an answer can ask again; a request is only ever
answered to the key that made it.
"""
import asyncio
import itertools
import time
from typing import Any, Awaitable, Dict, NamedTuple, Optional, Union

from fastapi.responses import JSONResponse, Response

from .wire import PROTOBUF

LONG_POLL_S = 25.0
KEEP_S = 600.0


class UserError(Exception):
    """What the request asked cannot be done; the message names the field and what it takes."""


class Protobuf(NamedTuple):
    """A result that goes back as protobuf bytes."""

    body: bytes


class _Pending(NamedTuple):
    owner: str
    task: "asyncio.Task"


class Futures:
    def __init__(self) -> None:
        self._pending: Dict[str, _Pending] = {}
        self._done_at: Dict[str, float] = {}
        self._ids = itertools.count(1)

    def start(self, owner: str, work: Awaitable[Union[Dict[str, Any], Protobuf]], **extra: Any) -> Dict[str, Any]:
        """Runs `work` and answers the POST that asked for it: {"request_id", **extra}."""
        self._forget_old()
        request_id = f"req-{next(self._ids)}"
        task = asyncio.ensure_future(work)
        task.add_done_callback(lambda _: self._done_at.__setitem__(request_id, time.monotonic()))
        self._pending[request_id] = _Pending(owner, task)
        return {"request_id": request_id, **extra}

    async def retrieve(self, request_id: str, owner: str) -> Response:
        pending = self._pending.get(request_id)
        if pending is None or pending.owner != owner:
            return JSONResponse({"detail": f"request_id {request_id!r} is not a request of this key's (or it was "
                                 f"answered more than {KEEP_S:.0f} s ago)"}, status_code=404)
        done, _ = await asyncio.wait({pending.task}, timeout=LONG_POLL_S)
        if not done:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        error = pending.task.exception()
        if isinstance(error, UserError):
            return JSONResponse({"error": str(error), "category": "user"})
        if error is not None:
            return JSONResponse({"error": f"{type(error).__name__}: {error}", "category": "server"})
        result = pending.task.result()
        if isinstance(result, Protobuf):
            return Response(result.body, media_type=PROTOBUF)
        return JSONResponse(result)

    def cancel_all(self) -> None:
        for pending in self._pending.values():
            pending.task.cancel()

    def _forget_old(self, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        for request_id, at in list(self._done_at.items()):
            if now - at > KEEP_S:
                del self._done_at[request_id]
                self._pending.pop(request_id, None)
