"""symbiosis-tinker's HTTP API: the Tinker API (`tinker` SDK 0.38, unmodified) over training runs
that are tenants of the shared executor (runs.py) and a sampler per base model (sampler.py).
docs/tinker.md is the user's page.

[Tinker keys]
The SDK sends its key as X-API-Key. With --api-keys FILE ({"KEY": "OWNER", ...}) only those keys
are taken, and a key's owner owns the sessions, runs, checkpoints, sampling sessions and requests
it makes; without it any key is taken (the SDK's own check wants the prefix "tml-") and each key
is its own owner. Another owner's run or checkpoint is answered 404, as one that does not exist:
a key learns nothing of others' runs. Checkpoint files are fetched by URLs signed for the file
(what the SDK's `tinker checkpoint download` fetches without a key).
"""
import asyncio
import contextlib
import hashlib
import hmac
import itertools
import json
import os
import secrets
import shutil
import time
from typing import Any, Dict, List, Optional, Tuple

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse

from . import wire
from .futures import Futures, Protobuf, UserError
from .runs import KINDS, TINKER, Run, Worker, parse_path
from .sampler import BaseModel

MAX_EPHEMERAL = 4  # a run's newest save_weights_and_get_sampling_client weights kept; older ones go
UNSUPPORTED_SAMPLE = ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k", "prompt_logprobs_last_n",
                      "target_prompt_logprobs")


