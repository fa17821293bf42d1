"""Starts a program that serves, waits until it does, and stops it: the one launcher of the Python
benchmarks (bench/*.py) and the Python tests (tests/python/conftest.py) for the executor,
symbiosis-serve and symbiosis-tinker.

Each of these prints "ready ADDRESS" on stdout once it takes requests and logs on stderr ([Ready
line] in base_executor/main.cpp; an executor launcher of several parts prints one such line a part,
in rank order). ReadyProcess starts
one, reads its stdout on a thread of its own (so that the pipe never fills), waits for its ready
lines under a timeout, and when the program dies or the time runs out raises NotReady with the end
of its stderr; stop() ends it (SIGTERM, then SIGKILL).

It lives in bench/, as the C++ side's bench/process.h does (which the C++ tests link too), and uses
the standard library alone: benchmark drivers that never import the symbiosis package (its
extension module is not on their path, as in ctest's bench.sharded_local_cpu) start executors with
it. The Python tests put bench/ on sys.path (conftest.py).
"""
import os
import signal
import subprocess
import threading
import time

READY = "ready "


def executor_binary(build):
    """The executor of the build folder `build`."""
    return os.path.join(build, "base_executor", "symbiosis-executor")


def executor_command(binary, model, *flags):
    """The command line of an executor serving the checkpoint `model` on a free TCP port of this host
    (its ready line names the port), `flags` after."""
    return [binary, "--model", model, "--listen", "tcp://127.0.0.1:*", *flags]


class NotReady(RuntimeError):
    """A program ended, or the time ran out, before its ready lines; the message has its stderr's end."""


class ReadyProcess:
    """A running program that prints `ready_lines` ready lines once it serves; its stderr goes to
    `log_path`, its stdout (past the ready lines too) to `stdout_path` when given, else nowhere.
    `what` names it in errors. `env` and `new_session` are Popen's (a session of its own: a signal
    to the caller's process group does not reach it); with `descendants` (a launcher), stopping it
    also ends what it started, should that outlive it. Starting returns at once; wait_ready() waits.
    addresses: what each ready line named, in order; address: the first.
    Thread safety: the reader thread appends to `addresses` and sets `_ended` under `_lock`;
    everything else is the caller's thread's."""

    def __init__(self, args, log_path, what="executor", *, ready_lines=1, env=None, new_session=False,
                 stdout_path=None, descendants=False):
        self.args, self.log_path, self.what, self.ready_lines = list(args), str(log_path), what, ready_lines
        self.descendants = descendants
        self.addresses = []
        self._ended = False  # its stdout has closed: the program ended
        self._lock = threading.Lock()  # guards addresses and _ended
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                                            start_new_session=new_session)
        threading.Thread(target=self._read_stdout, args=(stdout_path,), daemon=True).start()

    def _read_stdout(self, stdout_path):
        copy = open(stdout_path, "w") if stdout_path else None
        try:
            for line in self.process.stdout:
                if copy:
                    copy.write(line)
                    copy.flush()
                if line.startswith(READY):
                    with self._lock:
                        self.addresses.append(line[len(READY):].strip())
        finally:
            if copy:
                copy.close()
            with self._lock:
                self._ended = True

    def _state(self):
        """(every ready line has come, its stdout has closed)."""
        with self._lock:
            return len(self.addresses) >= self.ready_lines, self._ended

    def wait_ready(self, timeout_s):
        """Returns self once every ready line has come. Raises NotReady, the program stopped,
        should it end first or the lines not come within timeout_s seconds."""
        wait_all_ready([self], timeout_s)
        return self

    def _not_ready(self, timeout_s):
        ended = self._state()[1]
        if ended:
            try:
                why = f"ended (exit {self.process.wait(timeout=5)}) before it was ready"
            except subprocess.TimeoutExpired:  # its stdout closed, yet it runs on
                why = "closed its stdout before it was ready"
        else:
            why = f"was not ready after {timeout_s:.0f} s"
        lines = f" ({len(self.addresses)} of {self.ready_lines} ready lines)" if self.ready_lines > 1 else ""
        return NotReady(f"{self.what} {why}{lines}; its stderr ({self.log_path}) ends:\n{self.log_tail()}")

    @property
    def address(self):
        return self.addresses[0]

    def log(self):
        """Its stderr so far."""
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_tail(self, lines=20):
        return "\n".join(self.log().splitlines()[-lines:])

    def running(self):
        return self.process.poll() is None

    def stop(self, timeout_s=30):
        """Ends it, as end_process does."""
        end_process(self.process, timeout_s, self.descendants)

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.stop()


def wait_all_ready(processes, timeout_s):
    """Waits until every ReadyProcess of `processes` (started together: the parts of one executor,
    which meet before any is ready) is ready. When one ends first or the time runs out, stops them
    all and raises that one's NotReady."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = [p._state() for p in processes]
        if all(ready for ready, _ in states):
            return
        late = time.monotonic() >= deadline
        failed = [p for p, (ready, ended) in zip(processes, states) if not ready and (ended or late)]
        if failed:
            error = failed[0]._not_ready(timeout_s)
            for p in processes:
                p.stop(timeout_s=10)
            raise error
        time.sleep(0.05)


def start_executor(binary, model, flags, log_path, timeout_s=600, what="executor", **options):
    """A ready ReadyProcess of executor_command(binary, model, *flags); its endpoint is its address.
    options: ReadyProcess's."""
    return ReadyProcess(executor_command(binary, model, *flags), log_path, what, **options).wait_ready(timeout_s)


def descendants_of(pid):
    """Every process below `pid` (read from /proc)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        below = children.get(frontier.pop(), [])
        found += below
        frontier += below
    return found


def end_process(process, timeout_s=30, descendants=False):
    """SIGTERM to the Popen `process` (a launcher passes it on to its parts or ranks), up to timeout_s
    for it to end, then SIGKILL; with `descendants`, SIGKILL too for every process that was below it
    before, should one outlive it."""
    if process.poll() is not None:
        return
    below = descendants_of(process.pid) if descendants else []
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    kill(below)


def kill(pids):
    """SIGKILL to each of `pids` still there."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
