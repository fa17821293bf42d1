"""Issue 31's sharded benchmarks: one base model served by a sharded executor over several GPUs (one
part a GPU, docs/sharding.md) with fine-tuning tenants on the same GPUs (sharded-local) or on GPUs of
their own (sharded-remote, --client-gpus), against PyTorch FSDP jobs with transformers + PEFT over
all the GPUs either uses (bench/fsdp_peft.py, one job of one rank a GPU per adapter). The figure:
adapters fine-tuned in the same time, i.e. adapters trained at once and their aggregate tokens/s,
Symbiosis against FSDP.

  python3 bench/sharded_local.py --model /tmp/llama-13b --build .gpu-build --gpus 0,1 --out /tmp/sharded-13b
  python3 bench/sharded_local.py --model /tmp/gemma-27b --build .gpu-build --gpus 0,1 --client-gpus 2,3 ...
  python3 bench/sharded_local.py --model /tmp/tiny --build build --device cpu --parts 2 --dtype fp32 ...  # smoke

In order:
1. Symbiosis: `symbiosis-executor --gpus 0,1` (on CPU `--parts N --device cpu`) starts its parts; then
   for each count in --counts, that many symbiosis-bench-client tenants (LoRA, AdamW, eager steps
   unless --cuda-graph) start at once, tenant i on part i % parts and that part's GPU (cuda-ipc; shm
   on CPU) or, sharded-remote, on client GPU i % client GPUs (NCCL; --remote on CPU: TCP), and all
   step through one common window of --window-s seconds ([Measurement window] in
   bench/bench_client.cpp), then end. The executor stays up from one count to the next. A count
   where a tenant fails (out of memory) ends the counts: the count before it is the most that fit.
2. FSDP: with the executor stopped, FSDP jobs (each over all the GPUs, the client GPUs too; on CPU
   --parts ranks, twice that with --remote) start in waves: the first
   alone, to learn its memory, then at most --fsdp-wave at once and no more than the memory left
   fits by what each running job took, until a job fails (out of memory) or --fsdp-limit run. They
   step all the while (--stop-file); after each wave every running job steps through one window of
   --window-s seconds, cut afterwards from each job's step end times.
Aggregate tokens/s of a window: the tokens of the steps that end inside it over its length. Writes
OUT/sharded_local.json and OUT/sharded_local.md (a table, its placement named), and prints the table. A run cut short
(SIGTERM, e.g. a timeout) still writes what it measured and ends every process it started.
"""
import argparse
import os
import socket
import subprocess
import sys
import time

from executor_process import (NotReady, ReadyProcess, descendants_of, end_process, executor_binary,
                              executor_command, wait_all_ready)
from harness import (ClientFiles, MemorySampler, Processes, add_run_flags, add_step_flags, ask_to_stop, error_tail,
                     go_window, gpu_memory_mib, logger, nvidia_smi, remove, run_to_the_end, wait_warm, window_figures,
                     write_results)

HERE = os.path.dirname(os.path.abspath(__file__))
log = logger("sharded_local")
# Every process started (main ends those still running), their ids also in OUT/pids (main),
# for a caller to end should this run be killed past its own clean-up. Each starts in a session of
# its own: a timeout's signal to this run's process group reaches this driver alone, which then
# closes the windows and ends its processes in order (a job signalled at once would lose its figures).
PROCESSES = Processes()


def spawn(args, directory, name):
    return PROCESSES.spawn(args, directory, name, new_session=True)