class Service:
    """The API's state: base models, sessions, runs, sampling sessions and requests in flight."""

    def __init__(self, bases: Dict[str, BaseModel], state_dir: str, *, keys: Optional[Dict[str, str]],
                 max_lora_rank: int, session_timeout_s: float = 600.0):
        self.bases = bases
        self.state_dir = state_dir
        self.keys = keys
        self.max_lora_rank = max_lora_rank
        self.futures = Futures()
        self.sessions: Dict[str, str] = {}  # session id -> owner
        self.session_timeout_s = session_timeout_s
        self._last_seen: Dict[str, float] = {}  # session id -> when it last showed itself (monotonic)
        self._expired: set = set()  # sessions ended for silence: their heartbeats are answered 410
        self.runs: Dict[str, Run] = {}
        self.samplers: Dict[str, Tuple[str, str, Optional[str], Optional[str]]] = {}  # id -> owner, base, folder, path
        self._ephemeral: Dict[str, List[str]] = {}  # run id -> its ephemeral sampler folders, oldest first
        self._secret = secrets.token_bytes(32)
        self._session_ids = itertools.count(1)
        self._load_runs()

    # -- keys and ownership ([Tinker keys]) --

    def owner(self, http: Request) -> str:
        key = http.headers.get("x-api-key", "")
        if not key:
            raise HTTPException(401, "this server needs an API key: the tinker SDK sends it as X-API-Key (api_key= "
                                     "or TINKER_API_KEY)")
        if self.keys is None:
            return key
        if key not in self.keys:
            raise HTTPException(401, "the API key is not one this server knows")
        return self.keys[key]

    def run_of(self, run_id: str, owner: str) -> Run:
        run = self.runs.get(run_id)
        if run is None or run.owner != owner:
            raise HTTPException(404, f"there is no training run {run_id!r} of this key's")
        return run

    def new_session(self, owner: str) -> str:
        session_id = f"sess-{secrets.token_hex(4)}{next(self._session_ids)}"
        self.sessions[session_id] = owner
        self._last_seen[session_id] = time.monotonic()
        return session_id

    def session_of(self, session_id: str, owner: str) -> str:
        if session_id in self._expired:
            raise HTTPException(410, f"session {session_id} has ended: not heard from for {self.session_timeout_s:g} s")
        if self.sessions.get(session_id) != owner:
            raise HTTPException(404, f"there is no session {session_id!r} of this key's: create_session first")
        self._last_seen[session_id] = time.monotonic()
        return session_id

    async def end_session(self, session_id: str) -> None:
        """Ends the workers of the session's runs (what they saved stays, and they stay listed)."""
        for run in self.runs.values():
            if run.id.startswith(session_id + ":") and run.worker is not None:
                worker, run.worker = run.worker, None
                await asyncio.to_thread(worker.stop)

    async def expire_sessions(self, every_s: float) -> None:
        """[Session expiry] A session whose client has not shown itself (a heartbeat, which the SDK
        sends every 10 s, or any request naming it) for session_timeout_s is over: its runs' workers
        end, as at ServiceClient.close(), so that a client gone without closing holds no GPU memory."""
        while True:
            await asyncio.sleep(every_s)
            now = time.monotonic()
            for session_id, seen in list(self._last_seen.items()):
                if now - seen > self.session_timeout_s:
                    del self._last_seen[session_id]
                    del self.sessions[session_id]
                    self._expired.add(session_id)
                    await self.end_session(session_id)

    def base_of(self, name: str) -> BaseModel:
        if name not in self.bases:
            raise HTTPException(400, f"base_model {name!r} is not served here; served: {sorted(self.bases)}")
        return self.bases[name]

    def checkpoint(self, path: str, owner: str) -> Tuple[Run, str]:
        """(run, folder) of a tinker:// checkpoint path of the owner's; UserError naming it else."""
        run_id, kind, name = parse_path(path)
        run = self.runs.get(run_id)
        if run is None or run.owner != owner:
            raise UserError(f"there is no checkpoint {path!r} of this key's: no training run {run_id!r}")
        folder = run.checkpoint_folder(kind, name)
        if not os.path.isdir(folder):
            raise UserError(f"there is no checkpoint {path!r}: run {run_id} has "
                            f"{[c['tinker_path'] for c in run.checkpoints()]}")
        return run, folder

    # -- runs --

    def _load_runs(self) -> None:
        """Runs of an earlier life of the server: listed, their checkpoints loadable (their workers
        are gone: what was not saved is lost)."""
        folder = os.path.join(self.state_dir, "runs")
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if os.path.exists(os.path.join(folder, name, "run.json")):
                run = Run.from_record(os.path.join(folder, name))
                self.runs[run.id] = run

    def new_run(self, session_id: str, model_seq_id: Any, owner: str, base_model: str, lora: Dict[str, Any],
                user_metadata: Optional[Dict[str, Any]]) -> Run:
        if not isinstance(model_seq_id, int) or isinstance(model_seq_id, bool) or model_seq_id < 0:
            raise HTTPException(400, f"model_seq_id is {model_seq_id!r}, expected an integer >= 0")
        base = self.base_of(base_model)
        rank = lora.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= self.max_lora_rank:
            raise HTTPException(400, f"lora_config.rank is {rank!r}, expected 1 to {self.max_lora_rank} "
                                     "(--max-lora-rank)")
        if not any(lora.get(k, True) for k in ("train_mlp", "train_attn", "train_unembed")):
            raise HTTPException(400, "lora_config trains nothing: train_mlp, train_attn and train_unembed are all false")
        run_id = f"{session_id}:train:{model_seq_id}"
        if run_id in self.runs:
            raise HTTPException(400, f"model {run_id} exists already (model_seq_id {model_seq_id} is taken)")
        settings = {"rank": rank, "seed": lora.get("seed"), "train_mlp": bool(lora.get("train_mlp", True)),
                    "train_attn": bool(lora.get("train_attn", True)),
                    "train_unembed": bool(lora.get("train_unembed", True))}
        run = Run(run_id, owner, base.name, settings, user_metadata,
                  os.path.join(self.state_dir, "runs", run_id.replace("/", "_")))
        run.save_record()
        self.runs[run_id] = run
        return run

    async def start_worker(self, run: Run) -> None:
        base = self.bases[run.base_model]
        run.worker = Worker(run.id, checkpoint=base.checkpoint, executor=base.executor, tenant=f"tinker {run.id}",
                            **base.worker_settings, **run.lora)
        try:
            info = await run.worker.started()
        except BaseException:
            run.worker.stop()
            run.worker = None
            raise
        # What the worker trains: no unembedding adapter on a tied one ([Tied unembedding], worker.py).
        if info.get("train_unembed") is False and run.lora["train_unembed"]:
            run.lora["train_unembed"] = False
            run.save_record()

    def worker_of(self, run: Run) -> Worker:
        if run.worker is None:
            raise UserError(f"run {run.id} has no worker (its session ended, closed or silent for "
                            f"{self.session_timeout_s:g} s, or the server restarted since): load one of its checkpoints "
                            "into a new training client")
        return run.worker

    def info(self, run: Run) -> Dict[str, Any]:
        base = self.bases.get(run.base_model)
        return {"type": "get_info", "model_id": run.id, "is_lora": True, "lora_rank": run.lora["rank"],
                "model_name": run.base_model,
                "model_data": {"arch": base.model_type if base else "", "model_name": run.base_model,
                               "tokenizer_id": base.checkpoint if base else None}}

    # -- checkpoints --

    @staticmethod
    def new_checkpoint(run: Run, kind: str, name: str, overwrite: bool) -> str:
        """The folder of checkpoint `name`; refused when it exists and `overwrite` is false."""
        folder = run.checkpoint_folder(kind, name)
        if os.path.exists(folder) and not overwrite:
            raise UserError(f"checkpoint {TINKER}{run.id}/{kind}/{name} exists: choose another path or overwrite")
        return folder

    async def save(self, run: Run, kind: str, name: str, optimizer: bool, overwrite: bool) -> str:
        folder = self.new_checkpoint(run, kind, name, overwrite)
        await self.worker_of(run).call("save", folder, optimizer)
        return folder

    async def save_for_sampler(self, run: Run, folder: str) -> None:
        """[Sampler hand-over] Saves the run's adapter to `folder` (kept for download and for
        samplers made later) and loads it into its base's sampler at once from what the run hands
        over in memory: the sampler does not read the files back."""
        contents = await self.worker_of(run).call("save", folder, False, True)
        await self.bases[run.base_model].adapter(folder, contents)

    async def ephemeral_sampler(self, run: Run, session_id: str) -> str:
        """Saves the run's adapter for a new sampling session and loads it into the sampler at once;
        returns its folder. The run keeps its MAX_EPHEMERAL newest ones."""
        folder = os.path.join(run.folder, "ephemeral", session_id.rsplit(":", 1)[-1])
        await self.save_for_sampler(run, folder)
        kept = self._ephemeral.setdefault(run.id, [])
        kept.append(folder)
        while len(kept) > MAX_EPHEMERAL:
            shutil.rmtree(kept.pop(0), ignore_errors=True)
        return folder

    def sign(self, path: str) -> str:
        return hmac.new(self._secret, path.encode(), hashlib.sha256).hexdigest()

    def stop(self) -> None:
        self.futures.cancel_all()
        for run in self.runs.values():
            if run.worker is not None:
                run.worker.stop()
        for base in self.bases.values():
            base.stop()


