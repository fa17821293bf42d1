"""The Python-tenant benchmark (issue 29; docs/python.md, "Benchmark"): on one GPU, how many Python
tenants (transformers + PEFT LoRA over Symbiosis, bench/python_tenant_client.py) fit against how
many plain transformers + PEFT jobs (the same script holding its own base), and the Python tenants'
tokens/s against as many C++ tenants (symbiosis-bench-client) on the same executor.

  python3 bench/python_tenants.py --model /tmp/llama-13b --build .gpu-build --out /tmp/python-13b

In order, under one executor (bf16, opportunistic batching, 150 us, as gpu_llama13b_capacity.json):
1. Python tenants start in waves (at most --wave at once, no more than the memory left fits by the
   memory each running one has taken) until one fails or --limit run; they step all the while
   (--stop-file). Then every one that fit steps through one common window of --window-s seconds:
   their aggregate tokens/s is the steps that end inside it. Tenants that fit: those whose run ended
   well (a tenant that runs out of memory in the window does not count).
2. As many C++ tenants on the same executor, over a window of the same length ([Measurement window]
   in bench/bench_client.cpp; eager steps, as the Python tenants', unless --cpp-cuda-graph).
3. The executor stopped, plain transformers + PEFT jobs start the same way (the first alone, to learn
   its memory) until one fails or --plain-limit run.
Each client's figures are the same whatever the GPU; the counts are the GPU's. Writes
OUT/python_tenants.json and OUT/python_tenants.md (a table), and prints the table.
"""
import argparse
import os
import sys
import time

from executor_process import executor_binary, start_executor
from harness import (ClientFiles, MemorySampler, Processes, add_run_flags, add_step_flags, ask_to_stop, error_tail,
                     go_window, gpu_index, gpu_memory_mib, logger, nvidia_smi, remove, run_to_the_end, wait_warm,
                     window_figures, write_results)

HERE = os.path.dirname(os.path.abspath(__file__))
log = logger("python_tenants")
# Every client process started, so that a run cut short ends those still running (main).
PROCESSES = Processes()


def python_client(a, index, directory, executor=""):
    args = [sys.executable, os.path.join(HERE, "python_tenant_client.py"), "--model", a.model, "--batch", str(a.batch),
            "--seq", str(a.seq), "--rank", str(a.rank), "--targets", a.targets, "--warmup", str(a.warmup),
            "--device", a.device, "--dtype", a.dtype, "--seed", str(index + 1),
            "--out", os.path.join(directory, f"client{index}.json")]
    if executor:
        args += ["--executor", executor]
    if a.gradient_checkpointing:
        args.append("--gradient-checkpointing")
    return args


def wait_for_memory(gpu, baseline_mib, slack_mib=1024, timeout_s=60):
    """Until the GPU's memory in use is back within slack_mib of baseline_mib (at most timeout_s)."""
    deadline = time.time() + timeout_s
    while gpu >= 0 and time.time() < deadline:
        used = gpu_memory_mib(gpu)[0]
        if used <= baseline_mib + slack_mib:
            return
        time.sleep(0.5)
    log(f"GPU memory still {gpu_memory_mib(gpu)[0]:.0f} MiB after {timeout_s} s (baseline {baseline_mib:.0f})")


