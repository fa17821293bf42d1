"""One Tinker training run: a LoRA adapter over a base model whose linear layers the shared executor
computes, its AdamW state, and Tinker's forward_backward / optim_step / save / load on them.

A TrainingRun is meant to live in a process of its own (`serve`, a multiprocessing entry point):
each run holds its own transformers model, autograd graph and optimizer, and a crash or a leak in
one run stays there. The service process talks to it over a Pipe ([Training run protocol]).

[Tinker training semantics] What a Tinker client relies on:
- forward_backward accumulates gradients; only optim_step applies and clears them (the cookbook's
  RL loop sends several forward_backwards per optim_step).
- Losses are summed over tokens and datums (losses.py, [Tinker losses]); each datum's
  target_tokens[t] is the token after model_input[t], so both have the same length N.
- The adapter is LoRA of rank r, alpha 32 (the cookbook's documented default, tinker_cookbook/
  weights/README.md "LoRA Rank and Alpha"), no dropout, B initialized to zero; AdamW with
  decoupled weight decay whose hyper-parameters come with every optim_step (AdamParams).
"""
import contextlib
import json
import math
import os
import sys
import traceback
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401 - a Pipe then passes tensors in shared memory, not copied

import symbiosis
from symbiosis.tinker import losses

# Tinker's documented default alpha (tinker_cookbook/weights/README.md: lora_alpha 32), the scale
# of every adapter's update being alpha / rank.
LORA_ALPHA = 32
MAX_RANK = 512

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}

# model_type -> the module names of its attention projections, MLP projections and unembedding.
# Other architectures name these differently (fused qkv, experts): refused, naming the type.
_LLAMA_LIKE = (("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj"), ("lm_head",))
TARGET_MODULES: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...], Tuple[str, ...]]] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gemma": _LLAMA_LIKE,
    "gemma2": _LLAMA_LIKE,
}

# The files save() writes beside PEFT's adapter_config.json and adapter_model.safetensors.
OPTIMIZER_FILE = "optimizer.pt"
RUN_FILE = "tinker.json"


