"""The FSDP baseline of the sharded-local benchmark (issue 31; bench/sharded_local.py runs it): one LoRA
fine-tuning job over several devices as a PyTorch user would run it without Symbiosis. transformers'
model of --model (SDPA attention) in --dtype, PEFT LoRA (--rank, --alpha, --targets, adapters in the
model's dtype as Symbiosis keeps them), every decoder layer and then the whole model sharded with
FSDP (`fully_shard`, FSDP2: each rank holds 1/world of every weight and all-gathers a layer's to
compute it), AdamW; each step trains on --batch random sequences of --seq tokens in all, split over
the ranks (data parallel), so a step is the same work as one Symbiosis tenant's step of that batch.

One process per device in --devices (`cuda:0,cuda:1`: NCCL; `cpu,cpu`: Gloo), started here with
torch.multiprocessing and joined through a FileStore (or started by torchrun, which sets RANK,
WORLD_SIZE and LOCAL_RANK). The model is built on the meta device and sharded there, so each rank
reads only its rows of each weight from the safetensors files ([Sharded load]).

Protocol ([Measurement window] in bench/bench_client.cpp, as bench/python_tenant_client.py):
--warmup untimed steps, then rank 0 creates --ready-file; with --stop-file the job steps until that
file exists, else it runs --iterations steps. Rank 0 writes --out with the keys of
symbiosis-bench-client's JSON and each step's end time (`step_end_epoch_s`). A rank that runs out of
memory ends the job with status 3, saying so. --verify-loss: the first step's loss against plain
transformers on one device (the CPU smoke test's exactness check).
  python3 bench/fsdp_peft.py --model DIR --devices cuda:0,cuda:1 --batch 2 --seq 512 --out r.json
"""
import argparse
import ctypes
import datetime
import json
import math
import os
import signal
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from harness import Window, add_client_flags, client_result, mark_ready, torch_dtype, write_json