def capacity(a, name, make_args, limit, wave, first_wave, window_s):
    """Clients (make_args(index, directory)) start in waves until one fails or `limit` run, then all
    step through one window. Returns the figures."""
    directory = os.path.join(a.out, name)
    os.makedirs(directory, exist_ok=True)
    stop_file = os.path.join(directory, "stop")
    remove(stop_file)
    gpu = gpu_index(a.device)
    before, total = gpu_memory_mib(gpu)
    sampler = MemorySampler(gpu)
    running, reason, size = [], f"reached the limit of {limit}", first_wave
    began = time.time()
    while len(running) < limit and reason.startswith("reached"):
        if running and total > 0:
            per_client = (sampler.peak - before) / len(running)
            size = max(1, min(wave, int((total - sampler.peak) / per_client))) if per_client > 0 else wave
        starting = []
        for index in range(len(running), min(limit, len(running) + size)):
            files = ClientFiles(directory, f"client{index}")
            files.remove_stale()
            args = make_args(index, directory) + ["--ready-file", files.ready, "--stop-file", stop_file]
            starting.append((index, files, PROCESSES.spawn(args, directory, files.name)))
        for index, files, process in starting:
            if wait_warm(process, files.ready, poll_s=0.2) == "warm":
                running.append((index, files, process))
            else:
                reason = f"client {index} failed (exit {process.wait()}): {error_tail(files.err, 2)}"
        log(f"{name}: {len(running)} running, GPU peak {sampler.peak:.0f} of {total:.0f} MiB")
    warm_s = time.time() - began
    # Every running client steps through one common window.
    start = time.time() + 1.0
    time.sleep(1.0 + window_s)
    end = time.time()
    ask_to_stop(stop_file)
    results, fit = [], 0
    for index, files, process in running:
        if process.wait() == 0:
            fit += 1
            results.append(files.results())
        else:
            reason += f"; client {index} failed in the window (exit {process.returncode})"
    peak = sampler.stop()
    figures = {"clients_that_fit": fit, "started": len(running), "stopped_because": reason,
               "gpu_memory_before_mib": before, "gpu_memory_peak_mib": peak, "gpu_memory_total_mib": total,
               "gpu_memory_per_client_mib": (peak - before) / max(len(running), 1), "seconds_to_start": warm_s,
               "window_s": end - start,
               "client_peak_reserved_gib": [round(r["gpu_peak_reserved_bytes"] / 2**30, 2) for r in results]}
    figures.update(window_figures(results, start, end))
    log(f"{name}: {fit} fit ({reason}); {figures['tokens_per_s']:.0f} tokens/s over the window")
    return figures


def cpp_window(a, executor, count, window_s):
    """`count` C++ tenants on `executor` over one window ([Measurement window])."""
    directory = os.path.join(a.out, "cpp")
    os.makedirs(directory, exist_ok=True)
    go = os.path.join(directory, "go")
    remove(go)
    clients = []
    for index in range(count):
        files = ClientFiles(directory, f"client{index}")
        files.remove_stale()
        args = [os.path.join(a.build, "bench", "symbiosis-bench-client"), "--executor", executor, "--model", a.model,
                "--mode", "finetune", "--batch", str(a.batch), "--seq", str(a.seq), "--rank", str(a.rank),
                "--targets", a.targets, "--warmup", str(a.warmup), "--device", a.device, "--dtype", a.dtype,
                "--threads", "1", "--seed", str(index + 1), "--out", files.json,
                "--ready-file", files.ready, "--go-file", go]
        if a.cpp_cuda_graph:
            args.append("--cuda-graph")
        clients.append((f"C++ tenant {index}", PROCESSES.spawn(args, directory, files.name), files))
    results, _ = go_window(clients, go, window_s)
    tokens = sum(r["tokens_per_iteration"] * r["iterations"] for r in results)
    latencies = [latency for r in results for latency in r["latencies_s"]]
    figures = {"clients": count, "cuda_graph": a.cpp_cuda_graph, "tokens_per_s": tokens / window_s,
               "mean_step_s": sum(latencies) / len(latencies) if latencies else 0.0, "steps_in_window": len(latencies),
               "client_peak_reserved_gib": [round(r.get("gpu_peak_reserved_bytes", 0) / 2**30, 2) for r in results]}
    log(f"cpp: {count} tenants, {figures['tokens_per_s']:.0f} tokens/s over the window")
    return figures