class GpuMemory:
    """Peak memory in use of each GPU (nvidia-smi, every process's) while alive; nothing on CPU."""

    def __init__(self, gpus):
        self.gpus = gpus
        self.before = [gpu_memory_mib(g)[0] for g in gpus]
        self.total = [gpu_memory_mib(g)[1] for g in gpus]
        self.samplers = [MemorySampler(g) for g in gpus]

    def peaks(self):
        return [s.peak for s in self.samplers]

    def stop(self):
        return [s.stop() for s in self.samplers]

    def per_process_and_left(self, running):
        """(MiB each running process has taken on its busiest GPU, MiB left on the fullest GPU)."""
        if not self.gpus or running == 0:
            return 0.0, 0.0
        taken = max((p - b) / running for p, b in zip(self.peaks(), self.before))
        left = min(t - p for t, p in zip(self.total, self.peaks()))
        return taken, left


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_executor(a, directory):
    """([its ReadyProcesses], [endpoint of each part in rank order]) once every part is ready: the
    launcher (`--gpus`; on CPU `--parts`), or with --parts-by-hand one process a part, started as
    docs/operating.md starts a multi-host executor's, each on a GPU seen alone (CUDA_VISIBLE_DEVICES:
    the part computes on its cuda:0)."""
    flags = ["--dtype", a.dtype, "--batching", a.batching, "--max-wait", str(a.max_wait_us), "--log-level", "warn"]
    if a.device == "cpu":
        flags += ["--threads", "1"]  # a smoke run: a part's GEMM threads would take the cores the clients need

    def start(name, what, part_flags, ready_lines=1, env=None):
        executor = ReadyProcess(executor_command(executor_binary(a.build), a.model, *flags, *part_flags),
                                os.path.join(directory, name + ".err"), what, ready_lines=ready_lines, env=env,
                                new_session=True, stdout_path=os.path.join(directory, name + ".out"),
                                descendants=True)
        PROCESSES.add(executor.process)
        return executor

    if a.parts_by_hand:
        rendezvous = f"127.0.0.1:{free_port()}"
        executors = []
        for rank in range(a.parts):
            env = dict(os.environ)
            if a.device == "cuda":
                env["CUDA_VISIBLE_DEVICES"] = str(a.gpus[rank])
            executors.append(start(f"part{rank}", f"executor part {rank}",
                                   ["--device", "cpu" if a.device == "cpu" else "cuda:0", "--rank", str(rank),
                                    "--world-size", str(a.parts), "--rendezvous", rendezvous], env=env))
    else:
        executors = [start("executor", "the sharded executor",
                           ["--parts", str(a.parts), "--device", "cpu"] if a.device == "cpu"
                           else ["--gpus", ",".join(str(g) for g in a.gpus)], ready_lines=a.parts)]
    began = time.time()
    try:
        wait_all_ready(executors, a.start_timeout_s)
    except NotReady as error:
        raise RuntimeError(f"the sharded executor did not start: {error}") from None
    for executor in executors:
        PROCESSES.record(descendants_of(executor.process.pid))  # the launcher's parts
    endpoints = [endpoint for executor in executors for endpoint in executor.addresses]
    log(f"sharded executor ready in {time.time() - began:.0f} s: {' '.join(endpoints)}")
    return executors, endpoints


def tenant_placement(a, index):
    """(the part tenant `index` attaches to, its device, its transport)."""
    part = index % a.parts
    if a.device == "cpu":
        return part, "cpu", "tcp" if a.remote else "shm"
    if a.client_gpus:
        return part, f"cuda:{a.client_gpus[index % len(a.client_gpus)]}", "nccl"
    return part, f"cuda:{a.gpus[part]}", "cuda-ipc"


def tenant_args(a, index, endpoints, files, go):
    part, device, transport = tenant_placement(a, index)
    args = [os.path.join(a.build, "bench", "symbiosis-bench-client"), "--executor", endpoints[part],
            "--model", a.model, "--mode", "finetune", "--batch", str(a.batch), "--seq", str(a.seq),
            "--rank", str(a.rank), "--targets", a.targets, "--warmup", str(a.warmup), "--device", device,
            "--dtype", a.dtype, "--transport", transport, "--threads", "1",
            "--seed", str(index + 1), "--out", files.json, "--ready-file", files.ready, "--go-file", go]
    if a.cuda_graph:
        args.append("--cuda-graph")
    return args


