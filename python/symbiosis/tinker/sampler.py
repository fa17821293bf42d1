"""Sampling for symbiosis-tinker: each base model's serving Engine (symbiosis-serve's,
[Serving engine]), in which every run's sampler weights are adapters of one batch
([Tinker sampling]).

[Tinker sampling]
A base model has one Engine, a tenant of its executor: a sample of any run, of any key, joins the
same decode steps as every other ([Multi-adapter batches]), each row with its own adapter. An
adapter is loaded into it when first sampled (save_weights_for_sampler loads it at once, so the
run's next sample does not wait) and the least recently sampled ones leave when max_loras are
held; a folder sampled again is loaded again. Prompt log-probabilities (compute_logprobs,
include_prompt_logprobs) are a forward pass, which the decode-only Engine does not give: a scoring
worker per LoRA shape (worker.py, a tenant of its own) loads the adapter and returns the
log-probability of each prompt token after the first.
"""
import asyncio
import collections
import functools
import json
import math
import os
import random
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..client import Error
from ..serve.engine import Engine, SamplingParams
from .futures import UserError
from .runs import Worker
from .wire import SampledSequence

WAIT_FOR_SLOT_S = 30.0


class BaseModel:
    """A served base model: its checkpoint, its executor and its sampler."""

    def __init__(self, name: str, checkpoint: str, executor: str, engine: Engine, *, max_model_len: int,
                 max_loras: int, eos_token_ids: Sequence[int], vocab_size: int, model_type: str,
                 worker_settings: Dict[str, Any]):
        self.name = name
        self.checkpoint = checkpoint
        self.executor = executor
        self.engine = engine
        self.max_model_len = max_model_len
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.model_type = model_type
        self.worker_settings = worker_settings  # device, dtype: what every worker of this base gets
        self._max_loras = max_loras
        self._adapters: "collections.OrderedDict[str, str]" = collections.OrderedDict()  # folder -> engine name
        self._loading = asyncio.Lock()
        self._names = 0
        self._scorers: Dict[Tuple, Worker] = {}
        self._scorer_adapter: Dict[Tuple, Optional[str]] = {}
        self._scoring = asyncio.Lock()

    def describe(self) -> Dict[str, Any]:
        return {"model_name": self.name, "max_context_length": self.max_model_len, "trainable": True,
                "sampleable": True}

    async def adapter(self, folder: Optional[str], contents: Optional[Dict[str, Any]] = None) -> str:
        """The Engine's name of the adapter in `folder` (loaded now if it is not); "" for the base.
        contents: what the run that just saved `folder` handed over (TrainingRun.save's hand_over):
        loaded from memory rather than read back ([Sampler hand-over])."""
        if folder is None:
            return ""
        async with self._loading:
            if folder in self._adapters:
                if contents is None:
                    self._adapters.move_to_end(folder)
                    return self._adapters[folder]
                # Saved again over the same path (overwrite): its requests so far finish on the old.
                self.engine.unload_adapter(self._adapters.pop(folder))
            if contents is None and not os.path.isdir(folder):
                raise UserError(f"the sampler weights {folder} are gone (deleted, or an ephemeral save replaced by "
                                "newer ones of its run)")
            while len(self._adapters) >= self._max_loras:
                _, name = self._adapters.popitem(last=False)
                self.engine.unload_adapter(name)
            self._names += 1
            name = f"weights-{self._names}"
            if contents is None:
                load = functools.partial(self.engine.load_adapter, name, folder)
            else:
                load = functools.partial(self.engine.load_adapter_contents, name, folder, contents["config_json"],
                                         contents["tensors"])
            deadline = asyncio.get_running_loop().time() + WAIT_FOR_SLOT_S
            while True:
                try:
                    await asyncio.to_thread(load)
                    break
                except Error as error:
                    # An unloaded adapter's slot is free once its last request ends.
                    if "max_loras" not in str(error) or asyncio.get_running_loop().time() > deadline:
                        raise UserError(f"the sampler weights {folder} do not load: {error}") from None
                    await asyncio.sleep(0.05)
            self._adapters[folder] = name
            return name

    async def sample(self, folder: Optional[str], prompt: List[int], num_samples: int,
                     params: Dict[str, Any]) -> List[SampledSequence]:
        """num_samples sequences after `prompt`, with the adapter in `folder` (None: the base);
        params: the SDK's SamplingParams (max_tokens, seed, stop, temperature, top_k, top_p)."""
        name = await self.adapter(folder)
        stop = params.get("stop")
        stop_strings: List[str] = []
        stop_ids: List[int] = []
        if stop is None:
            stop_ids = list(self.eos_token_ids)  # no stop given: the model's end, as generate
        elif isinstance(stop, str):
            stop_strings = [stop]
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            stop_strings = list(stop)
        elif isinstance(stop, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
            stop_ids = list(stop)
        else:
            raise UserError(f"sampling_params.stop is {stop!r}, expected a string, a list of strings or a list of "
                            "token ids")
        max_tokens = params.get("max_tokens")
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt)
        seed = params.get("seed")
        seed = random.getrandbits(31) if seed is None else int(seed)
        top_k = int(params.get("top_k", -1))
        streams = []
        try:
            for i in range(num_samples):
                sampling = SamplingParams(max_new_tokens=int(max_tokens), temperature=float(params.get("temperature", 1.0)),
                                          top_k=0 if top_k < 0 else top_k, top_p=float(params.get("top_p", 1.0)),
                                          seed=seed + i, stop_token_ids=stop_ids, stop=stop_strings, logprobs=True)
                streams.append(self.engine.stream(prompt, sampling, adapter=name))
        except Error as error:
            for s in streams:
                self.engine.cancel(s.request)
            raise UserError(_field_names(str(error))) from None
        return list(await asyncio.gather(*(_collect(s.events) for s in streams)))

    async def prompt_logprobs(self, folder: Optional[str], prompt: List[int]) -> List[float]:
        """log p(prompt[t] | prompt[:t]) for t >= 1, NaN first, under the adapter in `folder`."""
        if len(prompt) < 2:
            return [math.nan] * len(prompt)
        lora = _lora_of(folder)
        key = tuple(sorted(lora.items()))
        async with self._scoring:
            scorer = self._scorers.get(key)
            if scorer is None:
                scorer = Worker(f"scorer {self.name} {key}", checkpoint=self.checkpoint, executor=self.executor,
                                tenant="tinker-scorer", **self.worker_settings, **lora)
                await scorer.started()
                self._scorers[key] = scorer
                self._scorer_adapter[key] = None
            if folder is not None and self._scorer_adapter[key] != folder:
                await scorer.call("load", folder, False)
                self._scorer_adapter[key] = folder
            datum = (prompt[:-1], {"target_tokens": np.asarray(prompt[1:], np.int64),
                                   "weights": np.zeros(len(prompt) - 1, np.float32)})
            logprobs, _ = await scorer.call("forward_backward", [datum], "cross_entropy", {}, True)
        return [math.nan] + [float(x) for x in logprobs[0]]

    def stop(self) -> None:
        for scorer in self._scorers.values():
            scorer.stop()
        self.engine.shutdown()