def table(result):
    py, cpp, plain = result.get("python_tenants"), result.get("cpp_tenants"), result.get("plain_jobs")
    rows = [f"Python tenants against plain transformers + PEFT jobs and C++ tenants; {result['gpu']}, {result['shape']}",
            "",
            "| system | clients that fit | GPU memory a client (MiB) | tokens/s at that count | mean step (s) |",
            "| --- | --- | --- | --- | --- |"]
    if py:
        rows.append(f"| Python tenants (transformers + PEFT over Symbiosis) | {py['clients_that_fit']} | "
                    f"{py['gpu_memory_per_client_mib']:.0f} | {py['tokens_per_s']:.0f} | {py['mean_step_s']:.3f} |")
    if cpp:
        rows.append(f"| C++ tenants, same count ({'captured' if cpp['cuda_graph'] else 'eager'}) | {cpp['clients']} (run) | "
                    f"- | {cpp['tokens_per_s']:.0f} | {cpp['mean_step_s']:.3f} |")
    if plain:
        rows.append(f"| plain transformers + PEFT jobs | {plain['clients_that_fit']} | "
                    f"{plain['gpu_memory_per_client_mib']:.0f} | {plain['tokens_per_s']:.0f} | {plain['mean_step_s']:.3f} |")
    rows.append("")
    for key in ("error", "cpp_error"):
        if key in result:
            rows.append(f"FAILED ({key}): {result[key]}")
    if py and plain and plain["clients_that_fit"]:
        rows.append(f"capacity: {py['clients_that_fit']} / {plain['clients_that_fit']} = "
                    f"{result['capacity_ratio']:.2f}x (target >= 4x; Python tenants stopped because: {py['stopped_because']})")
    if cpp and cpp["tokens_per_s"]:
        rows.append(f"tokens/s: Python tenants / C++ tenants at {cpp['clients']} = {result['python_vs_cpp_tokens']:.2f}")
    return "\n".join(rows) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_flags(p, "the results' folder (python_tenants.json, python_tenants.md, each client's files)")
    add_step_flags(p)
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="transformers' gradient checkpointing in every Python job (tenants and plain jobs alike)")
    p.add_argument("--limit", type=int, default=24, help="most Python tenants started")
    p.add_argument("--wave", type=int, default=4, help="most clients started at once")
    p.add_argument("--plain-limit", type=int, default=8, help="most plain transformers + PEFT jobs started (0: none)")
    p.add_argument("--window-s", type=float, default=8.0)
    p.add_argument("--cpp", action=argparse.BooleanOptionalAction, default=True, help="run as many C++ tenants")
    p.add_argument("--cpp-cuda-graph", action="store_true", help="the C++ tenants replay captured steps")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)

    gpu = gpu_index(a.device)
    name = nvidia_smi(gpu, "name") if gpu >= 0 else "cpu"
    result = {"gpu": f"{name} ({gpu_memory_mib(gpu)[1]:.0f} MiB)", "model": a.model,
              "shape": f"LoRA r{a.rank} on {a.targets}, {a.batch} x {a.seq} tokens, {a.dtype}, AdamW"
                       + (", gradient checkpointing" if a.gradient_checkpointing else "")}
    ran = run_to_the_end(lambda: run(a, gpu, result), result, log, PROCESSES)
    write_results(a.out, "python_tenants", result, table(result))
    sys.exit(0 if ran else 1)


def run(a, gpu, result):
    flags = ["--device", a.device, "--dtype", a.dtype, "--batching", "opportunistic", "--max-wait", "150",
             "--log-level", "warn"]
    if a.device == "cpu":
        flags += ["--threads", "1"]  # a CPU smoke run: its GEMM threads would take the cores the clients need
    with start_executor(executor_binary(a.build), a.model, flags, os.path.join(a.out, "executor.err")) as executor:
        endpoint = executor.address
        executor_mib = gpu_memory_mib(gpu)[0]
        log(f"executor ready at {endpoint}, GPU {executor_mib:.0f} MiB in use")
        result["executor_gpu_mib"] = executor_mib
        result["python_tenants"] = capacity(a, "python", lambda i, d: python_client(a, i, d, endpoint), a.limit, a.wave,
                                            a.wave, a.window_s)
        count = result["python_tenants"]["clients_that_fit"]
        if a.cpp and count > 0:
            # Under MPS an ended tenant's memory comes back a while after its process has gone: C++
            # tenants started at once ran out of memory beside it (PY3 in
            # docs/benchmarks-history.md).
            wait_for_memory(gpu, executor_mib)
            try:  # a failure here leaves the plain jobs still to measure
                result["cpp_tenants"] = cpp_window(a, endpoint, count, a.window_s)
                result["python_vs_cpp_tokens"] = (result["python_tenants"]["tokens_per_s"]
                                                  / max(result["cpp_tenants"]["tokens_per_s"], 1e-9))
            except RuntimeError as error:
                result["cpp_error"] = str(error)
                log(f"cpp: {error}")
    if a.plain_limit > 0:
        # The first plain job alone: it holds a whole base, and several loading at once could each
        # take part of the memory and all fail.
        result["plain_jobs"] = capacity(a, "plain", lambda i, d: python_client(a, i, d), a.plain_limit, a.wave, 1,
                                        a.window_s)
        if result["plain_jobs"]["clients_that_fit"]:
            result["capacity_ratio"] = result["python_tenants"]["clients_that_fit"] / result["plain_jobs"]["clients_that_fit"]


if __name__ == "__main__":
    main()
