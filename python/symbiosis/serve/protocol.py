"""The OpenAI API's request bodies, read and checked field by field, and its error shape.

[OpenAI fields]
A body is read by hand rather than by a schema library so that every refusal is the OpenAI error
shape ({"error": {"message", "type", "param", "code"}}) with a message that names the field, what it
was and what it takes. Fields are OpenAI's, with vLLM's extensions where OpenAI has none (top_k,
stop_token_ids, ignore_eos); a field this server does not know, or one it knows but does not
implement set to anything but its neutral value (frequency_penalty 0, echo false, ...), is refused
naming it rather than silently ignored.
"""
import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from .engine import SamplingParams

MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound (chat), also the completions' logprobs here


class ApiError(Exception):
    """An HTTP error in the OpenAI shape. status: 400 bad field, 401 no or unknown key, 403 a key's
    adapter limits, 404 unknown model, 429 full, 500 engine error; retry_after: seconds, for 429."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
             404: "NotFoundError", 429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: Optional[str] = None, retry_after: Optional[int] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "Error"), "param": self.param,
                          "code": self.status}}


def bad(field: str, value: Any, expected: str) -> ApiError:
    return ApiError(400, f"'{field}' is {_shown(value)}, expected {expected}", param=field)


def _shown(value: Any) -> str:
    import json

    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _integer(body: Dict, field: str, default: Optional[int], low: Optional[int] = None,
             high: Optional[int] = None) -> Optional[int]:
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(field, value, "an integer" + _range(low, high))
    if (low is not None and value < low) or (high is not None and value > high):
        raise bad(field, value, "an integer" + _range(low, high))
    return value


def _range(low, high) -> str:
    if low is not None and high is not None:
        return f" in [{low}, {high}]"
    if low is not None:
        return f" >= {low}"
    return f" <= {high}" if high is not None else ""


def _number(body: Dict, field: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            value > high or value < low or (low_open and value == low):
        raise bad(field, value, f"a number in {'(' if low_open else '['}{low}, {high}]")
    return float(value)


def _boolean(body: Dict, field: str, default: bool) -> bool:
    value = body.get(field)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(field, value, "true or false")
    return value


def _token_ids(value: Any, field: str, vocab_size: int) -> List[int]:
    if not isinstance(value, list) or not value or \
            not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in value):
        raise bad(field, value, f"a non-empty list of token ids in [0, {vocab_size})")
    return value


def _refuse_unknown(body: Dict, known: Sequence[str], neutral: Dict[str, Sequence[Any]]) -> None:
    for field, value in body.items():
        if field in neutral:
            if value not in neutral[field]:
                raise ApiError(400, f"'{field}' is {_shown(value)}: this server does not implement it "
                                    f"(it takes only {' or '.join(_shown(v) for v in neutral[field])})", param=field)
        elif field not in known:
            raise ApiError(400, f"unknown field '{field}' (this server takes {', '.join(sorted(known))})",
                           param=field)


# Fields OpenAI's API has that change what is generated, at their neutral values only.
_NEUTRAL = {"frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
            "best_of": (None, 1), "echo": (None, False), "suffix": (None, "")}
_NEUTRAL_CHAT = {"frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
                 "tools": (None, []), "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
                 "parallel_tool_calls": (None, False, True), "store": (None, False), "metadata": (None, {}),
                 "service_tier": (None, "auto", "default")}
_COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n", "stream",
           "stream_options", "ignore_eos", "user")


@dataclasses.dataclass
class GenerationRequest:
    """A checked completions or chat request: the model (adapter or base) and its sampling; prompts
    are filled in by the server once the model is known (the chat template is its tokenizer's)."""

    model: str
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    max_tokens_given: bool  # chat: without max_tokens, the rest of the context
    ignore_eos: bool
    logprobs: Optional[int]  # completions: top alternatives per token (0: the token's own only); chat: top_logprobs
    prompts: List[Union[str, List[int]]] = dataclasses.field(default_factory=list)  # completions
    messages: List[Dict[str, Any]] = dataclasses.field(default_factory=list)  # chat
    add_generation_prompt: bool = True  # chat


def _common(body: Any, vocab_size: int, known: Sequence[str], neutral: Dict) -> Tuple[GenerationRequest, bool]:
    """The fields completions and chat share: (the request, whether it gave a seed)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body is {_shown(body)}, expected a JSON object")
    _refuse_unknown(body, known, neutral)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", model, "the name of a model (GET /v1/models lists them)")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", body.get("stop"), "a non-empty string or a list of them")
    stop_token_ids = body.get("stop_token_ids")
    stop_token_ids = [] if stop_token_ids in (None, []) else _token_ids(stop_token_ids, "stop_token_ids", vocab_size)
    top_k = _integer(body, "top_k", 0, low=-1)
    seed = _integer(body, "seed", None, low=0, high=2**63 - 1)
    stream_options = body.get("stream_options")
    if stream_options is not None and (not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}
                                       or not isinstance(stream_options.get("include_usage", False), bool)):
        raise bad("stream_options", stream_options, 'null or {"include_usage": true or false}')
    stream = _boolean(body, "stream", False)
    if stream_options is not None and not stream:
        raise bad("stream_options", stream_options, "null when 'stream' is not true")
    params = SamplingParams(
        max_new_tokens=_integer(body, "max_tokens", 16, low=1),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_k=0 if top_k == -1 else top_k,
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        seed=seed if seed is not None else 0,
        stop_token_ids=stop_token_ids,
        stop=stop)
    return GenerationRequest(model=model, params=params, n=_integer(body, "n", 1, low=1, high=128), stream=stream,
                             include_usage=bool((stream_options or {}).get("include_usage")),
                             max_tokens_given=body.get("max_tokens") is not None,
                             ignore_eos=_boolean(body, "ignore_eos", False), logprobs=None), seed is not None


def parse_completion(body: Any, vocab_size: int) -> Tuple[GenerationRequest, bool]:
    """A /v1/completions body: (GenerationRequest, whether a seed was given)."""
    request, seeded = _common(body, vocab_size, _COMMON + ("prompt", "logprobs"), _NEUTRAL)
    prompt = body.get("prompt")
    expected = "a string, a list of token ids, or a list of strings or of token id lists"
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [_token_ids(prompt, "prompt", vocab_size)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = [p if isinstance(p, str) else _token_ids(p, f"prompt[{i}]", vocab_size) for i, p in enumerate(prompt)]
    else:
        raise bad("prompt", prompt, expected)
    if any(p == "" for p in prompts):
        raise bad("prompt", prompt, "non-empty text")
    request.prompts = prompts
    request.logprobs = _integer(body, "logprobs", None, low=0, high=MAX_LOGPROBS)
    request.params.logprobs = request.logprobs is not None
    request.params.top_logprobs = request.logprobs or 0
    return request, seeded


_CONTENT = 'a string or a list of {"type": "text", "text": ...} parts'


def parse_chat(body: Any, vocab_size: int) -> Tuple[GenerationRequest, bool]:
    """A /v1/chat/completions body: (GenerationRequest, whether a seed was given)."""
    known = _COMMON + ("messages", "logprobs", "top_logprobs", "max_completion_tokens", "add_generation_prompt")
    if isinstance(body, dict) and body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None:
            raise bad("max_completion_tokens", body["max_completion_tokens"], "not given with 'max_tokens' too")
        body = dict(body, max_tokens=body["max_completion_tokens"])
        del body["max_completion_tokens"]
    request, seeded = _common(body, vocab_size, known, _NEUTRAL_CHAT)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", messages, "a non-empty list of {\"role\", \"content\"} objects")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad(f"messages[{i}]", message, "an object with a string 'role' and a 'content'")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"messages[{i}].content", content, _CONTENT)
            content = "".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content", content, _CONTENT)
        checked.append({**message, "content": content})
    request.messages = checked
    want_logprobs = _boolean(body, "logprobs", False)
    top = _integer(body, "top_logprobs", None, low=0, high=MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise bad("top_logprobs", top, "null unless 'logprobs' is true")
    request.logprobs = (top or 0) if want_logprobs else None
    request.params.logprobs = want_logprobs
    request.params.top_logprobs = top or 0
    request.add_generation_prompt = _boolean(body, "add_generation_prompt", True)
    return request, seeded


def parse_adapter_body(body: Any, fields: Sequence[str]) -> Dict[str, str]:
    """/v1/load_lora_adapter's {"lora_name", "lora_path"} or /v1/unload_lora_adapter's {"lora_name"}."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body is {_shown(body)}, expected a JSON object with {', '.join(fields)}")
    for field in body:
        if field not in fields and field != "lora_int_id":
            raise ApiError(400, f"unknown field '{field}' (this takes {', '.join(fields)})", param=field)
    for field in fields:
        if not isinstance(body.get(field), str) or not body[field]:
            raise bad(field, body.get(field), "a non-empty string")
    return {field: body[field] for field in fields}