def _lora_of(folder: Optional[str]) -> Dict[str, Any]:
    """The LoRA shape a scorer needs for `folder`'s adapter (its tinker.json); the base: the
    smallest, whose B is zero (PEFT's initialization), so it computes the base alone."""
    if folder is None:
        return {"rank": 1, "seed": 0, "train_mlp": False, "train_attn": True, "train_unembed": False}
    with open(os.path.join(folder, "tinker.json")) as f:
        saved = json.load(f)
    return {k: saved[k] for k in ("rank", "seed", "train_mlp", "train_attn", "train_unembed")}


def _field_names(message: str) -> str:
    """The Engine's refusals name its own fields; the SDK's user knows them by these names."""
    return message.replace("prompt_ids", "prompt.chunks' tokens").replace("max_new_tokens", "max_tokens")


async def _collect(events) -> SampledSequence:
    tokens: List[int] = []
    logprobs: List[float] = []
    finish = None
    async for event in events:
        if event.token >= 0:
            tokens.append(event.token)
            logprobs.append(event.logprob)
        finish = event.finish_reason
        if finish == "error":
            raise RuntimeError(f"sampling failed: {event.error}")
        if finish == "cancelled":
            raise RuntimeError("sampling was cancelled: the server is shutting down")
    return SampledSequence(tokens, logprobs, stopped=finish == "stop")
