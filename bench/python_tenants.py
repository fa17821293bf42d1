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
import json
import os
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# Every client process started, so that a run cut short kills those still running (main's finally).
SPAWNED = []


def gpu_index(device):
    return int(device.split(":")[1]) if device.startswith("cuda:") else (0 if device == "cuda" else -1)


def gpu_memory_mib(gpu):
    """(used, total) MiB of GPU `gpu` by nvidia-smi (the whole GPU: every process, MPS's too); (0, 0) without one."""
    if gpu < 0:
        return 0.0, 0.0
    try:
        line = subprocess.run(["nvidia-smi", "-i", str(gpu), "--query-gpu=memory.used,memory.total",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30).stdout
        used, total = (float(v) for v in line.strip().split(","))
        return used, total
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0.0, 0.0


class MemorySampler:
    """The GPU's peak memory in use while alive (nvidia-smi every 0.5 s)."""

    def __init__(self, gpu):
        self.gpu, self.peak, self._stop = gpu, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, gpu_memory_mib(self.gpu)[0])
            self._stop.wait(0.5)

    def stop(self):
        self._stop.set()
        self._thread.join()
        return self.peak


def log(message):
    print(f"[python_tenants {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def spawn(args, directory, name):
    out = open(os.path.join(directory, name + ".out"), "w")
    err = open(os.path.join(directory, name + ".err"), "w")
    process = subprocess.Popen(args, stdout=out, stderr=err)
    SPAWNED.append(process)
    return process


def tail(path, lines=3):
    try:
        with open(path) as f:
            return " | ".join(line.strip() for line in f.read().splitlines()[-lines:])
    except OSError:
        return ""


def start_executor(a, directory):
    """(process, endpoint) of an executor serving --model on --device, once it says it is ready."""
    args = [os.path.join(a.build, "base_executor", "symbiosis-executor"), "--model", a.model, "--device", a.device,
            "--dtype", a.dtype, "--listen", "tcp://127.0.0.1:*", "--batching", "opportunistic", "--max-wait", "150",
            "--log-level", "warn"]
    if a.device == "cpu":
        args += ["--threads", "1"]  # a CPU smoke run: its GEMM threads would take the cores the clients need
    err = open(os.path.join(directory, "executor.err"), "w")
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True)
    line = [""]
    reader = threading.Thread(target=lambda: line.__setitem__(0, process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(600)
    if not line[0].startswith("ready "):
        process.kill()
        raise RuntimeError(f"the executor did not start: {line[0]!r}; {tail(err.name)}")
    return process, line[0].split()[1]


def stop(process, sig=signal.SIGTERM, timeout_s=60):
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


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


def window_figures(results, start, end):
    """Aggregate tokens/s of the steps that end in [start, end], and their mean step time."""
    tokens, latencies = 0.0, []
    for r in results:
        for t, latency in zip(r["step_end_epoch_s"], r["latencies_s"]):
            if start <= t <= end:
                tokens += r["tokens_per_iteration"]
                latencies.append(latency)
    return {"tokens_per_s": tokens / max(end - start, 1e-9),
            "mean_step_s": sum(latencies) / len(latencies) if latencies else 0.0, "steps_in_window": len(latencies)}


def capacity(a, name, make_args, limit, wave, first_wave, window_s):
    """Clients (make_args(index, directory)) start in waves until one fails or `limit` run, then all
    step through one window. Returns the figures."""
    directory = os.path.join(a.out, name)
    os.makedirs(directory, exist_ok=True)
    stop_file = os.path.join(directory, "stop")
    if os.path.exists(stop_file):
        os.remove(stop_file)
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
            ready = os.path.join(directory, f"client{index}.ready")
            args = make_args(index, directory) + ["--ready-file", ready, "--stop-file", stop_file]
            starting.append((index, ready, spawn(args, directory, f"client{index}")))
        for index, ready, process in starting:
            while not os.path.exists(ready) and process.poll() is None:
                time.sleep(0.2)
            if os.path.exists(ready) and process.poll() is None:
                running.append((index, process))
            else:
                process.wait()
                reason = f"client {index} failed (exit {process.returncode}): {tail(os.path.join(directory, f'client{index}.err'), 2)}"
        log(f"{name}: {len(running)} running, GPU peak {sampler.peak:.0f} of {total:.0f} MiB")
    warm_s = time.time() - began
    # Every running client steps through one common window.
    start = time.time() + 1.0
    time.sleep(1.0 + window_s)
    end = time.time()
    with open(stop_file, "w") as f:
        f.write("stop\n")
    results, fit = [], 0
    for index, process in running:
        process.wait()
        if process.returncode == 0:
            fit += 1
            with open(os.path.join(directory, f"client{index}.json")) as f:
                results.append(json.load(f))
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
    if os.path.exists(go):
        os.remove(go)
    processes = []
    for index in range(count):
        args = [os.path.join(a.build, "bench", "symbiosis-bench-client"), "--executor", executor, "--model", a.model,
                "--mode", "finetune", "--batch", str(a.batch), "--seq", str(a.seq), "--rank", str(a.rank),
                "--targets", a.targets, "--warmup", str(a.warmup), "--device", a.device, "--dtype", a.dtype,
                "--threads", "1", "--seed", str(index + 1), "--out", os.path.join(directory, f"client{index}.json"),
                "--ready-file", os.path.join(directory, f"client{index}.ready"), "--go-file", go]
        if a.cpp_cuda_graph:
            args.append("--cuda-graph")
        processes.append(spawn(args, directory, f"client{index}"))
    for index, process in enumerate(processes):
        while not os.path.exists(os.path.join(directory, f"client{index}.ready")):
            if process.poll() is not None:
                for p in processes:
                    stop(p, signal.SIGKILL)
                raise RuntimeError(f"C++ tenant {index} exited: {tail(os.path.join(directory, f'client{index}.err'))}")
            time.sleep(0.1)
    start = time.time() + 0.5
    with open(go + ".tmp", "w") as f:
        f.write(f"{start} {start + window_s}\n")
    os.rename(go + ".tmp", go)
    results = []
    for index, process in enumerate(processes):
        if process.wait() != 0:
            raise RuntimeError(f"C++ tenant {index} failed: {tail(os.path.join(directory, f'client{index}.err'))}")
        with open(os.path.join(directory, f"client{index}.json")) as f:
            results.append(json.load(f))
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
    p.add_argument("--model", required=True, help="checkpoint directory (e.g. symbiosis-make-checkpoint --preset llama-2-13b)")
    p.add_argument("--build", required=True, help="the build tree holding base_executor/ and bench/ (build, .gpu-build)")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    p.add_argument("--warmup", type=int, default=2)
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
    name = subprocess.run(["nvidia-smi", "-i", str(gpu), "--query-gpu=name", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip() if gpu >= 0 else "cpu"
    result = {"gpu": f"{name} ({gpu_memory_mib(gpu)[1]:.0f} MiB)", "model": a.model,
              "shape": f"LoRA r{a.rank} on {a.targets}, {a.batch} x {a.seq} tokens, {a.dtype}, AdamW"
                       + (", gradient checkpointing" if a.gradient_checkpointing else "")}
    failed = False
    # A timeout's SIGTERM ends the run as an error: its clients are killed and what was measured is written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped by SIGTERM (a timeout?)"))
    try:
        run(a, gpu, result)
    except (Exception, SystemExit) as error:  # the figures measured so far are still written
        result["error"] = f"{type(error).__name__}: {error}"
        log(f"failed: {result['error']}")
        failed = True
    finally:
        for process in SPAWNED:
            if process.poll() is None:
                process.kill()
                process.wait()
    with open(os.path.join(a.out, "python_tenants.json"), "w") as f:
        json.dump(result, f, indent=2)
    text = table(result)
    with open(os.path.join(a.out, "python_tenants.md"), "w") as f:
        f.write(text)
    print(text)
    sys.exit(1 if failed else 0)


def run(a, gpu, result):
    executor, endpoint = start_executor(a, a.out)
    try:
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
    finally:
        stop(executor)
    if a.plain_limit > 0:
        # The first plain job alone: it holds a whole base, and several loading at once could each
        # take part of the memory and all fail.
        result["plain_jobs"] = capacity(a, "plain", lambda i, d: python_client(a, i, d), a.plain_limit, a.wave, 1,
                                        a.window_s)
        if result["plain_jobs"]["clients_that_fit"]:
            result["capacity_ratio"] = result["python_tenants"]["clients_that_fit"] / result["plain_jobs"]["clients_that_fit"]


if __name__ == "__main__":
    main()
