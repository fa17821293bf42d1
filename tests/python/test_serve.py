"""symbiosis-serve (python/symbiosis/serve/, docs/serving.md) through the official openai client: one
server for the module, a tiny Llama split over an executor, with a tokenizer and a chat template made
here and two LoRA adapters of other ranks and targets. Greedy completions equal transformers + PEFT
generate for each model while the base's and both adapters' requests share decode steps
([Multi-adapter batches]); streaming equals non-streaming; chat prompts are apply_chat_template's;
stop strings and ids, logprobs, n, usage, keys limited to adapters, an adapter saved after the
server started loaded and unloaded, a client gone mid-stream or before its answer, and bad input refused naming the
field while the server goes on."""
import asyncio
import json
import os
import subprocess
import time
import urllib.error
import urllib.request

import openai
import peft
import pytest
import transformers

from conftest import (BUILD, ReadyProcess, add_tokenizer, greedy_generate, make_checkpoint, reference_model, save_lora,
                      served)

SERVE = os.environ.get("SYMBIOSIS_SERVE", os.path.join(BUILD, "examples", "symbiosis-serve"))
FINETUNE = os.environ.get("SYMBIOSIS_FINETUNE", os.path.join(BUILD, "examples", "symbiosis-finetune"))
BASE = "tiny"
EOS = 2  # the tiny models' (conftest.py)
ADMIN, ALICE_KEY = "admin-key", "alice-key"
PROMPTS = [[1, 17, 45, 99, 3], [1, 120, 5, 66, 70, 71, 33]]


class Server(ReadyProcess):
    """A symbiosis-serve process on a free port: its URL."""

    def __init__(self, args, log_path):
        super().__init__([SERVE, "--port", "0", *args], log_path, "symbiosis-serve")
        self.wait_ready(timeout_s=120)
        self.url = self.address

    def post(self, path, body, key=ADMIN):
        """(status, text) of a POST outside the openai client (vLLM's adapter endpoints; no key: None)."""
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                         headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def metrics(self):
        with urllib.request.urlopen(self.url + "/metrics", timeout=60) as response:
            return response.read().decode()

    def count(self, metric, **labels):
        """A counter's value in /metrics (0 when it has no sample of these labels yet)."""
        want = metric + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        for line in self.metrics().splitlines():
            name, _, value = line.rpartition(" ")
            if name == want:
                return float(value)
        return 0.0

    def client(self, key=ADMIN, asynchronous=False, max_retries=0):
        kind = openai.AsyncOpenAI if asynchronous else openai.OpenAI
        return kind(base_url=self.url + "/v1", api_key=key, max_retries=max_retries, timeout=120)


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    """(server, checkpoint, {model name: the transformers + PEFT model it is held to})."""
    work = tmp_path_factory.mktemp("serve")
    with served("llama") as (checkpoint, executor):
        add_tokenizer(checkpoint)
        adapters = {
            "alice": save_lora(checkpoint, work / "alice", seed=3, r=4, lora_alpha=8,
                               target_modules=["q_proj", "v_proj"]),
            "bob": save_lora(checkpoint, work / "bob", seed=4, r=8, lora_alpha=16, target_modules="all-linear"),
        }
        keys = work / "keys.json"
        keys.write_text(json.dumps({ADMIN: "*", ALICE_KEY: ["alice", BASE]}))
        server = Server(["--model", checkpoint, "--served-model-name", BASE, "--executor", executor.endpoint,
                         "--max-num-seqs", "8", "--max-waiting", "100", "--api-keys", str(keys),
                         "--lora-modules", *(f"{name}={path}" for name, path in adapters.items())],
                        work / "serve.log")
        server.executor = executor.endpoint
        server.adapters = adapters
        try:
            references = {BASE: reference_model(checkpoint)}
            for name, path in adapters.items():
                references[name] = peft.PeftModel.from_pretrained(reference_model(checkpoint), path).eval()
            yield server, checkpoint, references
        finally:
            server.stop()


def text_of(checkpoint, ids):
    return transformers.AutoTokenizer.from_pretrained(checkpoint).decode(ids, skip_special_tokens=True)


def test_models_lists_the_base_and_the_adapters_a_key_may_use(serving):
    server, checkpoint, _ = serving
    assert [m.id for m in server.client().models.list()] == [BASE, "alice", "bob"]
    assert [m.id for m in server.client(ALICE_KEY).models.list()] == [BASE, "alice"]


