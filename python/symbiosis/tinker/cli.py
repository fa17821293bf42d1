"""symbiosis-tinker's command line (docs/tinker.md): the Tinker API over the executors' base models."""
import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Tuple

_DTYPES = ("bf16", "fp16", "fp32")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="symbiosis-tinker",
        description="Fine-tuning and sampling as a service with the Tinker API (the `tinker` SDK works against it "
                    "unmodified: ServiceClient(base_url=...)): each training run is a tenant of the shared executor, "
                    "and every run's samples batch together.")
    p.add_argument("--executor", default="tcp://127.0.0.1:5555",
                   help="the executor endpoint of the base models given without one")
    p.add_argument("--base-model", nargs="+", required=True, metavar="NAME=DIR[@ENDPOINT]",
                   help="a base model the API serves: its name in requests (e.g. meta-llama/Llama-3.2-1B), the "
                        "checkpoint folder an executor serves, and that executor when it is not --executor")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (0: any free one)")
    p.add_argument("--api-keys", metavar="FILE",
                   help='a JSON object {"KEY": "OWNER", ...}: only these keys are taken, each owning what it makes '
                        "(without it, any key is taken and is its own owner)")
    p.add_argument("--device", default="cpu", help="where the runs' adapters and the sampler live (cpu, cuda:N)")
    p.add_argument("--dtype", default="fp32", choices=_DTYPES, help="the runs' and the sampler's dtype")
    p.add_argument("--state-dir", default="tinker-state", help="where runs and checkpoints are kept")
    p.add_argument("--max-lora-rank", type=int, default=128, help="the largest LoRA rank a run may ask")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sampled sequences decoded at once, per base model")
    p.add_argument("--max-loras", type=int, default=16, help="sampler weights held at once, per base model")
    p.add_argument("--session-timeout-s", type=float, default=600.0,
                   help="a session not heard from (heartbeats, requests) for this long ends its runs' workers")
    p.add_argument("--max-model-len", type=int, default=0, help="positions a sequence may use (0: the model's, "
                                                                  "at most 4096)")
    return p


def _base_models(values: List[str], executor: str, p: argparse.ArgumentParser) -> Dict[str, Tuple[str, str]]:
    found: Dict[str, Tuple[str, str]] = {}
    for value in values:
        name, sep, rest = value.partition("=")
        folder, _, endpoint = rest.partition("@")
        if not sep or not name or not folder:
            p.error(f"--base-model {value!r}: expected NAME=DIR or NAME=DIR@ENDPOINT")
        if not os.path.exists(os.path.join(folder, "config.json")):
            p.error(f"--base-model {value!r}: {folder} is not a checkpoint folder (no config.json)")
        if not any(os.path.exists(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer.model")):
            p.error(f"--base-model {value!r}: {folder} has no tokenizer (tokenizer.json or tokenizer.model): the SDK "
                    "loads it by get_info's tokenizer_id, this folder")
        if name in found:
            p.error(f"--base-model: {name} is given twice")
        found[name] = (os.path.abspath(folder), endpoint or executor)
    return found


def _keys(path: Optional[str], p: argparse.ArgumentParser) -> Optional[Dict[str, str]]:
    if path is None:
        return None
    try:
        with open(path) as f:
            keys = json.load(f)
    except (OSError, ValueError) as error:
        p.error(f"--api-keys {path}: {error}")
    if not isinstance(keys, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
        p.error(f'--api-keys {path}: expected a JSON object {{"KEY": "OWNER", ...}}')
    return keys


def main(argv: Optional[List[str]] = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    models = _base_models(args.base_model, args.executor, p)
    keys = _keys(args.api_keys, p)

    import transformers

    import symbiosis
    from ..serve.cli import _eos_token_ids, _model_len, run_app
    from ..serve.engine import Engine
    from .app import Service, app
    from .sampler import BaseModel

    bases = {}
    try:
        for name, (folder, endpoint) in models.items():
            config = transformers.AutoConfig.from_pretrained(folder)
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
            max_len = args.max_model_len or _model_len(folder)
            client = symbiosis.Client.connect(endpoint, tenant=f"tinker-sampler {name}", device=args.device,
                                              expected_model_hash=symbiosis.model_hash(folder), latency_class="decode")
            engine = Engine(folder, client, device=args.device, dtype=args.dtype, max_sequences=args.max_num_seqs,
                            max_tokens=max_len, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
            bases[name] = BaseModel(name, folder, endpoint, engine, max_model_len=max_len, max_loras=args.max_loras,
                                    eos_token_ids=_eos_token_ids(folder, tokenizer), vocab_size=config.vocab_size,
                                    model_type=config.model_type,
                                    worker_settings={"device": args.device, "dtype": args.dtype})
    except (symbiosis.Error, OSError, ValueError) as error:
        print(f"symbiosis-tinker: {error}", file=sys.stderr)
        return 1
    os.makedirs(args.state_dir, exist_ok=True)
    service = Service(bases, os.path.abspath(args.state_dir), keys=keys, max_lora_rank=args.max_lora_rank,
                      session_timeout_s=args.session_timeout_s)

    try:
        return run_app(app(service), args.host, args.port, "symbiosis-tinker")
    finally:
        service.stop()

if __name__ == "__main__":
    sys.exit(main())
