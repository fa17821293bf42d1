"""What the Python package's tests share: tiny random transformers models of each architecture, saved
as checkpoints; an executor process serving one; comparisons within a relative tolerance.

ctest runs these with PYTHONPATH naming python/ and the build's python/ (tests/python/CMakeLists.txt)
and the programs' paths in SYMBIOSIS_EXECUTOR, SYMBIOSIS_DEMO_CLIENT, SYMBIOSIS_MAKE_CHECKPOINT."""
import contextlib
import json
import os
import sys
import tempfile

import peft
import pytest
import torch

# The benchmarks' and tests' one launcher of programs that print a ready line (bench/executor_process.py).
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from executor_process import ReadyProcess, executor_command  # noqa: E402

BUILD = os.environ.get("SYMBIOSIS_BINARY_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build"))
EXECUTOR = os.environ.get("SYMBIOSIS_EXECUTOR", os.path.join(BUILD, "base_executor", "symbiosis-executor"))
DEMO_CLIENT = os.environ.get("SYMBIOSIS_DEMO_CLIENT", os.path.join(BUILD, "examples", "symbiosis-demo-client"))
MAKE_CHECKPOINT = os.environ.get("SYMBIOSIS_MAKE_CHECKPOINT", os.path.join(BUILD, "tools", "symbiosis-make-checkpoint"))

TOLERANCE = 1e-5  # fp32 on CPU (DESIGN.md, invariant 1)
VOCAB = 128



def _configs():
    import transformers as t

    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                 pad_token_id=0)
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return {
        "llama": t.LlamaConfig(num_key_value_heads=2, **small),
        "mistral": t.MistralConfig(num_key_value_heads=2, sliding_window=None, **small),
        "qwen2": t.Qwen2Config(num_key_value_heads=2, **small),  # q, k and v carry a bias
        "gemma2": t.Gemma2Config(num_key_value_heads=2, head_dim=8, sliding_window=16, **small),
        "gpt2": t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                             bos_token_id=1, eos_token_id=2, **no_dropout),  # Conv1D
        "gpt_bigcode": t.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                          multi_query=True, bos_token_id=1, eos_token_id=2, **no_dropout),
        "phi3": t.Phi3Config(num_key_value_heads=4, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                             **small),  # fused qkv_proj and gate_up_proj
        "opt": t.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                           dropout=0.0, attention_dropout=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        "qwen3": t.Qwen3Config(num_key_value_heads=2, head_dim=8, **small),
        "phi": t.PhiConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=64, resid_pdrop=0.0, embd_pdrop=0.0,
                           attention_dropout=0.0, bos_token_id=1, eos_token_id=2),
    }


ARCHITECTURES = ["llama", "mistral", "qwen2", "gemma2", "gpt2", "gpt_bigcode", "phi3", "opt", "qwen3", "phi"]


def reference_model(checkpoint):
    """The model ours is held to: transformers' own, in one process (CPU, fp32, eager attention)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager").eval()


def make_checkpoint(architecture, directory, seed=0):
    """A tiny random model of `architecture`, saved as a Hugging Face checkpoint in `directory`."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_configs()[architecture], dtype=torch.float32)
    model.save_pretrained(directory)
    return directory


class Executor(ReadyProcess):
    """A symbiosis-executor process serving `checkpoint` on `device` (this machine's CPU unless
    said otherwise), on a free port: its endpoint; its stderr in CHECKPOINT/executor.log."""

    def __init__(self, checkpoint, extra_args=(), device="cpu"):
        super().__init__(executor_command(EXECUTOR, checkpoint, "--device", device, "--threads", "1", *extra_args),
                         os.path.join(checkpoint, "executor.log"), "executor")
        self.wait_ready(timeout_s=60)
        self.endpoint = self.address


class TinkerServer(ReadyProcess):
    """A symbiosis-tinker process on a free port (args: its flags); url: its base URL. Its clients
    are the tinker SDK's, with KEY unless told another. Stopping it first finishes the sessions of
    the ServiceClients it made, as a user's `with ServiceClient(...)` does: their heartbeats stop
    rather than wake the SDK's daemon thread while the interpreter shuts down."""

    KEY = "tml-alice-key"

    def __init__(self, args, log_path):
        program = os.environ.get("SYMBIOSIS_TINKER", os.path.join(BUILD, "examples", "symbiosis-tinker"))
        super().__init__([program, "--port", "0", *args], log_path, "symbiosis-tinker")
        self.sessions = []  # the ServiceClients service() made
        self.wait_ready(timeout_s=120)
        self.url = self.address

    def service(self, key=KEY):
        import tinker

        client = tinker.ServiceClient(base_url=self.url, api_key=key)
        self.sessions.append(client)
        return client

    def stop(self, timeout_s=30):
        try:
            for client in self.sessions:
                client.close("success").result(timeout=timeout_s)
        finally:  # the process ends even where a session could not be finished
            self.sessions = []
            super().stop(timeout_s)

    def rest(self, key=KEY):
        import tinker

        return tinker.RestClient(base_url=self.url, api_key=key)

    def workers(self):
        """The pids of the server's worker processes: the children of its fork server (a CPU
        server's, [Forked workers] in python/symbiosis/tinker/runs.py)."""
        import psutil

        server = psutil.Process(self.process.pid)
        return {p.pid for p in server.children(recursive=True) if p.ppid() != server.pid}


