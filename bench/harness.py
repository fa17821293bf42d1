"""What the Python benchmarks (bench/*.py) share: their common flags, both sides of the [Measurement
window] protocol (bench/bench_client.cpp), writing their results, and reading a GPU's memory.

A client (hf_peft_client.py, python_tenant_client.py, fsdp_peft.py; symbiosis-bench-client in C++)
warms up, creates --ready-file, then steps until --stop-file exists (capacity runs), or waits for
--go-file and steps through the window it names, or else runs --iterations steps; it writes --out,
a JSON of symbiosis-bench-client's keys. A driver (python_tenants.py, sharded_local.py; in C++
symbiosis-bench, bench/bench_main.cpp) starts clients with those files, waits until they are warm,
then opens one window for all (the go file) or asks them to stop (the stop file), and reads their
results. Executors are started by executor_process.py.

Standard library only (torch is imported where a client needs it): drivers that start no model of
their own run without it.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

from executor_process import descendants_of, end_process, kill

DTYPE_NAMES = ("bf16", "fp16", "fp32")  # the executor's and symbiosis-bench-client's --dtype


def torch_dtype(name):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


# Flags.

def add_run_flags(parser, out_help, model=True, device="cuda:0", devices=None, dtype="bf16", dtypes=DTYPE_NAMES):
    """--build, --model (a checkpoint folder; with model=False none), --out (out_help says what it
    names), --device (devices: its choices, None: any) and --dtype of a benchmark driver."""
    parser.add_argument("--build", required=True,
                        help="the build folder holding base_executor/, bench/ and tools/ (build, .gpu-build)")
    if model:
        parser.add_argument("--model", required=True,
                            help="checkpoint folder (e.g. symbiosis-make-checkpoint --preset llama-2-13b)")
    parser.add_argument("--out", required=True, help=out_help)
    parser.add_argument("--device", default=device, choices=devices)
    parser.add_argument("--dtype", default=dtype, choices=dtypes)


def add_step_flags(parser):
    """The shape of a LoRA fine-tuning step, as symbiosis-bench-client takes it."""
    parser.add_argument("--batch", type=int, default=2, help="sequences a step")
    parser.add_argument("--seq", type=int, default=512, help="tokens a sequence")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj", help="the layers LoRA adapts")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before the measurement")


def add_client_flags(parser, go_file=True):
    """A client's flags (with the step's, add_step_flags): --model, --alpha, --iterations, --seed,
    --dtype, the [Measurement window]'s files and --out; symbiosis-bench passes the same to
    hf_peft_client.py as to symbiosis-bench-client (bench_main.cpp, client_args)."""
    parser.add_argument("--model", required=True, help="checkpoint folder")
    add_step_flags(parser)
    parser.add_argument("--alpha", type=float, default=16, help="LoRA alpha")
    parser.add_argument("--iterations", type=int, default=10, help="timed steps, without --stop-file or --go-file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bf16", choices=DTYPE_NAMES)
    parser.add_argument("--ready-file", help="create this file once warm")
    if go_file:
        parser.add_argument("--go-file", help="wait for this file, then step through the window it names")
    parser.add_argument("--stop-file", help="step until this file exists (capacity runs)")
    parser.add_argument("--out", required=True, help="the results (JSON)")


# The client's side.

class Window:
    """What a client measured: its window [start, end] (epoch seconds), the latency of each timed step
    that ended inside it, and every timed step's end time."""

    def __init__(self, start, end, latencies, step_ends):
        self.start, self.end, self.latencies, self.step_ends = start, end, latencies, step_ends


def mark_ready(ready_file):
    if ready_file:
        with open(ready_file, "w") as f:
            f.write("warm\n")


def run_window(a, step):
    """[Measurement window], a client's side: a.warmup untimed calls of step(), then a.ready_file is
    created; with a.stop_file it steps until that file exists, with a.go_file it waits for that file
    and steps through the window it names, else it runs a.iterations steps."""
    for _ in range(a.warmup):
        step()
    mark_ready(a.ready_file)
    ends, latencies = [], []

    def timed_step():
        began = time.time()
        step()
        ends.append(time.time())
        latencies.append(ends[-1] - began)

    if a.stop_file:
        start = time.time()
        while not os.path.exists(a.stop_file):
            timed_step()
        end = time.time()
    elif getattr(a, "go_file", None):
        while not os.path.exists(a.go_file):
            time.sleep(0.005)
        time.sleep(0.02)
        with open(a.go_file) as f:
            start, end = (float(v) for v in f.read().split())
        while time.time() < end:
            timed_step()
    else:
        start = time.time()
        for _ in range(a.iterations):
            timed_step()
        end = time.time()
    inside = [latency for latency, t in zip(latencies, ends) if start <= t <= end]
    return Window(start, end, inside, ends)