class TrainingRun:
    """A LoRA adapter being trained on a base model, split over an executor or (executor None)
    whole in this process. Not thread-safe: one caller at a time, as `serve` does.

    checkpoint: the base model's folder (the one the executor serves). executor: its endpoint, or
    None for a monolithic model (tests, CPU-only use). dtype: the base model's ("fp32", "bf16",
    "fp16"); the adapter and its optimizer are fp32 whatever it is (PEFT's autocast_adapter_dtype).
    rank: the LoRA rank, 1..MAX_RANK. seed: the adapter's initialization (None: 0). train_*: which
    modules get adapters (at least one). tenant: the name the executor knows this run by."""

    def __init__(self, checkpoint: str, executor: Optional[str], *, device: str = "cpu", dtype: str = "fp32",
                 rank: int, seed: Optional[int], train_mlp: bool, train_attn: bool, train_unembed: bool,
                 tenant: str = "tinker"):
        import peft
        import transformers

        # The cheap checks first, before connecting or reading weights.
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
            raise ValueError(f"rank is {rank!r}; expected an integer from 1 to {MAX_RANK}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype is {dtype!r}; expected one of {', '.join(DTYPES)}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed is {seed!r}; expected an integer or None")
        if not (train_mlp or train_attn or train_unembed):
            raise ValueError("train_mlp, train_attn and train_unembed are all false; expected at least one "
                             "module kind to train")
        config = transformers.AutoConfig.from_pretrained(checkpoint)
        model_type = config.model_type
        # [Tied unembedding] A model whose unembedding is its token embeddings (Llama-3.2-1B and
        # 3B, Gemma, Qwen's small ones) has no unembedding layer of its own for an adapter: PEFT
        # would wrap the tied lm_head, and the samplers (the C++ runtime, which computes the
        # logits from the embeddings) have no such layer to apply it to. Such a run trains the
        # attention and MLP adapters it asked for, and info() says train_unembed is off.
        if train_unembed and getattr(config, "tie_word_embeddings", False):
            train_unembed = False
            if not (train_mlp or train_attn):
                raise ValueError(f"train_unembed is the only module kind asked, but checkpoint {checkpoint} ties its "
                                 "unembedding to its embeddings (no unembedding layer of its own to adapt); expected "
                                 "train_attn or train_mlp too")
        if model_type not in TARGET_MODULES:
            raise ValueError(f"model type '{model_type}' (checkpoint {checkpoint}) is not supported for training; "
                             f"supported: {', '.join(TARGET_MODULES)}")
        attention, mlp, unembed = TARGET_MODULES[model_type]
        targets = (list(attention) if train_attn else []) + (list(mlp) if train_mlp else []) + \
            (list(unembed) if train_unembed else [])

        self.checkpoint = os.path.abspath(checkpoint)
        self.model_type = model_type
        self.rank = rank
        self.seed = seed
        self.train_mlp, self.train_attn, self.train_unembed = bool(train_mlp), bool(train_attn), bool(train_unembed)
        self.device = torch.device(device)
        self.client: Optional[symbiosis.Client] = None
        if executor is not None:
            self.client = symbiosis.Client.connect(executor, tenant=tenant, device=device)
            model = symbiosis.from_pretrained(checkpoint, self.client, dtype=DTYPES[dtype])
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=DTYPES[dtype]).to(self.device)
        # The seed decides the adapter's A matrices (B starts at zero): seeded right before PEFT
        # makes them, so that the same seed gives the same adapter whatever ran before.
        torch.manual_seed(seed if seed is not None else 0)
        self.lora_config = peft.LoraConfig(r=rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=targets)
        self.model = peft.get_peft_model(model, self.lora_config)
        # No dropout anywhere: the log-probabilities trained on are the ones a sampler would see.
        self.model.eval()
        embeddings = self.model.get_input_embeddings()
        self.vocab_size = int(embeddings.num_embeddings)
        self.max_length = getattr(self.model.config, "max_position_embeddings", None)
        self.adapter_parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = self._new_optimizer()

    def info(self) -> Dict[str, Any]:
        """What the service tells clients about this run (get_info)."""
        return {"vocab_size": self.vocab_size, "lora_rank": self.rank, "lora_alpha": LORA_ALPHA,
                "model_type": self.model_type, "base_checkpoint": self.checkpoint,
                "max_length": self.max_length, "train_mlp": self.train_mlp, "train_attn": self.train_attn,
                "train_unembed": self.train_unembed,
                "trainable_parameters": sum(p.numel() for p in self.adapter_parameters)}

    def forward_backward(self, datums: List[Tuple[List[int], Dict[str, np.ndarray]]], loss_fn: str,
                         config: Optional[Dict[str, float]], forward_only: bool
                         ) -> Tuple[List[np.ndarray], Dict[str, float]]:
        """Tinker's forward_backward (forward when forward_only) on a batch of datums
        (model_input token ids, loss_fn_inputs): each datum's target log-probabilities (float32, as
        long as its input) and the loss's metrics. Unless forward_only, the loss's gradient is added
        to the adapter's ([Tinker training semantics]); forward_only keeps no graph and leaves the
        gradients as they are. Raises ValueError naming the datum and field of a bad request before
        any model work, leaving the run as it was."""
        token_batch, lengths, inputs = self._batch(datums)
        losses.check_request(loss_fn, inputs, config)
        targets = [datum["target_tokens"].to(self.device) for datum in inputs]
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            # [Right padding] Datums are right-padded to one batch: attention is causal, so the pad
            # tokens after a datum change none of its positions, and only those are read.
            logits = self.model(input_ids=token_batch.to(self.device), use_cache=False).logits
            target_logprobs = []
            for row, (length, target) in enumerate(zip(lengths, targets)):
                # log p(target) = its logit - logsumexp over the vocabulary, in fp32: one fp32 copy of
                # the datum's logits kept for backward, not two (log_softmax's input and output).
                datum_logits = logits[row, :length]
                picked = datum_logits.gather(-1, target.unsqueeze(-1)).squeeze(-1).float()
                target_logprobs.append(picked - torch.logsumexp(datum_logits.float(), dim=-1))
            loss, metrics = losses.loss_of(loss_fn, target_logprobs, inputs, config)
            del logits
        if not forward_only:
            loss.backward()
        if self.device.type == "cuda":
            # The step's logits are the run's largest tensors; between requests their memory goes
            # back to the GPU, for the other runs' steps.
            del loss
            torch.cuda.empty_cache()
        if self.client is not None:
            self.client.settle()  # an executor error belongs to this call, not the next one
        outputs = [logprobs.detach().to("cpu", torch.float32).numpy() for logprobs in target_logprobs]
        return outputs, metrics

    def optim_step(self, learning_rate: float = 1e-4, beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-12,
                   weight_decay: float = 0.0, grad_clip_norm: float = 0.0) -> Dict[str, float]:
        """Tinker's optim_step (AdamParams; its defaults): one AdamW step (decoupled weight decay)
        on the gradients accumulated since the last step, their global norm first clipped to
        grad_clip_norm when it is positive; then the gradients are cleared. Returns
        {"grad_norm:mean": the norm before clipping} (nothing when no gradient was accumulated).
        Raises ValueError naming a hyper-parameter out of range, before changing anything."""
        hyper = {"learning_rate": learning_rate, "beta1": beta1, "beta2": beta2, "eps": eps,
                 "weight_decay": weight_decay, "grad_clip_norm": grad_clip_norm}
        for name, value in hyper.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"optim_step: {name} is {value!r}; expected a finite number")
        for name in ("learning_rate", "eps", "weight_decay"):
            if hyper[name] < 0:
                raise ValueError(f"optim_step: {name} is {hyper[name]}; expected {name} >= 0")
        for name in ("beta1", "beta2"):
            if not 0 <= hyper[name] < 1:
                raise ValueError(f"optim_step: {name} is {hyper[name]}; expected 0 <= {name} < 1")
        if self.client is not None:
            self.client.settle()  # every base-layer call has its result before the adapter changes
        gradients = [p.grad for p in self.adapter_parameters if p.grad is not None]
        metrics: Dict[str, float] = {}
        if gradients:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in gradients]))
            metrics["grad_norm:mean"] = float(norm)
            if grad_clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.adapter_parameters, grad_clip_norm)
        for group in self.optimizer.param_groups:
            group.update(lr=float(learning_rate), betas=(float(beta1), float(beta2)), eps=float(eps),
                         weight_decay=float(weight_decay))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def save(self, folder: str, optimizer: bool, hand_over: bool = False) -> Optional[Dict[str, Any]]:
        """Writes the adapter to `folder` as PEFT does (adapter_config.json, adapter_model.safetensors:
        what peft.PeftModel.from_pretrained and the C++ runtime's loader read), with `optimizer`
        the AdamW state (optimizer.pt), and tinker.json: the run's settings, which load() checks.
        Gradients accumulated since the last optim_step are not saved. With `hand_over`, returns
        what the files hold, for the sampler to load in memory ([Sampler hand-over]):
        {"config_json": adapter_config.json's text, "tensors": adapter_model.safetensors' tensors,
        by name, on the CPU}."""
        import peft

        os.makedirs(folder, exist_ok=True)
        # save_embedding_layers=False: an adapter on lm_head would otherwise make PEFT copy the
        # base's whole unembedding into the adapter.
        self.model.save_pretrained(folder, save_embedding_layers=False)
        contents = None
        if hand_over:
            with open(os.path.join(folder, "adapter_config.json")) as f:
                config_json = f.read()
            state = peft.get_peft_model_state_dict(self.model, save_embedding_layers=False)
            contents = {"config_json": config_json,
                        "tensors": {name: t.detach().to("cpu", copy=True).contiguous() for name, t in state.items()}}
        if optimizer:
            torch.save(self.optimizer.state_dict(), os.path.join(folder, OPTIMIZER_FILE))
        run = {"base_checkpoint": self.checkpoint, "model_type": self.model_type, "rank": self.rank,
               "lora_alpha": LORA_ALPHA, "seed": self.seed, "train_mlp": self.train_mlp,
               "train_attn": self.train_attn, "train_unembed": self.train_unembed, "optimizer": bool(optimizer)}
        with open(os.path.join(folder, RUN_FILE), "w") as f:
            json.dump(run, f, indent=2)
        return contents

    def load(self, folder: str, optimizer: bool) -> None:
        """Restores the adapter saved in `folder` (by save(), or any PEFT LoRA adapter of this run's
        rank, alpha and targets) and, with `optimizer`, the AdamW state saved with it; without, the
        optimizer starts afresh. Accumulated gradients are dropped. Raises ValueError naming the
        folder and what does not match; on error the run is as it was."""
        import peft
        from peft.utils import load_peft_weights

        config_path = os.path.join(folder, "adapter_config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"load: {folder} holds no adapter (no adapter_config.json)")
        with open(config_path) as f:
            saved = json.load(f)
        # What decides the adapter's shapes and scale. The optional fields, when absent, take
        # PEFT's defaults, which are this run's too.
        required = {"peft_type": "LORA", "r": self.rank, "lora_alpha": LORA_ALPHA,
                    "target_modules": sorted(self.lora_config.target_modules)}
        optional = {"use_dora": False, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}}
        targets = saved.get("target_modules")
        found = dict(saved, target_modules=sorted(targets) if isinstance(targets, list) else targets)
        for field, value in {**required, **optional}.items():
            got = found.get(field, optional.get(field))
            if got != value:
                raise ValueError(f"load: {config_path}: field '{field}' is {got!r}, expected {value!r} (this run's)")
        optimizer_path = os.path.join(folder, OPTIMIZER_FILE)
        if optimizer and not os.path.isfile(optimizer_path):
            raise ValueError(f"load: {folder} holds no optimizer state ({OPTIMIZER_FILE}); it was saved without one")
        try:
            weights = load_peft_weights(folder, device=str(self.device))
        except Exception as error:  # a missing or unreadable weights file
            raise ValueError(f"load: {folder}: cannot read the adapter's weights: {error}") from None
        wanted = set(peft.get_peft_model_state_dict(self.model, save_embedding_layers=False))
        if set(weights) != wanted:
            missing, extra = sorted(wanted - set(weights)), sorted(set(weights) - wanted)
            raise ValueError(f"load: {folder}: the adapter's tensors do not fit this run "
                             f"(missing: {missing[:3]}{'...' if len(missing) > 3 else ''}; "
                             f"unexpected: {extra[:3]}{'...' if len(extra) > 3 else ''})")
        state = None
        if optimizer:
            try:
                state = torch.load(optimizer_path, map_location=self.device, weights_only=True)
            except Exception as error:  # a truncated or foreign file
                raise ValueError(f"load: cannot read {optimizer_path}: {error}") from None
            # A copy first: a state that does not fit leaves the run's optimizer untouched.
            candidate = self._new_optimizer()
            try:
                candidate.load_state_dict(state)
            except (ValueError, KeyError) as error:
                raise ValueError(f"load: {optimizer_path} does not fit this run's parameters: {error}") from None
        with torch.no_grad():
            peft.set_peft_model_state_dict(self.model, weights)
        self.optimizer = candidate if optimizer else self._new_optimizer()
        self.optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        """Drops the model and the executor connection (also what garbage collection does)."""
        self.model = self.optimizer = self.adapter_parameters = None
        self.client = None

    def _new_optimizer(self) -> torch.optim.AdamW:
        # Its hyper-parameters are set by every optim_step; these are placeholders.
        return torch.optim.AdamW(self.adapter_parameters, lr=0.0, weight_decay=0.0)

    def _batch(self, datums) -> Tuple[torch.Tensor, List[int], List[Dict[str, torch.Tensor]]]:
        """The datums' token ids right-padded into one [B, L] batch, their lengths, and their
        loss_fn_inputs as tensors (target_tokens int64, the others float32). Refuses an empty batch,
        an empty or too long input, an id outside the vocabulary and target_tokens not as long as
        the input, naming the datum and field."""
        if not isinstance(datums, (list, tuple)) or not datums:
            raise ValueError("forward_backward: no datums; expected a list of (model_input, loss_fn_inputs)")
        rows, inputs = [], []
        for index, datum in enumerate(datums):
            if not isinstance(datum, (list, tuple)) or len(datum) != 2 or not isinstance(datum[1], dict):
                raise ValueError(f"datum {index}: expected (model_input, loss_fn_inputs), got {type(datum).__name__}")
            model_input, fields = datum
            tokens = self._token_ids(index, "model_input", model_input)
            if tokens.shape[0] == 0:
                raise ValueError(f"datum {index}: model_input is empty; expected at least one token")
            if self.max_length is not None and tokens.shape[0] > self.max_length:
                raise ValueError(f"datum {index}: model_input has {tokens.shape[0]} tokens, more than the model's "
                                 f"max_position_embeddings {self.max_length}")
            converted = {}
            for name, value in fields.items():
                if name == "target_tokens":
                    converted[name] = self._token_ids(index, name, value)
                    continue
                try:
                    converted[name] = torch.as_tensor(np.asarray(value, dtype=np.float32))
                except (TypeError, ValueError):
                    raise ValueError(f"datum {index}: field '{name}' is not an array of numbers") from None
            if "target_tokens" not in converted:
                raise ValueError(f"datum {index}: loss_fn_inputs has no 'target_tokens'")
            target_length = converted["target_tokens"].shape[0]
            if target_length != tokens.shape[0]:
                raise ValueError(f"datum {index}: field 'target_tokens' has length {target_length}, "
                                 f"expected {tokens.shape[0]} (the length of model_input)")
            rows.append(tokens)
            inputs.append(converted)
        lengths = [row.shape[0] for row in rows]
        batch = torch.zeros(len(rows), max(lengths), dtype=torch.long)  # pad id 0: any valid id will do
        for index, row in enumerate(rows):
            batch[index, :row.shape[0]] = row
        return batch, lengths, inputs

    def _token_ids(self, index: int, field: str, value) -> torch.Tensor:
        """`value` as a one-dimensional int64 tensor of ids in [0, vocab_size), or ValueError naming
        the datum, the field and the first bad id."""
        array = np.asarray(value)
        if array.ndim != 1:
            raise ValueError(f"datum {index}: field '{field}' has shape {list(array.shape)}; expected one dimension")
        if array.size and array.dtype.kind not in "iu":
            raise ValueError(f"datum {index}: field '{field}' holds {array.dtype} values; expected integer token ids")
        array = array.astype(np.int64)
        bad = np.nonzero((array < 0) | (array >= self.vocab_size))[0]
        if bad.size:
            raise ValueError(f"datum {index}: field '{field}' has token id {int(array[bad[0]])} at position "
                             f"{int(bad[0])}, outside the vocabulary [0, {self.vocab_size})")
        return torch.from_numpy(array)