def expect_concurrent_greedy_completions_equal_peft_generate(server, checkpoint, references):
    client = server.client(asynchronous=True)

    async def complete_all():
        requests = [(model, prompt) for model in (BASE, "alice", "bob") for prompt in PROMPTS]
        return requests, await asyncio.gather(*(
            client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, logprobs=1)
            for model, prompt in requests))

    requests, responses = asyncio.run(complete_all())
    texts = set()
    for (model, prompt), response in zip(requests, responses):
        ids, logprobs = greedy_generate(references[model], prompt, 10)
        [choice] = response.choices
        assert choice.text == text_of(checkpoint, ids), f"{model}, prompt {prompt}"
        assert choice.finish_reason == ("stop" if ids[-1] == EOS else "length")
        assert response.usage.prompt_tokens == len(prompt) and response.usage.completion_tokens == len(ids)
        assert response.usage.total_tokens == len(prompt) + len(ids)
        assert choice.logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-4), f"{model}, prompt {prompt}"
        texts.add(choice.text)
    assert len(texts) > 2, "the adapters should change what is generated"


def test_concurrent_greedy_completions_of_the_base_and_two_adapters_equal_peft_generate(serving):
    expect_concurrent_greedy_completions_equal_peft_generate(*serving)


def test_decode_halves_give_the_same_completions(serving, tmp_path):
    """--decode-halves ([Decode halves], docs/inference.md): each decode step's sequences in two halves,
    the second's calls over a connection of its own to the executor; the completions are as exact."""
    server, checkpoint, references = serving
    halves = Server(["--model", checkpoint, "--served-model-name", BASE, "--executor", server.executor,
                     "--max-num-seqs", "8", "--api-key", ADMIN, "--decode-halves",
                     "--lora-modules", *(f"{name}={path}" for name, path in server.adapters.items())],
                    tmp_path / "serve-halves.log")
    try:
        expect_concurrent_greedy_completions_equal_peft_generate(halves, checkpoint, references)
    finally:
        halves.stop()


def test_chat_prompt_is_apply_chat_template_and_streaming_equals_not_streaming(serving):
    server, checkpoint, references = serving
    messages = [{"role": "system", "content": "you are a fox"}, {"role": "user", "content": "hello world"}]
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert prompt[0] == 1 and "[you are a fox]<user>hello world" in tokenizer.decode(prompt)  # the system message
    ids, logprobs = greedy_generate(references["alice"], prompt, 8)
    client = server.client()
    response = client.chat.completions.create(model="alice", messages=messages, max_tokens=8, temperature=0,
                                              logprobs=True)
    # The same ids: the same length, and the log-probabilities (which every prompt token moves) equal.
    assert response.usage.prompt_tokens == len(prompt)
    assert [t.logprob for t in response.choices[0].logprobs.content] == pytest.approx(logprobs, abs=1e-4)
    assert response.choices[0].message.content == text_of(checkpoint, ids)
    assert response.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="alice", messages=messages, max_tokens=8, temperature=0,
                                                 logprobs=True, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == response.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == response.choices[0].finish_reason
    assert chunks[-1].usage == response.usage
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == response.choices[0].logprobs.content
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="bob", prompt=PROMPTS[1], max_tokens=8, temperature=0, stream=True))
    alone = client.completions.create(model="bob", prompt=PROMPTS[1], max_tokens=8, temperature=0)
    assert streamed == alone.choices[0].text


def test_stop_strings_and_stop_token_ids_end_a_request(serving):
    server, checkpoint, references = serving
    client = server.client()
    ids, _ = greedy_generate(references["bob"], PROMPTS[0], 10)
    full = client.completions.create(model="bob", prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) >= 4, full
    stop = full[2:4]
    stopped = client.completions.create(model="bob", prompt=PROMPTS[0], max_tokens=10, temperature=0, stop=[stop])
    assert stopped.choices[0].text == full[:full.index(stop)] and stopped.choices[0].finish_reason == "stop"
    at = ids[2]
    by_id = client.completions.create(model="bob", prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                      extra_body={"stop_token_ids": [at]})
    assert by_id.usage.completion_tokens == ids.index(at) + 1 and by_id.choices[0].finish_reason == "stop"


def test_chat_top_logprobs_and_n_seeded_choices(serving):
    server, checkpoint, references = serving
    client = server.client()
    messages = [{"role": "user", "content": "how are you"}]
    response = client.chat.completions.create(model=BASE, messages=messages, max_tokens=4, temperature=0,
                                              logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        best = entry.top_logprobs[0]
        assert best.token == entry.token and best.logprob == pytest.approx(entry.logprob)  # greedy
    sampled = [client.completions.create(model="alice", prompt="hello", max_tokens=6, temperature=1.0, seed=5, n=3)
               for _ in range(2)]
    assert [c.index for c in sampled[0].choices] == [0, 1, 2]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]
    assert len({c.text for c in sampled[0].choices}) > 1, "each choice samples from its own seed"
    assert sampled[0].usage.completion_tokens == 18 or any(c.finish_reason == "stop" for c in sampled[0].choices)


