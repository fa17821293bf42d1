"""Training runs: each a tenant of the executor in a process of its own ([A process per run]), its
requests run in the order the SDK numbered them ([Run order]), its checkpoints in the state folder.

[A process per run]
A run's adapter, optimizer state and autograd live in a worker process (worker.py, forked from
multiprocessing's fork server on a CPU, spawned on a GPU: [Forked workers]), which connects to the
executor as a tenant of its own. A run that fails
(out of memory, a crash, a kill) ends its own process only: its requests fail naming the exit, and
every other run, the sampler and the server go on. The cost is a process and its connection per
run (on a GPU, a CUDA context of a few hundred MiB; no base weights: [Base never in the tenant]).
Threads in the server's process would share its fate, and one tenant for all runs would put their
adapters in one autograd graph and one failure domain; the executor already batches the runs'
calls together, which is what sharing the base needs.

[Run order]
The SDK numbers each run's requests (seq_id 1, 2, ...) and sends them concurrently (a
forward_backward's chunks in parallel, optim_step before the forward_backward has answered); the
run executes them strictly in that order. A request sent again with a seq_id already taken (the
SDK retries submissions) gets the first one's request id instead of running twice.
"""
import asyncio
import concurrent.futures
import datetime
import json
import multiprocessing
import os
import shutil
from typing import Any, Awaitable, Callable, Dict, List, Optional

from . import worker
from .futures import UserError

TINKER = "tinker://"
KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


_fork_server = None


def _worker_context(device: str):
    """[Forked workers] Workers of CPU runs are forked from multiprocessing's fork server, which has
    imported worker.py, torch, transformers and PEFT once: a run's process starts in milliseconds
    instead of the ~4 s those imports take. The fork server is a fresh process (not a fork of this
    threaded one). Workers of GPU runs are spawned: a fork server that had touched CUDA (a library
    asking at import whether a GPU exists) would hand its workers a CUDA they cannot use, and that
    is not yet ruled out on the GPU machine."""
    global _fork_server
    if str(device).startswith("cuda"):
        return multiprocessing.get_context("spawn")
    if _fork_server is None:
        _fork_server = multiprocessing.get_context("forkserver")
        _fork_server.set_forkserver_preload(["symbiosis.tinker.worker", "transformers", "peft"])
    return _fork_server


class Worker:
    """A run's worker process and the one thread of this process that talks to it."""

    def __init__(self, name: str, **settings: Any):
        self.name = name
        context = _worker_context(settings.get("device", "cpu"))
        self._connection, theirs = context.Pipe()
        self.process = context.Process(target=worker.serve, args=(theirs,), kwargs=settings, daemon=True,
                                       name=f"symbiosis-tinker {name}")
        self.process.start()
        theirs.close()
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"run {name}")
        self.info: Dict[str, Any] = {}

    async def started(self) -> Dict[str, Any]:
        """Waits for the worker's model; raises what it failed with."""
        self.info = await self._in_thread(self._receive)
        return self.info

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return await self._in_thread(self._exchange, (method, args, kwargs))

    def stop(self) -> None:
        try:
            self._connection.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
        self._thread.shutdown(wait=False)

    async def _in_thread(self, function: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, function, *args)

    def _exchange(self, message) -> Any:
        try:
            self._connection.send(message)
        except (OSError, ValueError):
            raise RuntimeError(self._ended()) from None
        return self._receive()

    def _receive(self) -> Any:
        try:
            reply = self._connection.recv()
        except (EOFError, OSError):
            raise RuntimeError(self._ended()) from None
        if reply[0] == "error":
            _, category, message = reply
            raise (UserError if category == "user" else RuntimeError)(message)
        return reply[1]

    def _ended(self) -> str:
        self.process.join(timeout=5)
        return (f"the worker process of run {self.name} has ended (exit code {self.process.exitcode}): the run's "
                "adapter since its last save is lost; load a checkpoint into a new training client")