# [Training run protocol] The service and a run's process speak over a multiprocessing Pipe:
#   run -> service, once:  ("ready", info) when built, or ("error", kind, message) and the process ends.
#   service -> run:        (method_name, args_tuple, kwargs_dict) for one of SERVED_METHODS, or None to end.
#   run -> service:        ("ok", result) or ("error", kind, message), one reply per request, in order.
# kind is "user" for a request the client got wrong (ValueError, symbiosis.Error from bad input) and
# "server" for anything else; a failed request never ends the loop. Errors cross the process
# boundary as values: no exception object is pickled.
SERVED_METHODS = ("forward_backward", "optim_step", "save", "load", "info")


def error_kind(error: BaseException) -> str:
    """"user" when `error` says the request was wrong, "server" when the service failed it.
    ResultsLost (the executor restarted under a step) is the service's: the step can be redone."""
    if isinstance(error, symbiosis.ResultsLost):
        return "server"
    return "user" if isinstance(error, (ValueError, symbiosis.Error)) else "server"


def _describe(error: BaseException) -> str:
    return str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"


def serve(connection, **kwargs) -> None:
    """Process entry point (multiprocessing; runs.py forks it from its fork server): builds
    TrainingRun(**kwargs) and answers requests on `connection` until it receives None or the other
    end closes ([Training run protocol])."""
    try:
        run = TrainingRun(**kwargs)
    except Exception as error:  # noqa: BLE001 - reported to the service, which decides
        # Only a bad argument (rank, dtype, model type) is the client's; an executor that cannot be
        # reached or serves another model is the service's to fix.
        kind = "user" if isinstance(error, ValueError) else "server"
        if kind == "server":
            traceback.print_exc(file=sys.stderr)
        connection.send(("error", kind, _describe(error)))
        return
    connection.send(("ready", run.info()))
    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):  # the service is gone
            break
        if message is None:
            break
        reply = _answer(run, message)
        try:
            connection.send(reply)
        except (BrokenPipeError, EOFError, OSError):
            break
        except Exception as error:  # noqa: BLE001 - a result that does not pickle
            connection.send(("error", "server", f"cannot send the result: {_describe(error)}"))
    run.close()


def _answer(run: TrainingRun, message) -> Tuple:
    """The reply to one request: ("ok", result) or ("error", kind, message)."""
    if not (isinstance(message, tuple) and len(message) == 3 and isinstance(message[1], tuple)
            and isinstance(message[2], dict)):
        return ("error", "server", f"malformed request {type(message).__name__}; expected "
                                   f"(method_name, args_tuple, kwargs_dict)")
    method, args, kwargs = message
    if method not in SERVED_METHODS:
        return ("error", "server", f"unknown method {method!r}; expected one of {', '.join(SERVED_METHODS)}")
    try:
        return ("ok", getattr(run, method)(*args, **kwargs))
    except Exception as error:  # noqa: BLE001 - every failure is answered; the loop goes on
        kind = error_kind(error)
        if kind == "server":
            traceback.print_exc(file=sys.stderr)
        return ("error", kind, _describe(error))