def test_keys_limit_who_uses_which_adapter(serving):
    server, _, _ = serving
    status, text = server.post("/v1/completions", {"model": BASE, "prompt": [1, 5]}, key=None)
    assert status == 401 and "Authorization: Bearer" in text
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").completions.create(model=BASE, prompt=[1, 5], max_tokens=2)
    with pytest.raises(openai.PermissionDeniedError, match="'bob'.*may use tiny, alice"):
        server.client(ALICE_KEY).completions.create(model="bob", prompt=[1, 5], max_tokens=2)
    allowed = server.client(ALICE_KEY).completions.create(model="alice", prompt=[1, 5], max_tokens=2)
    assert allowed.usage.completion_tokens >= 1
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "bob"}, key=ALICE_KEY)[0] == 403


def test_an_adapter_a_finetuning_tenant_saves_is_loaded_and_unloaded(serving, tmp_path):
    server, checkpoint, _ = serving
    # A symbiosis-finetune tenant of the same executor trains an adapter while the server serves.
    (tmp_path / "train.jsonl").write_text('{"input_ids": [1, 5, 6, 7, 8, 9]}\n{"input_ids": [1, 9, 8, 7, 6]}\n')
    subprocess.run([FINETUNE, "--model", checkpoint, "--executor", server.executor,
                    "--train", str(tmp_path / "train.jsonl"), "--steps", "2", "--lr", "0.05", "--lora-r", "2",
                    "--lora-targets", "o_proj,up_proj",
                    "--save-dir", str(tmp_path / "run")], check=True, capture_output=True)
    status, text = server.post("/v1/load_lora_adapter", {"lora_name": "carol", "lora_path": str(tmp_path / "run")})
    assert status == 200, text
    client = server.client()
    assert "carol" in [m.id for m in client.models.list()]
    saved = str(tmp_path / "run" / "checkpoint-2" / "adapter")  # the run's newest adapter
    ids, _ = greedy_generate(peft.PeftModel.from_pretrained(reference_model(checkpoint), saved).eval(), PROMPTS[1], 8)
    completion = client.completions.create(model="carol", prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=0)
    assert completion.choices[0].text == text_of(checkpoint, ids)
    base = client.completions.create(model=BASE, prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=0)
    assert completion.choices[0].logprobs.token_logprobs != base.choices[0].logprobs.token_logprobs
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "carol"}) == (
        200, "Success: LoRA adapter 'carol' removed successfully.")
    with pytest.raises(openai.NotFoundError, match="'carol' does not exist; this server serves tiny, alice, bob"):
        client.completions.create(model="carol", prompt=PROMPTS[1], max_tokens=2)
    # An adapter of another base model is refused at load, naming both.
    other = tmp_path / "other-model"
    make_checkpoint("gpt2", str(other))
    status, text = server.post("/v1/load_lora_adapter", {"lora_name": "other", "lora_path": save_lora(
        str(other), tmp_path / "other", seed=1, r=2, target_modules=["c_attn"])})
    assert status == 400 and "made for" in text and str(other) in text and checkpoint in text, text


@pytest.mark.parametrize("field, value, expected", [
    ("temperature", -1, "'temperature' is -1, expected a number in [0.0, 2.0]"),
    ("max_tokens", 0, "'max_tokens' is 0, expected an integer >= 1"),
    ("top_p", 0, "'top_p' is 0, expected a number in (0.0, 1.0]"),
    ("max_tokens", 60, "the prompt (5 tokens) + max_tokens (60) = 65 tokens, more than this model's context of 64"),
    ("logprobs", 50, "'logprobs' is 50, expected an integer in [0, 20]"),
    ("prompt", [1, 500], "'prompt' is [1, 500], expected a non-empty list of token ids in [0, 128)"),
    ("frequency_penalty", 0.5, "'frequency_penalty' is 0.5: this server does not implement it"),
    ("best_tokens", 3, "unknown field 'best_tokens'"),
])
def test_bad_input_is_refused_naming_the_field_and_the_server_goes_on(serving, field, value, expected):
    server, _, _ = serving
    client = server.client()
    body = {"model": BASE, "prompt": PROMPTS[0], "max_tokens": 2}
    body[field] = value
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**{k: body.pop(k) for k in ("model", "prompt")}, extra_body=body)
    assert expected in refused.value.message and refused.value.body["param"] == field
    assert client.completions.create(model=BASE, prompt=PROMPTS[0], max_tokens=2).usage.completion_tokens >= 1