OUT_OF_MEMORY = 3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_client_flags(p, go_file=False)  # --batch: all ranks together, a multiple of the ranks
    p.add_argument("--devices", default="cuda:0,cuda:1", help="one rank per device listed: cuda:N (NCCL) or cpu (Gloo)")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads a rank (0: PyTorch's default)")
    p.add_argument("--verify-loss", type=float, default=0.0,
                   help="check the first step's loss against plain transformers on rank 0's device within this "
                        "relative tolerance (0: no check)")
    a = p.parse_args(argv)
    a.devices = a.devices.split(",")
    if a.batch % len(a.devices) != 0:
        p.error(f"--batch {a.batch} is not a multiple of the {len(a.devices)} ranks of --devices")
    return a


# [Sharded load] A rank's share of a weight is what FSDP2's fully_shard gives it: dim 0 cut as
# torch.chunk cuts it (ceil(rows / world) rows a rank, the last ranks fewer or none). Each rank reads
# only those rows of the checkpoint's tensor (safetensors slices, from the page cache that every
# job's ranks share) into its local shard, so no process ever holds a whole copy of the model.
def shard_rows(rows, rank, world):
    per_rank = math.ceil(rows / world)
    start = min(rows, rank * per_rank)
    return start, min(rows, start + per_rank)


def copy_into_shard(param, read_rows):
    """Copies this rank's rows of a full tensor into `param` (a DTensor shard or a plain tensor);
    read_rows(start, end) returns rows [start, end) of the full tensor."""
    local = param.to_local() if hasattr(param, "to_local") else param
    if hasattr(param, "to_local"):
        start, end = shard_rows(param.shape[0], dist.get_rank(), dist.get_world_size())
    else:
        start, end = 0, param.shape[0]
    if end > start:
        local[: end - start].copy_(read_rows(start, end))


class CheckpointReader:
    """The tensors of a Hugging Face checkpoint (one model.safetensors or shards with an index), by name,
    a range of rows at a time."""

    def __init__(self, directory):
        from safetensors import safe_open

        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = json.load(f)["weight_map"]
        else:
            files = None
        self.files = {}
        self.where = {}
        for name in sorted(set(files.values())) if files else ["model.safetensors"]:
            handle = safe_open(os.path.join(directory, name), framework="pt")
            self.files[name] = handle
            for key in handle.keys():
                self.where[key] = handle

    def has(self, name):
        return name in self.where

    def rows(self, name, start, end):
        return self.where[name].get_slice(name)[start:end]


def attention(config):
    """sdpa, except for models that soft-cap attention scores (Gemma 2), which sdpa cannot: transformers
    refuses it for them, and eager is what it computes them with."""
    return "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"


def build_model(a, device, mesh):
    """The LoRA model, sharded by FSDP2 over `mesh`, its base weights read from --model, its adapters
    initialized as PEFT does (every rank from the same generator)."""
    import peft
    from accelerate import init_empty_weights  # a dependency of peft
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(a.model)
    # Parameters on the meta device; buffers computed in __init__ (the rotary embedding's
    # frequencies) real, on the CPU, and in the dtype transformers' own loading gives them (made
    # under the model's default dtype, as from_pretrained does).
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype(a.dtype))
    try:
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attention(config))
    finally:
        torch.set_default_dtype(default_dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    lora = peft.LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=0.0, target_modules=a.targets.split(","),
                           task_type="CAUSAL_LM")
    # Adapters in the model's dtype, as Symbiosis's tenants keep them (PEFT would upcast to fp32).
    model = peft.get_peft_model(model, lora, autocast_adapter_dtype=False)
    base = model.get_base_model()
    buffers = {name: buffer.detach().clone() for name, buffer in base.named_buffers()}
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(base, mesh=mesh)
    base.to_empty(device=device)  # every parameter and buffer allocated, none set

    reader = CheckpointReader(a.model)
    generator = torch.Generator().manual_seed(a.seed)
    with torch.no_grad():
        for name, buffer in base.named_buffers():
            buffer.copy_(buffers[name])
        for name, param in base.named_parameters():
            if "lora_" in name:
                # PEFT's default: A Kaiming-uniform (a = sqrt(5)), B zero, so the adapter starts as nothing.
                full = torch.zeros(param.shape, dtype=torch.float32)
                if "lora_A" in name:
                    bound = 1.0 / math.sqrt(param.shape[1])  # kaiming_uniform_ with a = sqrt(5)
                    full.uniform_(-bound, bound, generator=generator)
                copy_into_shard(param, lambda s, e, full=full, param=param: full[s:e].to(param.dtype))
                continue
            key = name.replace(".base_layer.", ".")
            if not reader.has(key) and key == "lm_head.weight" and config.tie_word_embeddings:
                key = "model.embed_tokens.weight"
            if not reader.has(key):
                raise RuntimeError(f"{a.model} has no tensor {key} (for parameter {name})")
            copy_into_shard(param, lambda s, e, key=key, param=param: reader.rows(key, s, e).to(param.dtype))
    model.train()
    return model


def reference_loss(a, ids):
    """The first step's loss of plain transformers + PEFT on one CPU: --verify-loss's reference."""
    import peft
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch_dtype(a.dtype), attn_implementation=attention(config))
    lora = peft.LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=0.0, target_modules=a.targets.split(","),
                           task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lora, autocast_adapter_dtype=False)
    with torch.no_grad():
        return model(input_ids=ids.cpu(), labels=ids.cpu()).loss.item()


def peak_reserved(device):
    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0