class Run:
    """One training run (a LoRA adapter of a base model with its optimizer), owned by one key."""

    def __init__(self, run_id: str, owner: str, base_model: str, lora: Dict[str, Any],
                 user_metadata: Optional[Dict[str, Any]], folder: str):
        self.id = run_id
        self.owner = owner
        self.base_model = base_model
        self.lora = lora  # rank, seed, train_mlp, train_attn, train_unembed
        self.user_metadata = user_metadata
        self.folder = folder
        self.last_request_time = now_iso()
        self.worker: Optional[Worker] = None
        self._next_seq = 1
        self._turns: Dict[int, asyncio.Future] = {}
        self._requests: Dict[int, Dict[str, Any]] = {}  # seq_id -> the answer its first submission got

    def in_order(self, seq_id: int, start: Callable[[Awaitable[Any]], Dict[str, Any]],
                 work: Callable[[], Awaitable[Any]]) -> Dict[str, Any]:
        """Starts `work` (through `start`, Futures.start) once every earlier seq_id has run
        ([Run order]); returns start's answer, or the first one's for a seq_id sent again."""
        if seq_id in self._requests:
            return self._requests[seq_id]
        if seq_id < self._next_seq:
            raise UserError(f"seq_id {seq_id} of run {self.id} has run already (the next is {self._next_seq})")
        self.last_request_time = now_iso()
        turn = self._turn(seq_id)

        async def ordered():
            await turn
            try:
                return await work()
            finally:
                self._advance()

        self._requests[seq_id] = start(ordered())
        return self._requests[seq_id]

    def _turn(self, seq_id: int) -> asyncio.Future:
        turn = asyncio.get_running_loop().create_future()
        self._turns[seq_id] = turn
        if seq_id == self._next_seq:
            turn.set_result(None)
        return turn

    def _advance(self) -> None:
        self._turns.pop(self._next_seq, None)
        self._requests = {s: r for s, r in self._requests.items() if s >= self._next_seq - 64}
        self._next_seq += 1
        turn = self._turns.get(self._next_seq)
        if turn is not None and not turn.done():
            turn.set_result(None)

    # -- checkpoints: state_dir/runs/<run id>/<weights|sampler_weights|external_weights>/<name>/ --

    def checkpoint_folder(self, kind: str, name: str) -> str:
        if not name or "/" in name or name in (".", ".."):
            raise UserError(f"path {name!r} is not a checkpoint name (one path segment, no '/')")
        return os.path.join(self.folder, kind, name)

    def checkpoints(self) -> List[Dict[str, Any]]:
        found = []
        for kind, checkpoint_type in KINDS.items():
            folder = os.path.join(self.folder, kind)
            for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
                path = os.path.join(folder, name)
                size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
                found.append({
                    "checkpoint_id": f"{kind}/{name}", "checkpoint_type": checkpoint_type,
                    "time": datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.timezone.utc)
                    .isoformat().replace("+00:00", "Z"),
                    "tinker_path": f"{TINKER}{self.id}/{kind}/{name}", "size_bytes": size, "public": False})
        return sorted(found, key=lambda c: c["time"])

    def delete_checkpoint(self, checkpoint_id: str) -> None:
        kind, _, name = checkpoint_id.partition("/")
        if kind not in KINDS:
            raise UserError(f"checkpoint_id {checkpoint_id!r} is not KIND/NAME with KIND one of {sorted(KINDS)}")
        folder = self.checkpoint_folder(kind, name)
        if not os.path.isdir(folder):
            raise KeyError(checkpoint_id)
        shutil.rmtree(folder)

    def describe(self) -> Dict[str, Any]:
        """The SDK's TrainingRun."""
        checkpoints = self.checkpoints()
        last = lambda kind: next((c for c in reversed(checkpoints) if c["checkpoint_type"] == kind), None)
        return {"training_run_id": self.id, "base_model": self.base_model, "model_owner": self.owner,
                "is_lora": True, "corrupted": False, "lora_rank": self.lora["rank"],
                "last_request_time": self.last_request_time, "last_checkpoint": last("training"),
                "last_sampler_checkpoint": last("sampler"), "user_metadata": self.user_metadata}

    def save_record(self) -> None:
        """run.json: what lists the run and loads its checkpoints after a restart of the server."""
        os.makedirs(self.folder, exist_ok=True)
        with open(os.path.join(self.folder, "run.json"), "w") as f:
            json.dump({"id": self.id, "owner": self.owner, "base_model": self.base_model, "lora": self.lora,
                       "user_metadata": self.user_metadata, "last_request_time": self.last_request_time}, f)

    @classmethod
    def from_record(cls, folder: str) -> "Run":
        with open(os.path.join(folder, "run.json")) as f:
            record = json.load(f)
        run = cls(record["id"], record["owner"], record["base_model"], record["lora"], record["user_metadata"], folder)
        run.last_request_time = record["last_request_time"]
        return run


def parse_path(path: str):
    """(run id, kind, name) of tinker://RUN/KIND/NAME; UserError naming it otherwise."""
    parts = path[len(TINKER):].split("/") if isinstance(path, str) and path.startswith(TINKER) else []
    if len(parts) != 3 or parts[1] not in KINDS or not parts[0] or not parts[2]:
        raise UserError(f"path {path!r} is not a checkpoint path: expected tinker://RUN_ID/KIND/NAME with KIND one "
                        f"of {sorted(KINDS)}")
    return parts[0], parts[1], parts[2]