def test_a_full_server_answers_429_with_retry_after_and_goes_on(serving):
    server, _, _ = serving
    client = server.client()
    # 128 sequences at once, 8 of them in cache slots at most: more than --max-waiting 100 wait.
    with pytest.raises(openai.RateLimitError, match="the server is full") as refused:
        client.completions.create(model=BASE, prompt=PROMPTS[0], max_tokens=2, n=128)
    assert refused.value.response.headers["retry-after"] == "1"
    # The refused request's sequences leave the queue at the next step; a client that waits as
    # Retry-After says (the openai client does, retrying) is served.
    retrying = server.client(max_retries=5)
    assert len(retrying.completions.create(model=BASE, prompt=PROMPTS[0], max_tokens=2, n=4).choices) == 4


def test_a_client_gone_mid_stream_frees_its_sequence(serving):
    server, _, _ = serving
    # 62 tokens to go when the client leaves after the first: the server cancels the rest.
    produced = server.count("symbiosis_generation_tokens_total", model_name="alice")
    stream = server.client().completions.create(model="alice", prompt=[1], max_tokens=63, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    aborted = 'symbiosis_request_success_total{finished_reason="abort",model_name="alice"} 1.0'
    deadline = time.monotonic() + 30  # a bound on waiting, not a measure
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if aborted in metrics and "symbiosis_num_requests_running 0.0" in metrics:
            break
        time.sleep(0.1)
    assert aborted in metrics and "symbiosis_num_requests_running 0.0" in metrics
    assert server.count("symbiosis_generation_tokens_total", model_name="alice") - produced < 63


def test_a_client_gone_before_a_completion_ends_frees_its_sequences(serving):
    server, _, _ = serving
    # 64 sequences of 56 tokens, not streamed, through 8 cache slots (448 steps at least); the client
    # gives up after 0.2 s (the openai client's timeout closes the connection): the server cancels
    # what is left of them.
    def counts():
        return (server.count("symbiosis_request_success_total", finished_reason="abort", model_name="bob"),
                server.count("symbiosis_request_success_total", finished_reason="length", model_name="bob"),
                server.count("symbiosis_generation_tokens_total", model_name="bob"))

    aborted, ended, produced = counts()
    impatient = openai.OpenAI(base_url=server.url + "/v1", api_key=ADMIN, max_retries=0, timeout=0.2)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model="bob", prompt=PROMPTS[1], max_tokens=56, n=64, temperature=0,
                                     extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 30  # a bound on waiting, not a measure
    while time.monotonic() < deadline:
        now = counts()
        if now[0] - aborted + now[1] - ended == 64 and "symbiosis_num_requests_running 0.0" in server.metrics():
            break
        time.sleep(0.1)
    now = counts()
    assert now[0] - aborted + now[1] - ended == 64 and now[0] > aborted
    assert "symbiosis_num_requests_running 0.0" in server.metrics()
    assert now[2] - produced < 64 * 56
    # The server still serves: two tokens (sampled, so either may be EOS, or decode to no text: ignored).
    after = server.client().completions.create(model="bob", prompt=PROMPTS[1], max_tokens=2,
                                               extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 2 and after.choices[0].finish_reason == "length"


def test_64_concurrent_streams_each_equal_its_models_completion_and_metrics_count_them(serving):
    server, _, _ = serving
    client = server.client(asynchronous=True)
    models = [BASE, "alice", "bob"]

    async def streams():
        async def one(i):
            chunks = await client.completions.create(model=models[i % 3], prompt=PROMPTS[i % 2], max_tokens=4,
                                                     temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in chunks])

        alone = await asyncio.gather(*(client.completions.create(model=models[i % 3], prompt=PROMPTS[i % 2],
                                                                 max_tokens=4, temperature=0) for i in range(6)))
        return [r.choices[0].text for r in alone], await asyncio.gather(*(one(i) for i in range(64)))

    alone, streamed = asyncio.run(streams())
    assert streamed == [alone[i % 6] for i in range(64)]
    metrics = server.metrics()
    for model in models:
        assert f'symbiosis_time_to_first_token_seconds_count{{model_name="{model}"}}' in metrics
        assert f'symbiosis_time_per_output_token_seconds_bucket{{le="+Inf",model_name="{model}"}}' in metrics
    assert "symbiosis_num_requests_waiting 0.0" in metrics
