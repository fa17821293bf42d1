"""Prints a window of a merged trace (bench/merge_traces.py) as one timeline: every GPU kernel of
the chosen processes in [start, start + span], in time order, with its start, duration and the gap
since the same process's last kernel ended; then each process's time in the window by kernel. It
shows where a decode step's time goes between the executor and its tenants: whose kernel runs, who
waits (a hand_off kernel spinning on a word), and the gaps between kernels (launches, none running).

    python3 bench/trace_window.py TRACE.json [--anchor decode_attention_kernel] [--at 0.5] [--before-us 50] [--span-us 600]
        [--processes executor,client0,client7]

The window starts a little before the anchor kernel's occurrence at `at` (a fraction of them all, in
time order): by default a decode step's attention in the middle of the run.
"""
import argparse
import collections
import json

from trace_summary import family


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--anchor", default="decode_attention_kernel", help="a kernel family the window starts at")
    parser.add_argument("--at", type=float, default=0.5, help="which of the anchor's occurrences, as a fraction")
    parser.add_argument("--before-us", type=float, default=50, help="how long before the anchor the window starts")
    parser.add_argument("--span-us", type=float, default=600)
    parser.add_argument("--processes", default="executor,client0,client7",
                        help="process names' prefixes (before ':'), comma-separated")
    args = parser.parse_args()
    events = json.load(open(args.trace))["traceEvents"]
    names = {e["pid"]: e["args"]["name"].split(":")[0] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    wanted = args.processes.split(",")
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
               and names.get(e["pid"]) in wanted]
    if not kernels:
        raise SystemExit(f"no kernels of {wanted} in {args.trace} (processes: {sorted(set(names.values()))})")
    anchors = sorted(e["ts"] for e in kernels if e["cat"] == "kernel" and family(e["name"]) == args.anchor)
    if not anchors:
        raise SystemExit(f"no {args.anchor} kernel of {wanted} in {args.trace}")
    start = anchors[min(int(args.at * len(anchors)), len(anchors) - 1)] - args.before_us
    window = sorted((e for e in kernels if start <= e["ts"] < start + args.span_us), key=lambda e: e["ts"])
    ended = {}
    time_in = collections.defaultdict(lambda: collections.defaultdict(float))
    print(f"{'t us':>9} {'dur':>7} {'gap':>7}  process   kernel")
    for e in window:
        who = names[e["pid"]]
        name = family(e["name"]) if e["cat"] == "kernel" else e["cat"]
        gap = e["ts"] - ended[who] if who in ended else 0.0
        ended[who] = max(ended.get(who, 0.0), e["ts"] + e["dur"])
        time_in[who][name] += e["dur"]
        print(f"{e['ts'] - start:9.1f} {e['dur']:7.1f} {gap:7.1f}  {who:9} {name[:70]}")
    for who, by_name in sorted(time_in.items()):
        total = sum(by_name.values())
        print(f"== {who}: {total:.1f} us of kernels in {args.span_us:.0f} us")
        for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:12]:
            print(f"  {us:9.1f} us  {name[:80]}")


if __name__ == "__main__":
    main()