def symbiosis_count(a, endpoints, count):
    """`count` tenants over one window: the figures, or raises RuntimeError naming the tenant that failed."""
    directory = os.path.join(a.out, "symbiosis", f"n{count}")
    os.makedirs(directory, exist_ok=True)
    go = os.path.join(directory, "go")
    remove(go)
    memory = GpuMemory(a.gpus + a.client_gpus)
    began = time.time()
    clients = []
    for i in range(count):
        files = ClientFiles(directory, f"tenant{i}")
        files.remove_stale()
        clients.append((f"tenant {i} of {count}", spawn(tenant_args(a, i, endpoints, files, go), directory, files.name),
                        files))
    try:
        results, warm_at = go_window(clients, go, a.window_s, a.tenant_timeout_s)
    finally:
        peaks = memory.stop()
    warm_s = warm_at - began
    tokens = sum(r["tokens_per_iteration"] * r["iterations"] for r in results)
    latencies = [latency for r in results for latency in r["latencies_s"]]
    figures = {"adapters": count, "tokens_per_s": tokens / a.window_s, "steps_in_window": len(latencies),
               "mean_step_s": sum(latencies) / len(latencies) if latencies else 0.0, "seconds_to_warm": warm_s,
               "gpu_memory_peak_mib": peaks, "transport": results[0]["transport"] if results else "",
               "tenant_gpu_peak_reserved_gib": [round(r.get("gpu_peak_reserved_bytes", 0) / 2**30, 2) for r in results]}
    figures["tokens_per_s_an_adapter"] = figures["tokens_per_s"] / count
    log(f"symbiosis: {count} tenants, {figures['tokens_per_s']:.0f} tokens/s, mean step {figures['mean_step_s']:.3f} s, "
        f"GPU peak {peaks} MiB")
    return figures


def run_symbiosis(a, result):
    directory = os.path.join(a.out, "symbiosis")
    os.makedirs(directory, exist_ok=True)
    before = [gpu_memory_mib(g)[0] for g in a.gpus]
    executors, endpoints = start_executor(a, directory)
    section = {"counts": [], "stopped_because": f"reached the last count ({a.counts[-1]})"}
    result["symbiosis"] = section
    try:
        section["executor_gpu_mib"] = [gpu_memory_mib(g)[0] - b for g, b in zip(a.gpus, before)]
        for count in a.counts:
            try:
                section["counts"].append(symbiosis_count(a, endpoints, count))
            except RuntimeError as error:
                section["stopped_because"] = str(error)
                log(f"symbiosis: {error}")
                break
            ended = [e for e in executors if not e.running()]
            if ended:
                section["stopped_because"] = (f"the executor ended (exit {ended[0].process.returncode}): "
                                              + " / ".join(error_tail(e.log_path) for e in executors))
                break
    finally:
        for executor in executors:
            executor.stop(60)


def fsdp_devices(a):
    """One FSDP rank a GPU of either side (on CPU: a rank a part, and as many again with --remote)."""
    if a.device == "cpu":
        return ["cpu"] * a.parts * (2 if a.remote else 1)
    return [f"cuda:{g}" for g in a.gpus + a.client_gpus]


def fsdp_args(a, index, files, stop_file):
    devices = ",".join(fsdp_devices(a))
    args = [sys.executable, os.path.join(HERE, "fsdp_peft.py"), "--model", a.model, "--devices", devices,
            "--dtype", a.dtype, "--batch", str(a.fsdp_batch), "--seq", str(a.seq), "--rank", str(a.rank),
            "--targets", a.targets, "--warmup", str(a.warmup), "--seed", str(index + 1),
            "--out", files.json, "--ready-file", files.ready, "--stop-file", stop_file]
    if a.device == "cpu":
        args += ["--threads", "1"]
    return args