def peak_rss_bytes():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def client_result(a, window, system, tokens_per_iteration, mode="finetune", device=None, monolithic=True,
                  transport="none", **extra):
    """A client's results, keyed as symbiosis-bench-client's JSON (bench_main.cpp sums them), `extra` after."""
    return {"system": system, "mode": mode, "monolithic": monolithic, "transport": transport,
            "device": device if device is not None else a.device, "batch": a.batch, "seq": a.seq, "rank": a.rank,
            "iterations": len(window.latencies), "tokens_per_iteration": tokens_per_iteration,
            "latencies_s": window.latencies, "start_epoch_s": window.start, "end_epoch_s": window.end,
            "tokens_per_s": tokens_per_iteration * len(window.latencies) / max(window.end - window.start, 1e-9),
            "peak_rss_bytes": peak_rss_bytes(), **extra}


def write_json(path, data, indent=2, echo=False):
    """`data` as JSON in `path`; with echo, printed too."""
    with open(path, "w") as f:
        json.dump(data, f, indent=indent)
    if echo:
        print(json.dumps(data, indent=indent))


# The driver's side.

def logger(name):
    """log(message): "[NAME HH:MM:SS] message" on stderr (scripts/gpu_check.sh greps for the prefix)."""
    def log(message):
        print(f"[{name} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    return log


def error_tail(path, lines=3):
    """The last lines of a process's stderr that are not warnings (what a failure says), on one line."""
    try:
        with open(path, errors="replace") as f:
            kept = [line.strip() for line in f.read().splitlines()
                    if line.strip() and "warn" not in line.lower() and not line.startswith(("[W", "frame #"))]
    except OSError:
        return ""
    return " | ".join(kept[-lines:])


def remove(*paths):
    """Files of an earlier run in the same --out (a stale ready or go file would start a window early)."""
    for path in paths:
        if os.path.exists(path):
            os.remove(path)


class Processes:
    """Every process a driver starts, so that a run cut short ends those still running (end_all);
    after keep_pids_in(path), their ids are also written there (and, by record, those of a
    launcher's parts), for a caller to end should the driver itself be killed past its own clean-up."""

    def __init__(self):
        self.pid_file, self.started = None, []

    def keep_pids_in(self, pid_file):
        remove(pid_file)
        self.pid_file = pid_file

    def spawn(self, args, directory, name, env=None, new_session=False):
        """Starts `args`, its output in directory/NAME.out and NAME.err."""
        with open(os.path.join(directory, name + ".out"), "w") as out, \
                open(os.path.join(directory, name + ".err"), "w") as err:
            process = subprocess.Popen(args, stdout=out, stderr=err, env=env, start_new_session=new_session)
        return self.add(process)

    def add(self, process):
        self.started.append(process)
        self.record([process.pid])
        return process

    def record(self, pids):
        if self.pid_file:
            with open(self.pid_file, "a") as f:
                f.write("".join(f"{pid}\n" for pid in pids))

    def end_all(self, timeout_s=20):
        """SIGTERM to every one still running, then up to timeout_s for each before SIGKILL for it and
        all below it."""
        running = [p for p in self.started if p.poll() is None]
        below = {p.pid: descendants_of(p.pid) for p in running}
        for p in running:
            p.send_signal(signal.SIGTERM)
        for p in running:
            end_process(p, timeout_s)
            kill(below[p.pid])


class ClientFiles:
    """The files of client NAME in `directory` ([Measurement window]): NAME.ready, NAME.json, NAME.err."""

    def __init__(self, directory, name):
        self.name = name
        self.ready, self.json, self.err = (os.path.join(directory, f"{name}.{ext}") for ext in ("ready", "json", "err"))

    def remove_stale(self):
        remove(self.ready, self.json)

    def results(self):
        with open(self.json) as f:
            return json.load(f)


def wait_warm(process, ready_file, deadline=None, poll_s=0.1):
    """Until `process` is warm (it created ready_file and runs), has ended, or time.time() passed
    `deadline`: "warm", "ended" or "late"."""
    while not os.path.exists(ready_file):
        if process.poll() is not None:
            return "ended"
        if deadline is not None and time.time() > deadline:
            return "late"
        time.sleep(poll_s)
    return "warm" if process.poll() is None else "ended"


def open_window(go_file, window_s, lead_s=0.5):
    """Writes go_file (through a rename: a client never reads it half written), naming a window that
    opens lead_s from now and lasts window_s; returns (start, end) in epoch seconds."""
    start = time.time() + lead_s
    with open(go_file + ".tmp", "w") as f:
        f.write(f"{start} {start + window_s}\n")
    os.rename(go_file + ".tmp", go_file)
    return start, start + window_s


def ask_to_stop(stop_file):
    with open(stop_file, "w") as f:
        f.write("stop\n")


def go_window(clients, go_file, window_s, timeout_s=None):
    """One window for clients started with --ready-file and --go-file go_file: `clients` is a list of
    (label, process, ClientFiles). Waits until every one is warm, opens the window, waits for each to
    end; returns their results in order and when the last was warm (time.time()). A client that
    ends first or fails, or takes longer than timeout_s to warm or to end after the window, ends
    them all and raises RuntimeError naming it and what its stderr says."""
    def fail(why):
        for _, process, _ in clients:
            end_process(process, 10)
        raise RuntimeError(why)

    deadline = time.time() + timeout_s if timeout_s else None
    for label, process, files in clients:
        state = wait_warm(process, files.ready, deadline)
        if state == "ended":
            fail(f"{label} failed while warming up (exit {process.wait()}): {error_tail(files.err)}")
        if state == "late":
            fail(f"{label} not warm after {timeout_s:.0f} s")
    warm_at = time.time()
    open_window(go_file, window_s)
    results = []
    for label, process, files in clients:
        try:
            process.wait(window_s + timeout_s if timeout_s else None)
        except subprocess.TimeoutExpired:
            fail(f"{label} did not end after the window")
        if process.returncode != 0:
            fail(f"{label} failed in the window (exit {process.returncode}): {error_tail(files.err)}")
        results.append(files.results())
    return results, warm_at


def window_figures(results, start, end):
    """Aggregate tokens/s of the steps that end in [start, end] (each client's step_end_epoch_s), and
    their mean step time."""
    tokens, latencies = 0.0, []
    for r in results:
        for t, latency in zip(r["step_end_epoch_s"], r["latencies_s"]):
            if start <= t <= end:
                tokens += r["tokens_per_iteration"]
                latencies.append(latency)
    return {"tokens_per_s": tokens / max(end - start, 1e-9),
            "mean_step_s": sum(latencies) / len(latencies) if latencies else 0.0, "steps_in_window": len(latencies)}


def run_to_the_end(body, result, log, processes):
    """Runs body(). An error, or a SIGTERM (a timeout: it ends the run as an error, once; the clean-up
    after is not cut short again), is logged and kept in result["error"], so that what was measured
    is still written. Every process still running is ended after. Returns True when body ran through."""
    def cut_short(*_):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit("stopped by SIGTERM (a timeout?)")

    signal.signal(signal.SIGTERM, cut_short)
    try:
        body()
        return True
    except (Exception, SystemExit) as error:
        result["error"] = f"{type(error).__name__}: {error}"
        log(f"failed: {result['error']}")
        return False
    finally:
        processes.end_all()


def write_results(out, name, result, table):
    """OUT/NAME.json (the results) and OUT/NAME.md (table, their text), which is also printed."""
    write_json(os.path.join(out, name + ".json"), result)
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write(table)
    print(table)


# A GPU's memory.

def gpu_index(device):
    """cuda:N -> N, cuda -> 0, anything else -> -1."""
    return int(device.split(":")[1]) if device.startswith("cuda:") else (0 if device == "cuda" else -1)


def nvidia_smi(gpu, query):
    """nvidia-smi's `query` (e.g. "memory.used") of GPU `gpu`, as text; "" without one."""
    if gpu < 0:
        return ""
    try:
        return subprocess.run(["nvidia-smi", "-i", str(gpu), f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def gpu_memory_mib(gpu):
    """(used, total) MiB of GPU `gpu` (the whole GPU: every process's, MPS's too); (0, 0) without one."""
    try:
        used, total = (float(v) for v in nvidia_smi(gpu, "memory.used,memory.total").split(","))
        return used, total
    except ValueError:
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