def worker(local_rank, a, store_path):
    # Started by this script: die with the launcher, whatever kills it (no rank may outlive its job
    # and hold a GPU's memory).
    if store_path is not None:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        rank, world = local_rank, len(a.devices)
    else:  # torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    device = torch.device(a.devices[local_rank])
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=5)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if store_path is not None:
        store = dist.FileStore(store_path, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh

    try:
        run(a, rank, world, device, init_device_mesh(device.type, (world,)))
    except torch.OutOfMemoryError as error:
        print(f"fsdp_peft rank {rank}: out of memory: {str(error).splitlines()[0]}", file=sys.stderr, flush=True)
        os._exit(OUT_OF_MEMORY)  # the other ranks wait in a collective: the launcher ends them
    # Every rank done (rank 0's results written): end without tearing the process group down, whose
    # destructors at exit have aborted a Gloo rank ("terminate called without an active exception").
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(a, rank, world, device, mesh):
    model = build_model(a, device, mesh)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    vocab = model.get_base_model().config.vocab_size
    # The step's sequences, the same on every rank; each rank trains on its rows.
    ids = torch.randint(0, vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(a.seed + 1))
    per_rank = a.batch // world
    local_ids = ids[rank * per_rank:(rank + 1) * per_rank].to(device)
    flag = torch.zeros(1, device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=local_ids, labels=local_ids).loss
        loss.backward()
        optimizer.step()
        sync()
        return loss.detach()

    def agree(value):
        """The largest of every rank's `value`: the ranks stop at the same step."""
        flag.fill_(value)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item()

    first_loss = step()
    dist.all_reduce(first_loss)  # the mean over the ranks (each the mean of as many tokens): the whole batch's
    first_loss = first_loss.item() / world
    if a.verify_loss > 0 and rank == 0:
        reference = reference_loss(a, ids)
        error = abs(first_loss - reference) / abs(reference)
        print(f"fsdp_peft: first loss {first_loss:.6f}, plain transformers + PEFT {reference:.6f} "
              f"(relative error {error:.2e})", file=sys.stderr, flush=True)
        if error > a.verify_loss:
            raise SystemExit(f"fsdp_peft: the first loss is off by {error:.2e} (> {a.verify_loss})")
    for _ in range(max(0, a.warmup - 1)):
        step()
    agree(0)  # every rank warm
    if rank == 0:
        mark_ready(a.ready_file)

    # [Measurement window] as harness.run_window's, but the ranks decide together when to stop.
    latencies, ends = [], []
    start = time.time()
    while True:
        if a.stop_file:
            if agree(1.0 if rank == 0 and os.path.exists(a.stop_file) else 0.0):
                break
        elif len(latencies) >= a.iterations:
            break
        t0 = time.time()
        loss = step()
        t1 = time.time()
        latencies.append(t1 - t0)
        ends.append(t1)
    end = time.time()
    reserved = torch.tensor([float(peak_reserved(device))], device=device)
    dist.all_reduce(reserved, op=dist.ReduceOp.MAX)
    if rank != 0:
        return
    write_json(a.out, client_result(
        a, Window(start, end, latencies, ends), "fsdp_peft", a.batch * a.seq, device=",".join(a.devices),
        world_size=world, step_end_epoch_s=ends, first_loss=first_loss,
        last_loss=loss.item() if latencies else first_loss,
        gpu_peak_reserved_bytes=int(reserved.item())))  # the largest of the ranks'


def main():
    a = parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun: this process is one rank
        worker(0, a, None)
        return
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="fsdp-peft-") as directory:
        context = mp.start_processes(worker, args=(a, os.path.join(directory, "store")), nprocs=len(a.devices),
                                     join=False, start_method="spawn")
        # A SIGTERM (a timeout, the benchmark stopping) ends every rank with this launcher (exiting
        # normally would wait for them: multiprocessing joins its children at exit).
        def end(*_):
            for process in context.processes:
                process.kill()
            os._exit(143)

        signal.signal(signal.SIGTERM, end)
        try:
            while not context.join():
                pass
        except mp.ProcessExitedException as error:
            # A rank that failed ends the job (join has ended the others): its status is the job's.
            print(f"fsdp_peft: {error}", file=sys.stderr, flush=True)
            sys.exit(error.exit_code if error.exit_code and error.exit_code > 0 else 1)
        except mp.ProcessRaisedException as error:
            print(f"fsdp_peft: {error}", file=sys.stderr, flush=True)
            sys.exit(1)


if __name__ == "__main__":
    main()
