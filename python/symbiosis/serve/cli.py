"""symbiosis-serve's command line: vLLM's flag names for what vLLM has, the tenant flags of the
other Symbiosis tools (examples/tenant_flags.h) for the executor connection. docs/serving.md."""
import argparse
import json
import os
import socket
import sys
from typing import Dict, List, Optional, Set

DEFAULT_MAX_MODEL_LEN = 4096  # a cap on the model's own context: the KV cache holds max_num_seqs of these
_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16",
           "float16": "fp16", "half": "fp16"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="symbiosis-serve",
        description="Serve a model and many LoRA adapters over an OpenAI-compatible HTTP API, the base layers "
                    "computed by a Symbiosis executor (docs/serving.md).")
    p.add_argument("--model", required=True, help="the checkpoint folder (the one the executor serves)")
    p.add_argument("--served-model-name", help="the base model's name in requests (default: --model as given)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="adapters served from the start: PEFT folders (or symbiosis-finetune runs' adapter folders)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    p.add_argument("--device", default="cpu", help="where the client layers and the KV cache live (cpu, cuda:N)")
    p.add_argument("--dtype", default="fp32", choices=sorted(_DTYPES), help="the client layers' dtype")
    p.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded at once (KV cache slots)")
    p.add_argument("--max-model-len", type=int,
                   help=f"positions per sequence, prompt and output (default: the model's, at most "
                        f"{DEFAULT_MAX_MODEL_LEN})")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="sequences waiting for a slot; beyond, requests get 429 with Retry-After")
    p.add_argument("--max-loras", type=int, default=8, help="adapters held at once")
    p.add_argument("--max-lora-rank", type=int, default=64, help="the largest LoRA rank an adapter may have")
    p.add_argument("--no-capture-decode", action="store_true", help="GPU: decode eagerly, not from CUDA graphs")
    p.add_argument("--decode-halves", action="store_true",
                   help="each decode step's sequences in two halves over two connections to the executor, one "
                        "computing while the other's calls are at the executor (docs/inference.md)")
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key", help="the one key every request must send (Authorization: Bearer KEY)")
    keys.add_argument("--api-keys", metavar="FILE",
                      help='a JSON object of keys, each to "*" (every model; may load and unload adapters) or a list '
                           'of the models it may use')
    tenant = p.add_argument_group("executor connection (as symbiosis-generate's)")
    tenant.add_argument("--executor", default="tcp://127.0.0.1:5555", help="executor endpoint")
    tenant.add_argument("--monolithic", action="store_true",
                        help="compute the base layers in this process instead of on an executor")
    tenant.add_argument("--tenant", default="serve", help="name shown in the executor's log")
    tenant.add_argument("--transport", default="auto", help="auto, tcp, shm, cuda-ipc or nccl")
    tenant.add_argument("--executor-key", default="",
                        help="an executor started with --keys: its public key (executor.pub)")
    tenant.add_argument("--key", default="", help="an executor started with --keys: this tenant's key pair (NAME.key)")
    tenant.add_argument("--connect-timeout-ms", type=int, default=10000,
                        help="how long to wait for the executor's answer to the handshake")
    tenant.add_argument("--reconnect-ms", type=int, default=60000,
                        help="how long to try to connect again to an executor that stopped or restarted (0: never)")
    tenant.add_argument("--mask", action="store_true",
                        help="mask activations with noise only this process knows (docs/privacy.md)")
    tenant.add_argument("--noise-ratio", type=float, default=4.0, help="with --mask: the noise's norm against each "
                                                                       "call's input's")
    tenant.add_argument("--mask-effects-here", action="store_true",
                        help="mask, and compute the noise's effects here from --model's weights")
    return p


def _lora_modules(values: List[str], p: argparse.ArgumentParser) -> Dict[str, str]:
    modules = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            p.error(f"--lora-modules {value!r}: expected NAME=PATH")
        if name in modules:
            p.error(f"--lora-modules: adapter name {name!r} is given twice")
        modules[name] = path
    return modules


def _keys(args, p: argparse.ArgumentParser) -> Optional[Dict[str, Optional[Set[str]]]]:
    if args.api_key:
        return {args.api_key: None}
    if not args.api_keys:
        return None
    try:
        with open(args.api_keys) as f:
            table = json.load(f)
    except (OSError, ValueError) as error:
        p.error(f"--api-keys {args.api_keys}: {error}")
    if not isinstance(table, dict) or not table:
        p.error(f'--api-keys {args.api_keys}: expected a JSON object {{"KEY": "*" or ["model", ...]}}')
    keys = {}
    for key, models in table.items():
        if models == "*":
            keys[key] = None
        elif isinstance(models, list) and all(isinstance(m, str) for m in models):
            keys[key] = set(models)
        else:
            p.error(f'--api-keys {args.api_keys}: key {key[:4]}...\'s value is {json.dumps(models)}, expected "*" '
                    "or a list of model names")
    return keys


def _model_len(checkpoint: str) -> int:
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    for field in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        if isinstance(config.get(field), int):
            return min(config[field], DEFAULT_MAX_MODEL_LEN)
    return DEFAULT_MAX_MODEL_LEN


def _eos_token_ids(checkpoint: str, tokenizer) -> List[int]:
    """What ends a request as transformers' generate ends it: generation_config.json's eos_token_id
    (an id or a list), else the tokenizer's EOS."""
    ids = []
    path = os.path.join(checkpoint, "generation_config.json")
    if os.path.exists(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not ids and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return ids


def main(argv: Optional[List[str]] = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    modules = _lora_modules(args.lora_modules, p)
    keys = _keys(args, p)

    import transformers

    import symbiosis
    from .app import Keys, Server
    from .engine import Engine
    from .protocol import ApiError

    if not any(os.path.exists(os.path.join(args.model, f)) for f in ("tokenizer.json", "tokenizer.model")):
        p.error(f"--model {args.model} has no tokenizer (tokenizer.json or tokenizer.model beside config.json): "
                "symbiosis-serve takes and gives text")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as error:
        p.error(f"--model {args.model}: its tokenizer does not load: {error}")
    max_model_len = args.max_model_len or _model_len(args.model)
    try:
        client = None
        if not args.monolithic:
            client = symbiosis.Client.connect(
                args.executor, tenant=args.tenant, device=args.device, transport=args.transport,
                expected_model_hash=symbiosis.model_hash(args.model), connect_timeout_ms=args.connect_timeout_ms,
                reconnect_ms=args.reconnect_ms, latency_class="decode", executor_key=args.executor_key,
                key_file=args.key, mask=args.mask or args.mask_effects_here, noise_ratio=args.noise_ratio,
                mask_effects_checkpoint=args.model if args.mask_effects_here else "")
        engine = Engine(args.model, client, device=args.device, dtype=_DTYPES[args.dtype],
                        max_sequences=args.max_num_seqs, max_tokens=max_model_len, max_waiting=args.max_waiting,
                        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                        capture_decode=not args.no_capture_decode, decode_halves=args.decode_halves)
        server = Server(engine, tokenizer, base_name=args.served_model_name or args.model, checkpoint=args.model,
                        max_model_len=max_model_len, eos_token_ids=_eos_token_ids(args.model, tokenizer),
                        keys=Keys(keys))
        for name, path in modules.items():
            server.load_adapter(name, path)
    except (symbiosis.Error, ApiError, OSError) as error:
        print(f"symbiosis-serve: {error}", file=sys.stderr)
        return 1

    return run_app(server.app(), args.host, args.port, "symbiosis-serve")


def run_app(app, host: str, port: int, program: str) -> int:
    """Serves the ASGI `app` on host:port with uvicorn until it is stopped; 1 when the address
    cannot be had (said on stderr, naming the flags). The socket is bound here so that --port 0
    has its port before the ready line ([Ready line] in base_executor/main.cpp: as the executor's
    "ready ENDPOINT", one line on stdout once requests are taken)."""
    import uvicorn

    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as error:
        print(f"{program}: --host {host} --port {port}: {error}", file=sys.stderr)
        return 1
    listener.listen(2048)
    bound_host, bound_port = listener.getsockname()[:2]
    print(f"ready http://{bound_host}:{bound_port}", flush=True)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[listener])
    return 0

if __name__ == "__main__":
    sys.exit(main())
