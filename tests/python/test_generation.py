"""symbiosis.Generator ([Python generation], python/symbiosis/generation.py): a Python tenant's greedy
generation through the C++ engine, split over the executor or monolithic, with a PEFT LoRA adapter
saved by PEFT (split also in [Decode halves]), equals transformers + PEFT greedy `generate` on the
local model, prompt by prompt,
while the engine batches prompts of different lengths together; a refused request refuses its batch
with an error naming the field, and the generator goes on serving."""
import peft
import pytest
import torch

import symbiosis
from conftest import greedy_generate, reference_model, served

ARCHITECTURES = ["llama", "qwen2", "gpt2"]  # one of each kind of model the C++ runtime builds
TARGETS = {"llama": ["q_proj", "v_proj"], "qwen2": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}
EOS = 2
PROMPTS = [[1, 17, 45, 99, 3], [1, 8], [1, 120, 5, 66, 70, 71, 33, 12, 9], [1, 64, 64]]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def adapted(request, tmp_path_factory):
    """(architecture, checkpoint, executor, adapter folder, the PEFT model on the local model)."""
    architecture = request.param
    with served(architecture) as (checkpoint, executor):
        torch.manual_seed(3)
        # init_lora_weights=False: B is random too, so the adapter changes what is generated.
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[architecture], init_lora_weights=False)
        model = peft.get_peft_model(reference_model(checkpoint), config)
        adapter = tmp_path_factory.mktemp(f"adapter-{architecture}")
        model.save_pretrained(adapter)
        yield architecture, checkpoint, executor, str(adapter), model


@pytest.mark.parametrize("split,halves", [(True, False), (True, True), (False, False)],
                         ids=["split", "split-decode-halves", "monolithic"])
def test_greedy_generation_equals_peft_generate(adapted, split, halves):
    architecture, checkpoint, executor, adapter, model = adapted
    client = symbiosis.Client.connect(executor.endpoint, tenant="generate") if split else None
    generator = symbiosis.Generator(checkpoint, client, adapter=adapter, max_sequences=4, max_tokens=48,
                                    decode_halves=halves)
    results = generator.generate(PROMPTS, max_new_tokens=12, stop_token_ids=[EOS], logprobs=True)
    assert [r.prompt_ids for r in results] == PROMPTS
    for prompt, result in zip(PROMPTS, results):
        want = greedy_generate(model, prompt, 12, EOS)[0]
        assert result.output_ids == want, f"{architecture}, prompt {prompt}"
        assert result.finish_reason == ("stop" if want[-1] == EOS else "length")
        assert len(result.logprobs) == len(result.output_ids) and all(p <= 0 for p in result.logprobs)
    if split:
        assert client.calls > 0  # the base layers ran on the executor


@pytest.mark.parametrize("adapted", ["llama"], indirect=True)  # what follows is the engine's, not the model's
def test_a_refused_request_is_named_and_the_generator_goes_on(adapted):
    _, checkpoint, executor, adapter, model = adapted
    generator = symbiosis.Generator(checkpoint, symbiosis.Client.connect(executor.endpoint), adapter=adapter,
                                    max_sequences=2, max_tokens=32)
    with pytest.raises(symbiosis.Error, match="prompt"):
        generator.generate([[1, 5, 6], [1, 10_000]], max_new_tokens=4)
    with pytest.raises(symbiosis.Error, match="temperature"):
        generator.generate([[1, 5, 6]], temperature=-1.0)
    [result] = generator.generate([[1, 5, 6]], max_new_tokens=4, stop_token_ids=[EOS])
    assert result.output_ids == greedy_generate(model, [1, 5, 6], 4, EOS)[0]


@pytest.mark.parametrize("adapted", ["llama"], indirect=True)
def test_sampling_is_reproducible_from_the_seed(adapted):
    _, checkpoint, _, adapter, _ = adapted
    generator = symbiosis.Generator(checkpoint, adapter=adapter, max_sequences=2, max_tokens=32)
    first, second = (generator.generate([[1, 5, 6], [1, 5, 6]], max_new_tokens=8, temperature=1.0, seed=7)
                     for _ in range(2))
    assert [r.output_ids for r in first] == [r.output_ids for r in second]
    assert len(first[0].output_ids) == 8