def run_fsdp(a, result):
    directory = os.path.join(a.out, "fsdp")
    os.makedirs(directory, exist_ok=True)
    stop_file = os.path.join(directory, "stop")
    remove(stop_file)
    for i in range(a.fsdp_limit):
        ClientFiles(directory, f"job{i}").remove_stale()
    memory = GpuMemory(a.gpus + a.client_gpus)
    section = {"jobs": [], "windows": [], "stopped_because": f"reached the limit of {a.fsdp_limit}",
               "batch": a.fsdp_batch}
    result["fsdp"] = section
    running = []  # (index, process, ClientFiles) of the jobs that are warm and stepping
    began = time.time()
    try:
        while len(running) < a.fsdp_limit:
            size = 1
            if running:
                taken, left = memory.per_process_and_left(len(running))
                size = max(1, min(a.fsdp_wave, int(left / taken))) if taken > 0 else a.fsdp_wave
            starting = []
            for index in range(len(running), min(a.fsdp_limit, len(running) + size)):
                files = ClientFiles(directory, f"job{index}")
                starting.append((index, spawn(fsdp_args(a, index, files, stop_file), directory, files.name), files))
            failed = ""
            for index, process, files in starting:
                state = wait_warm(process, files.ready, began + a.fsdp_deadline_s, poll_s=0.2)
                if state == "warm":
                    running.append((index, process, files))
                elif state == "late":
                    end_process(process, 10)
                    failed = failed or f"job {index} not warm when --fsdp-deadline-s {a.fsdp_deadline_s:.0f} passed"
                else:
                    failed = failed or (f"job {index} failed while starting (exit {process.wait()}): "
                                        f"{error_tail(files.err)}")
            for _, process, _ in running:
                if process.poll() is not None and not failed:
                    failed = f"a running job ended (exit {process.returncode}) while others started"
            running = [job for job in running if job[1].poll() is None]
            log(f"fsdp: {len(running)} jobs running, GPU peak {memory.peaks()} of {memory.total} MiB"
                + (f"; {failed}" if failed else ""))
            jobs = [i for i, _, _ in running]
            if running and (len(section["windows"]) == 0 or section["windows"][-1]["jobs"] != jobs):
                start = time.time() + 0.5
                time.sleep(0.5 + a.window_s)
                section["windows"].append({"jobs": jobs, "start": start, "end": time.time(),
                                           "gpu_memory_peak_mib": memory.peaks()})
            if failed:
                section["stopped_because"] = failed
                break
            if time.time() - began > a.fsdp_deadline_s:
                section["stopped_because"] = f"--fsdp-deadline-s {a.fsdp_deadline_s} passed"
                break
    except BaseException as error:  # a timeout's SIGTERM: the windows measured so far still count
        section["stopped_because"] = f"cut short ({type(error).__name__}: {error})"
        raise
    finally:
        ask_to_stop(stop_file)
        results = {}
        for index, process, files in running:
            try:
                process.wait(120)
            except subprocess.TimeoutExpired:
                end_process(process, 10)
            if process.returncode == 0 and os.path.exists(files.json):
                results[index] = files.results()
            else:
                section["stopped_because"] += f"; job {index} failed while running (exit {process.returncode})"
        section["gpu_memory_total_mib"] = memory.total
        section["gpu_memory_before_mib"] = memory.before
        peaks = memory.stop()
        section["gpu_memory_peak_mib"] = peaks
        if section["windows"] and memory.gpus:
            # From the last window's peak: the overall one also holds what a job that failed to start took.
            last = section["windows"][-1]
            section["gpu_memory_per_job_mib"] = max((p - b) / len(last["jobs"])
                                                    for p, b in zip(last["gpu_memory_peak_mib"], memory.before))
        for window in section["windows"]:
            measured = [results[i] for i in window["jobs"] if i in results]
            window.update(window_figures(measured, window["start"], window["end"]))
            window["adapters"] = len(window["jobs"])
            window["jobs_measured"] = len(measured)  # a job that failed later has no figures
            window["tokens_per_s_an_adapter"] = window["tokens_per_s"] / max(len(measured), 1)
            window["job_gpu_peak_reserved_gib"] = [round(r["gpu_peak_reserved_bytes"] / 2**30, 2) for r in measured]
            log(f"fsdp: {window['adapters']} jobs, {window['tokens_per_s']:.0f} tokens/s, "
                f"mean step {window['mean_step_s']:.3f} s")


def compare(result):
    """The largest count each system ran whole, and Symbiosis against FSDP there."""
    counts = result.get("symbiosis", {}).get("counts", [])
    windows = [w for w in result.get("fsdp", {}).get("windows", []) if w.get("jobs_measured") == w.get("adapters")]
    if not counts or not windows or not min(counts[-1]["tokens_per_s"], max(w["tokens_per_s"] for w in windows)):
        return
    ours, theirs = counts[-1], max(windows, key=lambda w: (w["adapters"], w["tokens_per_s"]))
    result["comparison"] = {
        "symbiosis_adapters": ours["adapters"], "fsdp_adapters": theirs["adapters"],
        "adapters_ratio": ours["adapters"] / theirs["adapters"],
        "symbiosis_tokens_per_s": ours["tokens_per_s"], "fsdp_tokens_per_s": theirs["tokens_per_s"],
        "tokens_ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
        "symbiosis_tokens_per_s_an_adapter": ours["tokens_per_s_an_adapter"],
        "fsdp_tokens_per_s_an_adapter": theirs["tokens_per_s_an_adapter"]}