@contextlib.contextmanager
def served(architecture, seed=0):
    """(checkpoint directory, executor) for a tiny random model of `architecture`."""
    with tempfile.TemporaryDirectory(prefix=f"symbiosis-py-{architecture}-") as directory:
        make_checkpoint(architecture, directory, seed)
        executor = Executor(directory)
        try:
            yield directory, executor
        finally:
            executor.stop()


@pytest.fixture(scope="module", params=ARCHITECTURES)
def architecture_served(request):
    """(architecture, checkpoint, executor), once per architecture for a test module."""
    with served(request.param) as (checkpoint, executor):
        yield request.param, checkpoint, executor


def relative_difference(a, b):
    """max |a - b| / max |a| (0 when both are 0)."""
    a, b = a.detach().double(), b.detach().double()
    scale = a.abs().max().item()
    return (a - b).abs().max().item() / scale if scale > 0 else (a - b).abs().max().item()


def assert_close(a, b, what, tolerance=TOLERANCE):
    assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} and {tuple(b.shape)}"
    difference = relative_difference(a, b)
    assert difference <= tolerance, f"{what}: relative difference {difference:.3g} > {tolerance}"


def tokens(batch=2, length=9, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[{{ m['content'] }}]"
                 "{% else %}<{{ m['role'] }}>{{ m['content'] }}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def add_tokenizer(checkpoint):
    """A BPE tokenizer of the model's 128 ids (3 special tokens, then what BPE learns of a small
    text), its chat template in tokenizer_config.json as most checkpoints keep it."""
    import tokenizers
    import transformers

    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tokenizer.decoder = tokenizers.decoders.Metaspace()
    text = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?", "system user assistant",
            "A B C D E F G H I J K L M N O P Q R S T U V W X Y Z 0 1 2 3 4 5 6 7 8 9 . , ! ? : ; ' - ( ) [ ] < > /\n"]
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=128, special_tokens=["<pad>", "<s>", "</s>"],
                                             show_progress=False)
    tokenizer.train_from_iterator(text, trainer)
    assert tokenizer.get_vocab_size() == 128
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    fast.save_pretrained(checkpoint)
    config_path = os.path.join(checkpoint, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump(dict(config, chat_template=CHAT_TEMPLATE), f)


def save_lora(checkpoint, directory, seed, **config):
    """A LoRA adapter (peft.LoraConfig's `config`) of the model in `checkpoint`, saved by PEFT in `directory`."""
    torch.manual_seed(seed)
    # init_lora_weights=False: B is random too, so the adapter changes what is generated.
    model = peft.get_peft_model(reference_model(checkpoint), peft.LoraConfig(init_lora_weights=False, **config))
    model.save_pretrained(directory)
    return str(directory)


def greedy_generate(model, prompt, max_new_tokens, eos=2):
    """transformers' (+ PEFT's) greedy generate on one prompt: the ids produced up to and with the first
    `eos`, and their log-probabilities."""
    with torch.no_grad():
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    ids = out.sequences[0, len(prompt):].tolist()
    ids = ids[:ids.index(eos) + 1] if eos in ids else ids
    logprobs = [torch.log_softmax(logits[0].float(), -1)[token].item() for logits, token in zip(out.logits, ids)]
    return ids, logprobs


def lora(model, seed=1):
    # init_lora_weights=False: B is random too, so that every LoRA gradient is non-zero from the start.
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    return peft.get_peft_model(model, config)


def trainable(model):
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def train(model, client, steps, record=lambda out, model: out.loss.detach()):
    """`steps` AdamW steps (lr 1e-2) on tokens(seed=step) as their own labels, the same dropout masks
    in every run; a split model's client settles before each update. Returns record(output, model)
    of each step, taken before its update."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    records = []
    for step in range(steps):
        ids = tokens(seed=step)
        torch.manual_seed(100 + step)
        out = model(ids, labels=ids)
        out.loss.backward()
        if client is not None:
            client.settle()  # every base-layer call has its result before the adapters change
        records.append(record(out, model))
        optimizer.step()
        optimizer.zero_grad()
    return records
