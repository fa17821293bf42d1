"""Sums the GPU kernels of a Chrome trace that symbiosis-bench-client --trace wrote (or any Kineto
trace): GPU time per iteration by kernel, the largest first, and the GPU's busy time per iteration.

    python3 bench/trace_summary.py TRACE.json [--iterations 3] [--top 25]
"""
import argparse
import collections
import json
import re

from merge_traces import union_us


def family(name):
    """A kernel's name without template arguments and launch details: one line per kind of kernel."""
    name = name.replace("(anonymous namespace)::", "").removeprefix("void ")
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    return name.split("::")[-1][:90]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    events = json.load(open(args.trace))["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    by_family = collections.defaultdict(lambda: [0.0, 0])
    for e in kernels:
        entry = by_family[family(e["name"]) if e["cat"] == "kernel" else e["cat"]]
        entry[0] += e["dur"]
        entry[1] += 1
    busy = union_us((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    n = args.iterations
    total = sum(v[0] for v in by_family.values())
    print(f"{len(kernels) / n:.0f} GPU operations per iteration, {total / n / 1e3:.2f} ms of kernel time, "
          f"{busy / n / 1e3:.2f} ms busy")
    for name, (us, count) in sorted(by_family.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"  {us / n / 1e3:7.3f} ms {count / n:6.0f}x  {name}")


if __name__ == "__main__":
    main()