def table(result):
    rows = [f"{result['placement']} against FSDP: {result['hardware']}; {result['shape']}", "",
            "| system | adapters at once | aggregate tokens/s | tokens/s an adapter | mean step (s) | GPU peak MiB |",
            "| --- | --- | --- | --- | --- | --- |"]
    for c in result.get("symbiosis", {}).get("counts", []):
        rows.append(f"| Symbiosis {result['placement']} ({c['transport']}) | {c['adapters']} | {c['tokens_per_s']:.0f} | "
                    f"{c['tokens_per_s_an_adapter']:.0f} | {c['mean_step_s']:.3f} | "
                    f"{' / '.join(f'{m:.0f}' for m in c['gpu_memory_peak_mib']) or '-'} |")
    for w in result.get("fsdp", {}).get("windows", []):
        partial = "" if w["jobs_measured"] == w["adapters"] else f" ({w['jobs_measured']} measured)"
        rows.append(f"| FSDP + PEFT, {result['fsdp']['batch']} sequences a step | {w['adapters']}{partial} | "
                    f"{w['tokens_per_s']:.0f} | {w['tokens_per_s_an_adapter']:.0f} | {w['mean_step_s']:.3f} | "
                    f"{' / '.join(f'{m:.0f}' for m in w['gpu_memory_peak_mib']) or '-'} |")
    rows.append("")
    if "symbiosis" in result:
        s = result["symbiosis"]
        rows.append(f"Symbiosis: executor {' / '.join(f'{m:.0f}' for m in s.get('executor_gpu_mib', [])) or '-'} MiB "
                    f"a GPU; counts stopped because: {s['stopped_because']}")
    if "fsdp" in result:
        f = result["fsdp"]
        per_job = f" ({f['gpu_memory_per_job_mib']:.0f} MiB a job on its busiest GPU)" if "gpu_memory_per_job_mib" in f else ""
        rows.append(f"FSDP{per_job}: stopped because: {f['stopped_because']}")
    if "comparison" in result:
        c = result["comparison"]
        rows.append(f"adapters at once: {c['symbiosis_adapters']} / {c['fsdp_adapters']} = {c['adapters_ratio']:.2f}x; "
                    f"aggregate tokens/s there (adapters fine-tuned in the same time): {c['symbiosis_tokens_per_s']:.0f} / "
                    f"{c['fsdp_tokens_per_s']:.0f} = {c['tokens_ratio']:.2f}x (target >= {result['target']}x); tokens/s an adapter "
                    f"{c['symbiosis_tokens_per_s_an_adapter']:.0f} / {c['fsdp_tokens_per_s_an_adapter']:.0f}")
    for key in ("symbiosis_error", "fsdp_error", "error"):
        if key in result:
            rows.append(f"FAILED ({key}): {result[key]}")
    return "\n".join(rows) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_flags(p, "the results' folder (sharded_local.json, sharded_local.md, pids, every process's files)",
                  device="cuda", devices=("cuda", "cpu"))
    p.add_argument("--gpus", default="0,1", help="cuda: the GPUs, one executor part and one FSDP rank each")
    p.add_argument("--client-gpus", default="",
                   help="cuda, sharded-remote: the tenants' GPUs (over NCCL), one FSDP rank each too")
    p.add_argument("--remote", action="store_true", help="cpu, sharded-remote: tenants over TCP, twice the FSDP ranks")
    p.add_argument("--parts", type=int, default=2, help="cpu: executor parts and FSDP ranks")
    add_step_flags(p)  # --batch: sequences a tenant's step
    p.add_argument("--fsdp-batch", type=int, default=0,
                   help="sequences an FSDP job's step, all ranks together (default: --batch, the same step, "
                        "rounded up to a multiple of the ranks)")
    p.add_argument("--batching", default="opportunistic", choices=["none", "lockstep", "opportunistic"],
                   help="the executor's batching policy")
    p.add_argument("--max-wait-us", type=int, default=150, help="the executor's opportunistic batching wait")
    p.add_argument("--counts", default="2,4,8,16", help="tenants at once, in order")
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--cuda-graph", action="store_true", help="the tenants replay captured steps")
    p.add_argument("--fsdp-limit", type=int, default=8, help="most FSDP jobs started (0: none)")
    p.add_argument("--fsdp-wave", type=int, default=4, help="most FSDP jobs started at once")
    p.add_argument("--fsdp-deadline-s", type=float, default=360,
                   help="start no FSDP wave after this many seconds of the FSDP part (a job not warm by then stops)")
    p.add_argument("--start-timeout-s", type=float, default=300, help="longest the executor takes to start")
    p.add_argument("--tenant-timeout-s", type=float, default=150,
                   help="longest a count's tenants take to warm, and to end after the window (a hung tenant costs no more)")
    p.add_argument("--parts-by-hand", action="store_true",
                   help="start each part as its own process (not the --gpus launcher), each GPU seen alone")
    p.add_argument("--skip-symbiosis", action="store_true")
    a = p.parse_args()
    a.counts = [int(c) for c in a.counts.split(",") if c]
    if a.device == "cpu" and a.client_gpus:
        p.error("--client-gpus is for --device cuda; on the CPU, --remote puts the tenants on TCP")
    if a.device == "cuda" and a.remote:
        p.error("--remote is for --device cpu; on GPUs, --client-gpus names the tenants' GPUs")
    a.gpus = [] if a.device == "cpu" else [int(g) for g in a.gpus.split(",")]
    a.client_gpus = [int(g) for g in a.client_gpus.split(",") if g]
    if set(a.gpus) & set(a.client_gpus):
        p.error(f"--client-gpus {a.client_gpus} share a GPU with --gpus {a.gpus} (sharded-remote keeps them apart)")
    a.remote = a.remote or bool(a.client_gpus)
    if a.device == "cuda":
        a.parts = len(a.gpus)
    ranks = len(fsdp_devices(a))
    a.fsdp_batch = a.fsdp_batch or -(-a.batch // ranks) * ranks
    os.makedirs(a.out, exist_ok=True)
    PROCESSES.keep_pids_in(os.path.join(a.out, "pids"))

    if a.gpus:
        name = nvidia_smi(a.gpus[0], "name")
        hardware = (f"{len(a.gpus + a.client_gpus)} x "
                    + (f"{name}, {gpu_memory_mib(a.gpus[0])[1]:.0f} MiB" if name else "GPU"))
    else:
        hardware = f"CPU, {a.parts} parts"
    result = {"hardware": hardware, "model": a.model, "placement": "sharded-remote" if a.remote else "sharded-local",
              "target": 3 if a.remote else 4,  # the (the paper's Figures 16 and 17)
              "shape": f"LoRA r{a.rank} on {a.targets}, {a.batch} x {a.seq} tokens a step, {a.dtype}, AdamW, "
                       f"{a.window_s:.0f} s windows; executor batching {a.batching}"
                       + (f" {a.max_wait_us} us" if a.batching == "opportunistic" else "")}

    def run():
        if not a.skip_symbiosis:
            try:
                run_symbiosis(a, result)
            except RuntimeError as error:  # the FSDP jobs are still measured
                result["symbiosis_error"] = str(error)
                log(f"symbiosis: {error}")
        if a.fsdp_limit > 0:
            run_fsdp(a, result)

    failed = not run_to_the_end(run, result, log, PROCESSES) or "symbiosis_error" in result
    # Nothing measured on a side is a failure (a count or a wave that did not fit is not).
    if not a.skip_symbiosis and not result.get("symbiosis", {}).get("counts"):
        failed = True
    if a.fsdp_limit > 0 and not result.get("fsdp", {}).get("windows"):
        failed = True
    compare(result)
    write_results(a.out, "sharded_local", result, table(result))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
