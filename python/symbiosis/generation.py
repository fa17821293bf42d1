"""Generator: the C++ runtime's generation engine for a Python tenant.

[Python generation]
transformers' `generate` on a virtualized model works, but it runs the model step by step from
Python, with no batching across requests. Generator runs the C++ runtime's Generator instead
(client_runtime/inference/generator.h): continuous batching over one KV cache, each decode step one
forward for every running request, and on a GPU decode steps replayed from CUDA graphs. Its model is
the C++ runtime's own copy of the checkpoint's client layers, split over this tenant's Client (the
base layers on the executor) or monolithic without one, with a PEFT adapter loaded from its files
(what `save_pretrained` writes, or a symbiosis-finetune run). Greedy generation equals transformers
+ PEFT greedy `generate` for the same adapter (test_generation.py).

    gen = symbiosis.Generator("/models/llama", client, adapter="runs/alice/adapter")
    for result in gen.generate([[1, 15043], [1, 3492, 338]], max_new_tokens=32):
        print(result.output_ids, result.finish_reason)
"""
from typing import List, NamedTuple, Optional, Sequence, Union

import torch

from . import _C
from .client import Client, Error


class Generation(NamedTuple):
    """One prompt's result: its ids, the ids produced, why it ended ("stop": a stop token, kept in
    output_ids; "length": max_new_tokens; "error"), each token's log-probability (when asked) and
    the error (when one happened)."""

    prompt_ids: List[int]
    output_ids: List[int]
    finish_reason: str
    logprobs: Optional[List[float]] = None
    error: Optional[str] = None


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class Generator:
    """Generates from a checkpoint's model (and an adapter) with the C++ engine ([Python generation]).

    checkpoint: the model's folder (the one the executor serves). client: this tenant's Client, or
    None to compute the base layers here (monolithic). adapter: a PEFT adapter folder (or a
    symbiosis-finetune run or checkpoint folder), or None for the base model. device and dtype:
    where the client layers live and in which dtype (default: the client's device, fp32).
    max_sequences: requests decoded at once; max_tokens: positions per request (prompt + new
    tokens); capture_decode: on a GPU, decode steps in CUDA graphs; decode_halves: split, each
    decode step's sequences in two halves over two connections to the executor, one computing while
    the other's calls are at the executor (docs/inference.md). Raises symbiosis.Error naming
    what is wrong (a model the executor does not serve, an adapter of another model, a bad size)."""

    def __init__(self, checkpoint: str, client: Optional[Client] = None, *, adapter: Optional[str] = None,
                 device: Union[str, torch.device, None] = None, dtype: Union[str, torch.dtype] = torch.float32,
                 max_sequences: int = 8, max_tokens: int = 1024, capture_decode: bool = True,
                 decode_halves: bool = False):
        if device is None:
            device = client.device if client is not None else "cpu"
        if isinstance(dtype, torch.dtype):
            if dtype not in _DTYPE_NAMES:
                raise Error(f"Generator: dtype {dtype} is not one of {', '.join(map(str, _DTYPE_NAMES))}")
            dtype = _DTYPE_NAMES[dtype]
        self._native = _C.Generator(str(checkpoint), client._native if client is not None else None,
                                    str(adapter or ""), str(torch.device(device)), dtype, max_sequences, max_tokens,
                                    capture_decode, decode_halves)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 16, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_token_ids: Sequence[int] = (),
                 logprobs: bool = False) -> List[Generation]:
        """Generates for every prompt (token ids) at once, batched as the engine batches; returns
        their results in order. temperature 0 is greedy; otherwise prompt i samples from its own
        stream, seeded with seed + i (top_k 0: all tokens; top_p 1: no nucleus cut). A request ends
        at a stop token (kept in its output) or after max_new_tokens. Raises symbiosis.Error naming
        the field for a bad prompt or parameter; the other prompts are not generated then."""
        prompts = [[int(t) for t in prompt] for prompt in prompts]
        results = self._native.generate(prompts, max_new_tokens, temperature, top_k, top_p, seed,
                                        [int(t) for t in stop_token_ids], logprobs)
        return [Generation(**result) for result in results]

    @property
    def captured_batch_sizes(self) -> int:
        """Decode graphs captured so far (on a GPU, with capture_decode)."""
        return self._native.captured_batch_sizes
