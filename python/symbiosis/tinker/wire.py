"""The Tinker API's protobuf messages ([Tinker wire]): forward_backward's request and result, and
sample's result, which the `tinker` SDK sends and reads as protobuf (Content-Type
application/x-protobuf), not JSON.

[Tinker wire]
The schema is the SDK's own, `tinker.proto.tinker_public_pb2` (package tinker_public), imported
from the pinned `tinker` package: the server and its clients then read and write one schema, and a
new SDK that changes it fails here, at import or in the tests, not on a user's data. Tokens travel
as int32 little-endian bytes, request tensors as float32 or int64 bytes (dense, or sparse CSR for
2-D ones); a result's per-datum arrays are concatenated into one BatchedTensor with int64 byte
offsets, one more than the datums.
"""
from typing import Dict, List, NamedTuple, Sequence

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

PROTOBUF = "application/x-protobuf"
_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class Datum(NamedTuple):
    """One sequence of a forward_backward: its input tokens and its loss function's inputs
    (target_tokens, weights, advantages, logprobs, ...), each an array."""

    tokens: List[int]
    inputs: Dict[str, np.ndarray]


class ForwardBackward(NamedTuple):
    model_id: str
    seq_id: int
    data: List[Datum]
    loss_fn: str
    config: Dict[str, float]
    forward_only: bool


def _tensor(name: str, t: "pb.Tensor") -> np.ndarray:
    if t.dtype not in _NUMPY:
        raise ValueError(f"loss_fn_inputs[{name!r}] has dtype {pb.DType.Name(t.dtype)}, expected FLOAT32, INT64 "
                         "or INT32")
    dtype = _NUMPY[t.dtype]
    shape = tuple(t.shape)
    if t.WhichOneof("encoding") == "sparse_csr":
        if len(shape) != 2:
            raise ValueError(f"loss_fn_inputs[{name!r}] is sparse with shape {list(shape)}, expected 2 dimensions")
        dense = np.zeros(shape, dtype)
        values = np.frombuffer(t.sparse_csr.values, dtype)
        rows = np.frombuffer(t.sparse_csr.crow_indices, np.int64)
        columns = np.frombuffer(t.sparse_csr.col_indices, np.int64)
        for row in range(shape[0]):
            dense[row, columns[rows[row]:rows[row + 1]]] = values[rows[row]:rows[row + 1]]
        return dense
    values = np.frombuffer(t.dense, dtype)
    if shape and int(np.prod(shape)) != values.size:
        raise ValueError(f"loss_fn_inputs[{name!r}] holds {values.size} values for shape {list(shape)}")
    return values.reshape(shape) if shape else values


def _tokens(datum: "pb.Datum", index: int) -> List[int]:
    tokens: List[int] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise ValueError(f"data[{index}].model_input has a {kind} chunk: this server takes text tokens only")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, np.int32).tolist())
    return tokens


def parse_forward_backward(body: bytes) -> ForwardBackward:
    """A ForwardBackwardRequest's fields; ValueError naming what does not parse."""
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as error:  # protobuf's DecodeError and friends
        raise ValueError(f"the body is not a tinker_public.ForwardBackwardRequest: {error}") from None
    config: Dict[str, float] = dict(message.loss_fn_config)
    for key, value in message.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise ValueError(f"loss_fn_config[{key!r}] is text ({value.text!r}): this server's losses take numbers")
        config[key] = value.number
    data = [Datum(_tokens(d, i), {name: _tensor(name, t) for name, t in d.loss_fn_inputs.items()})
            for i, d in enumerate(message.data)]
    return ForwardBackward(message.model_id, message.seq_id, data, message.loss_fn, config, message.forward_only)


def forward_backward_output(logprobs: Sequence[np.ndarray], metrics: Dict[str, float]) -> bytes:
    """A ForwardBackwardOutput of one ArrayRecord whose field `logprobs` holds each datum's
    per-token log-probabilities (float32)."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    record = out.loss_fn_outputs.add()
    record.num_datums = len(logprobs)
    field = record.fields["logprobs"]
    field.dtype = pb.DTYPE_FLOAT32
    arrays = [np.ascontiguousarray(a, dtype="<f4") for a in logprobs]
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype("<i8").tobytes()
    return out.SerializeToString()


class SampledSequence(NamedTuple):
    """One sampled sequence: its tokens (the stop token included), each one's log-probability,
    and whether it stopped (True) or ran to its length (False)."""

    tokens: List[int]
    logprobs: List[float]
    stopped: bool


def sample_response(sequences: Sequence[SampledSequence], prompt_logprobs: Sequence[float] = ()) -> bytes:
    """A SampleResponse; prompt_logprobs, when given, one per prompt token (NaN: not scored, the
    first)."""
    out = pb.SampleResponse()
    for s in sequences:
        sequence = out.sequences.add()
        sequence.stop_reason = pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH
        sequence.tokens = np.asarray(s.tokens, "<i4").tobytes()
        sequence.logprobs = np.asarray(s.logprobs, "<f4").tobytes()
    if len(prompt_logprobs):
        out.prompt_logprobs = np.asarray(prompt_logprobs, "<f4").tobytes()
    return out.SerializeToString()


def chunk_tokens(model_input: Dict) -> List[int]:
    """The tokens of a JSON ModelInput ({"chunks": [{"type": "encoded_text", "tokens": [...]}]});
    ValueError naming what is wrong with it."""
    tokens: List[int] = []
    if not isinstance(model_input, dict) or not isinstance(model_input.get("chunks"), list):
        raise ValueError("prompt is not a ModelInput ({\"chunks\": [...]})")
    for i, chunk in enumerate(model_input["chunks"]):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            kind = chunk.get("type") if isinstance(chunk, dict) else type(chunk).__name__
            raise ValueError(f"prompt.chunks[{i}] is a {kind} chunk: this server takes text tokens only")
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"prompt.chunks[{i}].tokens is not a list of token ids")
        tokens.extend(ids)
    return tokens
