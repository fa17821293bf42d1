#!/usr/bin/env python3
"""[Reference server]: runs the reference scripts of this folder for the C++ tests without paying
Python's start-up each time.

  server.py SOCKET

Imports what the scripts import (torch, transformers, peft, ...: about 10 s of CPU that every test
process used to pay again), then forks a child per request on the Unix socket SOCKET. A request is
one line of JSON, {"argv": [script, arg, ...], "log": path}; the child runs the script as
`python script arg ...` would (as __main__, its folder first on sys.path, stdin /dev/null, stdout and
stderr to `log`), and the answer is one line: the exit status, or -1 when the child died of a
signal. A request whose caller hangs up is ended (the child is killed). The server leaves when no
request came for IDLE_SECONDS, removing SOCKET; tests/test_util.cpp starts it again when needed.
"""
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import time
import traceback

IDLE_SECONDS = 90


def preload():
    """The scripts' imports, done once here; a package that is missing is left to the scripts
    (they exit 3, and the test skips)."""
    modules = ("torch", "safetensors.torch", "transformers", "peft", "tokenizers", "sentencepiece",
               "google.protobuf", "transformers.models.llama.modeling_llama",
               "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen3.modeling_qwen3",
               "transformers.models.mistral.modeling_mistral",
               "transformers.models.gemma2.modeling_gemma2", "transformers.models.gpt2.modeling_gpt2",
               "transformers.models.gpt_bigcode.modeling_gpt_bigcode")
    for name in modules:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 (an import may fail in many ways; the script reports it)
            pass


def run_child(request):
    """In the forked child: becomes `python argv...` and never returns."""
    code = 1
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        argv = request["argv"]
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if not isinstance(done.code, int) and done.code is not None:
            print(done.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (whatever the script raised is its failure, as in python)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def read_request(conn):
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    return json.loads(data)


def serve(path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, ("accept", None))
    running = {}  # pidfd -> (pid, conn)
    last = time.monotonic()
    try:
        while running or time.monotonic() - last < IDLE_SECONDS:
            for key, _ in selector.select(timeout=1.0):
                kind, item = key.data
                if kind == "accept":
                    conn, _ = listener.accept()
                    last = time.monotonic()
                    try:
                        request = read_request(conn)
                    except (OSError, ValueError):
                        request = None
                    if request is None:
                        conn.close()
                        continue
                    pid = os.fork()
                    if pid == 0:
                        listener.close()
                        conn.close()
                        run_child(request)
                    pidfd = os.pidfd_open(pid)
                    running[pidfd] = (pid, conn)
                    selector.register(pidfd, selectors.EVENT_READ, ("child", pidfd))
                    selector.register(conn, selectors.EVENT_READ, ("caller", pidfd))
                elif kind == "caller":  # the caller hung up (or wrote more): its request ends
                    pid, _ = running[item]
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                else:  # the child ended: answer its caller
                    pid, conn = running.pop(item)
                    selector.unregister(item)
                    selector.unregister(conn)
                    os.close(item)
                    _, status = os.waitpid(pid, 0)
                    code = os.waitstatus_to_exitcode(status)
                    try:
                        conn.sendall(f"{code if code >= 0 else -1}\n".encode())
                    except OSError:
                        pass
                    conn.close()
                    last = time.monotonic()
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def main():
    path = sys.argv[1]
    preload()
    try:
        os.unlink(path)  # one left by a server that was killed (the caller holds the start lock)
    except FileNotFoundError:
        pass
    serve(path)


if __name__ == "__main__":
    main()
