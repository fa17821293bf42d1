"""Merges the Chrome traces of an executor and its tenants (Kineto's, from symbiosis-ctl trace,
symbiosis-bench --trace or symbiosis-bench-client --trace) into one timeline, and says where each
call's time went ([Traces] in base_executor/tracing.h; docs/tracing.md).

    python3 bench/merge_traces.py --out trace.json [--summary s.json] executor=E.json client0=C0.json ...

One clock: every Kineto trace gives its events' times from its own base (baseTimeNanoseconds, on
the host's wall clock), so processes of one host line up once each is shifted to its base.
One row per process: each input's processes and GPU streams are renamed after its label
("client0: GPU 0 stream 7"), as two processes' GPU rows would otherwise share the GPU's number.
One arrow per hand-off: a client's call scope ("symbiosis::call c3:r17 ...") is linked to the
executor's batch that computed it ("symbiosis::batch ... c3:r17 ..."), and that batch back to the
call's end when the call waited for it; a replay of captured calls ("symbiosis::replay
c3:r100-r164") to each of its batches. A call ordered on the GPU ([Stream-ordered hand-off] in
transport/call_ring.h) returns before its batch runs: it is linked to its batch, with no arrow back.
The summary splits each linked call that waited into to the batch (send, and the wait in the
executor's queue), the batch (its GEMM and the delivery of results, up to its own or the batch's
end) and back (the reply and the client's resume), and gives a call ordered on the GPU its time to the batch only, by
client and in all; and gives, over the span every trace covers, each process's GPU
busy time (the union of its kernels) and the executor's batches: how many, of how many calls.
"""
import argparse
import bisect
import collections
import json
import re
import statistics
import sys

BATCH = re.compile(r"^symbiosis::batch (\S+) (\S+) (\d+)t((?: c\d+:r\d+)+)$")
CALL = re.compile(r"^symbiosis::call c(\d+):r(\d+) (\S+) (\S+)$")
REPLAY = re.compile(r"^symbiosis::replay c(\d+):r(\d+)-r(\d+)$")
MEMBER = re.compile(r"c(\d+):r(\d+)")


def load(label, path):
    """The trace's events, shifted to the host's clock (microseconds since the epoch)."""
    with open(path) as f:
        trace = json.load(f)
    if "baseTimeNanoseconds" not in trace:
        sys.exit(f"{path}: no baseTimeNanoseconds: not a Kineto trace of this LibTorch")
    base = trace["baseTimeNanoseconds"] / 1000.0
    events = trace.get("traceEvents", [])
    for e in events:
        if "ts" in e:
            e["ts"] = float(e["ts"]) + base
    return events


def merge(inputs):
    """One event list: each input's pids renumbered apart, its processes named after its label."""
    merged, scopes = [], []
    for index, (label, path) in enumerate(inputs):
        pids = {}

        def pid_of(pid):
            if pid not in pids:
                pids[pid] = (index + 1) * 1000 + len(pids)
            return pids[pid]

        named = set()
        for e in load(label, path):
            if "pid" not in e:
                continue
            e["pid"] = pid_of(e["pid"])
            if e.get("ph") == "M" and e.get("name") == "process_name":
                e["args"] = {"name": f"{label}: {e.get('args', {}).get('name', '')}"}
                named.add(e["pid"])
            if e.get("ph") == "M" and e.get("name") == "process_sort_index":
                e["args"] = {"sort_index": e["pid"]}
            # Flows of the input (Kineto's launch-to-kernel arrows) keep apart from the other inputs'.
            if e.get("ph") in ("s", "t", "f") and "id" in e:
                e["id"] = f"{label}:{e['id']}"
            merged.append(e)
            if e.get("ph") == "X" and e.get("name", "").startswith("symbiosis::"):
                scopes.append((label, e))
        for pid in set(pids.values()) - named:
            merged.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
    return merged, scopes