def app(service: Service) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        expiry = asyncio.ensure_future(service.expire_sessions(min(30.0, service.session_timeout_s / 2)))
        try:
            yield
        finally:
            expiry.cancel()

    api = FastAPI(title="symbiosis-tinker", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    futures = service.futures
    v1 = "/api/v1"

    @api.exception_handler(UserError)
    async def user_error(_: Request, error: UserError) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, status_code=400)

    async def body_of(http: Request) -> Dict[str, Any]:
        try:
            body = json.loads(await http.body() or b"{}")
        except ValueError as error:
            raise HTTPException(400, f"the body is not JSON: {error}") from None
        if not isinstance(body, dict):
            raise HTTPException(400, "the body is not a JSON object")
        return body

    def field(body: Dict[str, Any], name: str, kind=str) -> Any:
        value = body.get(name)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise UserError(f"{name} is {value!r}, expected {'text' if kind is str else kind.__name__}")
        return value

    def in_order(run: Run, body: Dict[str, Any], owner: str, work) -> Dict[str, Any]:
        """Runs `work` as the run's request seq_id ([Run order]). What is wrong with the request is
        found inside `work`, as the request's error: the SDK has taken the turn, and a turn not
        taken here would hold every later request of the run."""
        return run.in_order(field(body, "seq_id", int), lambda w: futures.start(owner, w, model_id=run.id), work)

    def run_request(path: str):
        """Registers POST `path` as a request of the run its model_id names, in the run's order: the
        decorated coroutine function (run, body, owner) computes its result."""
        def register(handler):
            @api.post(v1 + path, name=handler.__name__)
            async def endpoint(http: Request):
                owner = service.owner(http)
                body = await body_of(http)
                run = service.run_of(field(body, "model_id"), owner)
                return in_order(run, body, owner, lambda: handler(run, body, owner))

            return handler

        return register

    # -- the SDK's start-up, sessions, telemetry --

    @api.post(v1 + "/client/config")
    async def client_config(http: Request):
        service.owner(http)
        return {}

    @api.post(v1 + "/client/dynamic_config")
    async def dynamic_config(http: Request):
        service.owner(http)
        return {}

    @api.post(v1 + "/create_session")
    async def create_session(http: Request):
        return {"type": "create_session", "session_id": service.new_session(service.owner(http))}

    @api.post(v1 + "/session_heartbeat")
    async def heartbeat(http: Request):
        owner = service.owner(http)
        service.session_of(field(await body_of(http), "session_id"), owner)
        return {"type": "session_heartbeat"}

    @api.post(v1 + "/sessions/{session_id}/finish")
    async def finish_session(session_id: str, http: Request):
        """ServiceClient.close(): the session's runs end their workers (what they saved stays)."""
        await service.end_session(service.session_of(session_id, service.owner(http)))
        return {}

    @api.post(v1 + "/telemetry")
    async def telemetry(http: Request):
        service.owner(http)
        return {"status": "accepted"}

    @api.get(v1 + "/get_server_capabilities")
    async def capabilities(http: Request):
        service.owner(http)
        return {"supported_models": [b.describe() for b in service.bases.values()]}

    @api.get(v1 + "/healthz")
    async def healthz():
        return {"status": "ok"}

    # -- training --

    @api.post(v1 + "/create_model")
    async def create_model(http: Request):
        owner = service.owner(http)
        body = await body_of(http)
        session_id = service.session_of(field(body, "session_id"), owner)
        lora = body.get("lora_config") or {}
        run = service.new_run(session_id, body.get("model_seq_id"), owner, field(body, "base_model"), lora,
                              body.get("user_metadata"))

        async def work():
            await service.start_worker(run)
            return {"model_id": run.id, "type": "create_model"}

        return futures.start(owner, work(), model_id=run.id)

    @api.post(v1 + "/get_info")
    async def get_info(http: Request):
        owner = service.owner(http)
        return service.info(service.run_of(field(await body_of(http), "model_id"), owner))

    @api.post(v1 + "/forward_backward")
    async def forward_backward(http: Request):
        owner = service.owner(http)
        if http.headers.get("content-encoding", "identity") != "identity":
            raise HTTPException(400, f"Content-Encoding {http.headers['content-encoding']} is not taken here")
        try:
            request = wire.parse_forward_backward(await http.body())
        except ValueError as error:
            raise HTTPException(400, str(error)) from None
        run = service.run_of(request.model_id, owner)

        async def work():
            logprobs, metrics = await service.worker_of(run).call(
                "forward_backward", [tuple(d) for d in request.data], request.loss_fn, request.config,
                request.forward_only)
            return Protobuf(wire.forward_backward_output(logprobs, metrics))

        return run.in_order(request.seq_id, lambda w: futures.start(owner, w, model_id=run.id), work)

    @run_request("/optim_step")
    async def optim_step(run: Run, body: Dict[str, Any], owner: str):
        adam = body.get("adam_params")
        if not isinstance(adam, dict):
            what = "optimizer_params" if "optimizer_params" in body else "adam_params"
            raise UserError(f"{what}: this server's optimizer is AdamW; send AdamParams")
        metrics = await service.worker_of(run).call(
            "optim_step", float(adam.get("learning_rate", 1e-4)), float(adam.get("beta1", 0.9)),
            float(adam.get("beta2", 0.95)), float(adam.get("eps", 1e-12)), float(adam.get("weight_decay", 0.0)),
            float(adam.get("grad_clip_norm", 0.0)))
        return {"metrics": metrics, "type": "optim_step"}

    @run_request("/save_weights")
    async def save_weights(run: Run, body: Dict[str, Any], owner: str):
        name = field(body, "path")
        await service.save(run, "weights", name, True, bool(body.get("overwrite", False)))
        return {"path": f"{TINKER}{run.id}/weights/{name}", "type": "save_weights"}

    @run_request("/save_weights_external")
    async def save_weights_external(run: Run, body: Dict[str, Any], owner: str):
        name = field(body, "path")
        folder = await service.save(run, "external_weights", name, False, True)
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        return {"path": f"{TINKER}{run.id}/external_weights/{name}", "size_bytes": size}

    def loadable(body: Dict[str, Any], owner: str) -> Tuple[Run, str, bool]:
        """(the run it was saved by, the folder, with the optimizer) of a load_weights request."""
        path = field(body, "path")
        source, folder = service.checkpoint(path, owner)
        optimizer = bool(body.get("optimizer", False))
        if optimizer and not os.path.exists(os.path.join(folder, "optimizer.pt")):
            raise UserError(f"checkpoint {path} holds no optimizer state (a sampler or external save): load it "
                            "without the optimizer, or load a save_state checkpoint")
        return source, folder, optimizer

    @api.post(v1 + "/load_weights")
    async def load_weights(http: Request):
        owner = service.owner(http)
        body = await body_of(http)
        if "model_id" in body:  # onto an existing run (TrainingClient.load_state)
            run = service.run_of(field(body, "model_id"), owner)

            async def onto():
                source, folder, optimizer = loadable(body, owner)
                if run.lora != source.lora or run.base_model != source.base_model:
                    raise UserError(f"checkpoint {body['path']} is of another shape (base {source.base_model}, LoRA "
                                    f"{source.lora}) than run {run.id} (base {run.base_model}, LoRA {run.lora})")
                await service.worker_of(run).call("load", folder, optimizer)
                return {"path": body["path"], "type": "load_weights"}

            return in_order(run, body, owner, onto)
        source, folder, optimizer = loadable(body, owner)
        session_id = service.session_of(field(body, "session_id"), owner)
        run = service.new_run(session_id, body.get("model_seq_id"), owner, source.base_model, source.lora,
                              body.get("user_metadata") or source.user_metadata)

        async def new():
            await service.start_worker(run)
            await run.worker.call("load", folder, optimizer)
            return {"path": body["path"], "model_id": run.id, "type": "load_weights"}

        return futures.start(owner, new(), model_id=run.id)

    @run_request("/save_weights_for_sampler")
    async def save_weights_for_sampler(run: Run, body: Dict[str, Any], owner: str):
        if body.get("path") is not None:
            name = field(body, "path")
            folder = service.new_checkpoint(run, "sampler_weights", name, bool(body.get("overwrite", False)))
            await service.save_for_sampler(run, folder)
            return {"path": f"{TINKER}{run.id}/sampler_weights/{name}", "type": "save_weights_for_sampler"}
        session_id = f"{run.id.split(':train:')[0]}:sample:{field(body, 'sampling_session_seq_id', int)}"
        folder = await service.ephemeral_sampler(run, session_id)
        service.samplers[session_id] = (owner, run.base_model, folder, None)
        return {"sampling_session_id": session_id, "type": "save_weights_for_sampler"}

    # -- sampling --

    @api.post(v1 + "/create_sampling_session")
    async def create_sampling_session(http: Request):
        owner = service.owner(http)
        body = await body_of(http)
        session_id = service.session_of(field(body, "session_id"), owner)
        sampler_id = f"{session_id}:sample:{field(body, 'sampling_session_seq_id', int)}"
        if body.get("model_path") is not None:
            run, folder = service.checkpoint(field(body, "model_path"), owner)
            service.samplers[sampler_id] = (owner, run.base_model, folder, body["model_path"])
        else:
            base = service.base_of(field(body, "base_model"))
            service.samplers[sampler_id] = (owner, base.name, None, None)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @api.get(v1 + "/samplers/{sampler_id}")
    async def sampler(sampler_id: str, http: Request):
        owner = service.owner(http)
        found = service.samplers.get(sampler_id)
        if found is None or found[0] != owner:
            raise HTTPException(404, f"there is no sampler {sampler_id!r} of this key's")
        return {"sampler_id": sampler_id, "base_model": found[1], "model_path": found[3]}

    @api.post(v1 + "/asample")
    async def asample(http: Request):
        owner = service.owner(http)
        body = await body_of(http)
        if body.get("sampling_session_id") is not None:
            found = service.samplers.get(field(body, "sampling_session_id"))
            if found is None or found[0] != owner:
                raise HTTPException(404, f"there is no sampling session {body['sampling_session_id']!r} of this key's")
            _, base_name, folder, _ = found
        elif body.get("model_path") is not None:
            run, folder = service.checkpoint(field(body, "model_path"), owner)
            base_name = run.base_model
        else:
            base_name, folder = service.base_of(field(body, "base_model")).name, None
        base = service.bases[base_name]
        for name in UNSUPPORTED_SAMPLE:
            if body.get(name) not in (None, 0, False):
                raise HTTPException(400, f"{name}: this server does not compute it (it gives each sampled token's "
                                         "log-probability, and prompt log-probabilities with prompt_logprobs)")
        try:
            prompt = wire.chunk_tokens(body.get("prompt"))
        except ValueError as error:
            raise HTTPException(400, str(error)) from None
        num_samples = body.get("num_samples", 1)
        if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
            raise HTTPException(400, f"num_samples is {num_samples!r}, expected an integer >= 1")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise HTTPException(400, "sampling_params is not an object")
        with_prompt_logprobs = bool(body.get("prompt_logprobs", False))

        async def work():
            sequences = await base.sample(folder, prompt, num_samples, params)
            scored = await base.prompt_logprobs(folder, prompt) if with_prompt_logprobs else []
            return Protobuf(wire.sample_response(sequences, scored))

        tag = f"{body.get('sampling_session_id') or base_name}:{body.get('seq_id', 0)}"
        return futures.start(owner, work(), sample_sequence_ids=[f"{tag}:{i}" for i in range(num_samples)])

    @api.post(v1 + "/retrieve_future")
    async def retrieve_future(http: Request):
        owner = service.owner(http)
        return await futures.retrieve(field(await body_of(http), "request_id"), owner)

    # -- runs and checkpoints (RestClient) --

    def page(http: Request, items: List[Any], default_limit: int) -> Tuple[List[Any], Dict[str, int]]:
        try:
            limit = int(http.query_params.get("limit", default_limit))
            offset = int(http.query_params.get("offset", 0))
        except ValueError:
            raise HTTPException(400, "limit and offset are integers") from None
        return items[offset:offset + limit], {"offset": offset, "limit": limit, "total_count": len(items)}

    @api.get(v1 + "/training_runs")
    async def training_runs(http: Request):
        owner = service.owner(http)
        mine = [r.describe() for r in service.runs.values() if r.owner == owner]
        items, cursor = page(http, mine, 20)
        return {"training_runs": items, "cursor": cursor}

    @api.get(v1 + "/training_runs/{run_id}")
    async def training_run(run_id: str, http: Request):
        return service.run_of(run_id, service.owner(http)).describe()

    @api.get(v1 + "/training_runs/{run_id}/checkpoints")
    async def run_checkpoints(run_id: str, http: Request):
        return {"checkpoints": service.run_of(run_id, service.owner(http)).checkpoints(), "cursor": None}

    @api.get(v1 + "/checkpoints")
    async def checkpoints(http: Request):
        owner = service.owner(http)
        mine = [c for r in service.runs.values() if r.owner == owner for c in r.checkpoints()]
        items, cursor = page(http, mine, 100)
        return {"checkpoints": items, "cursor": cursor}

    @api.get(v1 + "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    async def weights_urls(run_id: str, checkpoint_id: str, http: Request):
        owner = service.owner(http)
        _, folder = service.checkpoint(f"{TINKER}{run_id}/{checkpoint_id}", owner)
        base_url = str(http.base_url).rstrip("/")
        urls = {}
        for name in sorted(os.listdir(folder)):
            relative = f"{run_id}/{checkpoint_id}/{name}"
            urls[name] = f"{base_url}{v1}/files/{relative}?signature={service.sign(relative)}"
        expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 3600))
        return {"urls": urls, "expires": expires}

    @api.get(v1 + "/files/{relative:path}")
    async def files(relative: str, signature: str = ""):
        if not hmac.compare_digest(signature, service.sign(relative)):
            raise HTTPException(403, "the URL's signature does not match: ask external_weights_urls for one")
        run_id, kind, name, file = (relative.split("/") + ["", "", "", ""])[:4]
        run = service.runs.get(run_id)
        if run is None or kind not in KINDS:
            raise HTTPException(404, f"no file {relative}")
        path = os.path.join(run.checkpoint_folder(kind, name), file)
        if not os.path.isfile(path):
            raise HTTPException(404, f"no file {relative}")
        return FileResponse(path)

    @api.delete(v1 + "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str, http: Request):
        run = service.run_of(run_id, service.owner(http))
        try:
            run.delete_checkpoint(checkpoint_id)
        except KeyError:
            raise HTTPException(404, f"run {run_id} has no checkpoint {checkpoint_id!r}") from None
        return {}

    @api.post(v1 + "/weights_info")
    async def weights_info(http: Request):
        owner = service.owner(http)
        run, _ = service.checkpoint(field(await body_of(http), "tinker_path"), owner)
        return {"base_model": run.base_model, "is_lora": True, "lora_rank": run.lora["rank"],
                "train_unembed": run.lora["train_unembed"], "train_mlp": run.lora["train_mlp"],
                "train_attn": run.lora["train_attn"]}

    @api.api_route(v1 + "/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def not_implemented(rest: str, http: Request):
        return JSONResponse({"detail": f"symbiosis-tinker does not implement {http.method} {v1}/{rest}"},
                            status_code=404)

    return api