def link(merged, scopes):
    """Adds the hand-off arrows; returns each linked call's (client, op, to batch, batch, back) in us."""
    batches = collections.defaultdict(list)  # (client, request) -> batch events, by start
    calls, replays = [], []
    for label, e in scopes:
        name = e["name"]
        if m := BATCH.match(name):
            for c, r in MEMBER.findall(m.group(4)):
                batches[(int(c), int(r))].append(e)
        elif m := CALL.match(name):
            calls.append((label, e, int(m.group(1)), int(m.group(2)), m.group(4)))
        elif m := REPLAY.match(name):
            replays.append((label, e, int(m.group(1)), int(m.group(2)), int(m.group(3))))
    for events in batches.values():
        events.sort(key=lambda e: e["ts"])

    def batch_of(client, request, after):
        """The first batch of the call at or after `after` (a reconnected client reuses ids)."""
        events = batches.get((client, request), [])
        starts = [e["ts"] for e in events]
        i = bisect.bisect_left(starts, after)
        return events[i] if i < len(events) else None

    flow = 0

    def arrow(a, at_a, b, at_b, name):
        nonlocal flow
        flow += 1
        common = {"name": name, "cat": "symbiosis", "id": f"symbiosis:{flow}"}
        merged.append({**common, "ph": "s", "pid": a["pid"], "tid": a["tid"], "ts": at_a})
        merged.append({**common, "ph": "f", "bp": "e", "pid": b["pid"], "tid": b["tid"], "ts": at_b})

    linked, unlinked = [], 0
    for label, call, client, request, op in calls:
        batch = batch_of(client, request, call["ts"])
        if batch is None:
            unlinked += 1
            continue
        arrow(call, call["ts"], batch, batch["ts"], "call")
        end, batch_end = call["ts"] + call["dur"], batch["ts"] + batch["dur"]
        if end < batch["ts"]:  # ordered on the GPU: the call did not wait for its batch
            linked.append((label, op, batch["ts"] - call["ts"], None, None))
            continue
        # The batch answers each call as it delivers it, so a call may end inside its batch.
        answered = min(end, batch_end)
        arrow(batch, answered - min(answered - batch["ts"], 0.001), call, end, "result")
        linked.append((label, op, batch["ts"] - call["ts"], answered - batch["ts"], end - answered))
    # A replay's calls follow each other: from one's batch to the next's is what a call costs there.
    intervals = collections.defaultdict(list)  # label -> us between the batches of consecutive calls
    replayed = 0
    for label, replay, client, first, last in replays:
        starts = []
        for request in range(first, last + 1):
            batch = batch_of(client, request, replay["ts"])
            if batch is not None:
                arrow(replay, replay["ts"], batch, batch["ts"], "replayed call")
                starts.append(batch["ts"])
        intervals[label] += [b - a for a, b in zip(starts, starts[1:])]
        replayed += len(starts)
    return linked, unlinked, replayed, intervals


def union_us(spans):
    """The time covered by some of the [start, end] spans."""
    busy, end = 0.0, None
    for start, stop in sorted(spans):
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy


def activity(inputs, merged, scopes):
    """Over the span all traces cover: each input's GPU busy share, and the executor's batches."""
    spans = collections.defaultdict(list)  # label -> (first, last) of its events
    kernels = collections.defaultdict(list)
    for e in merged:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        label = inputs[e["pid"] // 1000 - 1][0]
        spans[label].append(e["ts"])
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels[label].append((e["ts"], e["ts"] + e.get("dur", 0.0)))
    if not spans:
        return {}
    start = max(min(ts) for ts in spans.values())
    end = min(max(ts) for ts in spans.values())
    if end <= start:
        return {}
    clip = lambda s: (max(s[0], start), min(s[1], end))
    out = {"common_span_ms": (end - start) / 1e3, "gpu_busy_share": {}}
    for label, spans_of in kernels.items():
        out["gpu_busy_share"][label] = union_us([clip(s) for s in spans_of if s[1] > start and s[0] < end]) / (end - start)
    batch_calls = [len(MEMBER.findall(e["name"])) for _, e in scopes
                   if e["name"].startswith("symbiosis::batch ") and start <= e["ts"] <= end]
    if batch_calls:
        out["executor_batches"] = len(batch_calls)
        out["executor_calls_per_batch"] = statistics.fmean(batch_calls)
    return out


def figures(values):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return {"p50_us": statistics.median(values), "p90_us": values[int(0.9 * (len(values) - 1))],
            "mean_us": statistics.fmean(values)}


def summarize(linked, unlinked, replayed, intervals):
    groups = collections.defaultdict(list)
    for label, op, to_batch, batch, back in linked:
        groups["all"].append((to_batch, batch, back))
        groups[label].append((to_batch, batch, back))
    summary = {"linked_calls": len(linked), "unlinked_calls": unlinked, "linked_replayed_calls": replayed,
               "replayed_call_interval_us": {label: figures(v) for label, v in sorted(intervals.items()) if v},
               "by_client": {}}
    for name, rows in groups.items():
        parts = {part: figures([row[i] for row in rows]) for i, part in enumerate(("to_batch", "batch", "back"))}
        parts["calls"] = len(rows)
        parts["calls_ordered_on_the_gpu"] = sum(row[1] is None for row in rows)
        if name == "all":
            summary["all"] = parts
        else:
            summary["by_client"][name] = parts
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", help="LABEL=TRACE.json, one per process")
    parser.add_argument("--out", required=True, help="the merged trace (open it in ui.perfetto.dev)")
    parser.add_argument("--summary", help="also write the summary here, as JSON")
    args = parser.parse_args()
    inputs = []
    for item in args.traces:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            sys.exit(f"'{item}': each trace is LABEL=PATH (e.g. executor=executor.trace.json)")
        inputs.append((label, path))
    merged, scopes = merge(inputs)
    linked, unlinked, replayed, intervals = link(merged, scopes)
    origin = min((e["ts"] for e in merged if "ts" in e), default=0.0)
    for e in merged:
        if "ts" in e:
            e["ts"] = round(e["ts"] - origin, 3)
    with open(args.out, "w") as f:
        json.dump({"traceEvents": merged, "displayTimeUnit": "ms"}, f)
    summary = summarize(linked, unlinked, replayed, intervals)
    summary.update(activity(inputs, merged, scopes))
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary, f, indent=2)
    ordered = sum(row[3] is None for row in linked)
    print(f"merged {len(inputs)} traces into {args.out}: {len(linked)} calls linked to their batches "
          f"({ordered} ordered on the GPU), {unlinked} not, {summary['linked_replayed_calls']} replayed calls linked")
    print(f"{'calls of':<12} {'calls':>7}  {'to batch p50/p90 us':>20}  {'batch p50/p90 us':>18}  {'back p50/p90 us':>17}")
    rows = [("all", summary.get("all"))] + sorted(summary["by_client"].items())
    for name, parts in rows:
        if parts is None:
            continue
        cells = [f"{parts[p]['p50_us']:.1f} / {parts[p]['p90_us']:.1f}" if parts[p] else "-"
                 for p in ("to_batch", "batch", "back")]
        print(f"{name:<12} {parts['calls']:>7}  {cells[0]:>20}  {cells[1]:>18}  {cells[2]:>17}")
    for label, f in summary["replayed_call_interval_us"].items():
        print(f"{label:<12} replayed calls: from one call's batch to the next's p50 {f['p50_us']:.1f} / "
              f"p90 {f['p90_us']:.1f} us")
    if "common_span_ms" in summary:
        print(f"over the {summary['common_span_ms']:.1f} ms every trace covers:", end="")
        if "executor_batches" in summary:
            print(f" {summary['executor_batches']} batches of {summary['executor_calls_per_batch']:.2f} calls", end="")
        shares = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(summary["gpu_busy_share"].items()))
        print(f"; GPU busy: {shares}" if shares else "")


if __name__ == "__main__":
    main()
