# stages: trace-sharing
# trace-sharing  issue 45's workloads traced, the executor and every tenant on one timeline ([Traced runs] in
#                bench/bench_main.cpp, docs/tracing.md): decode at N = 1 and 8 (or TRACE_COUNTS) with the
#                monolithic baseline, and the mixed workload with each group alone; each run's trace_summary
#                and the merged traces that fit go back in traces.tgz (open them in ui.perfetto.dev);
#                TRACE_EXECUTOR: JSON merged over the decode runs' executor settings (e.g.
#                '{"launch_together": true}'); TRACE_CLIENT: JSON merged over their clients' settings (e.g.
#                '{"decode_halves": true}'); TRACE_MIXED=0: the decode runs only. trace-kernels.txt:
#                the kernels of each run's executor and first tenant (bench/trace_summary.py)
make_1b
mps_on
python3 -c 'import json, sys; s = json.load(open(sys.argv[1])); s["executor"]["policies"] = ["opportunistic"]; s["executor"].update(json.loads(sys.argv[2])); s["client_defaults"].update(json.loads(sys.argv[3])); print(json.dumps(s))' \
  bench/scenarios/gpu_generate_llama1b.json "${TRACE_EXECUTOR:-{\}}" "${TRACE_CLIENT:-{\}}" > /tmp/trace-decode.json
bench trace-decode /tmp/trace-decode.json --checkpoint $model_1b --counts "${TRACE_COUNTS:-1,8}" --trace 1
[ "${TRACE_MIXED:-1}" = 0 ] || bench trace-mixed bench/scenarios/gpu_mixed_llama1b.json --checkpoint $model_1b --trace 1
mps_off
(cd /tmp && for f in bench-trace-*/*/*/trace_summary.txt; do echo "== $f"; cat "$f"; done) | tee "$out/trace-summaries.txt"
(cd /tmp && for f in bench-trace-*/*/*/executor.trace.json bench-trace-*/*/*/client0.trace.json; do
  [ -f "$f" ] && { echo "== $f"; python3 "$root/bench/trace_summary.py" "$f" --iterations 1 --top 20; }
done) > "$out/trace-kernels.txt" 2>&1
# The merged traces, smallest first, while the bundle stays under the 16 MiB a file may be.
mkdir -p /tmp/traces && rm -f /tmp/traces/*
for f in $(cd /tmp && ls -S -r bench-trace-*/*/*/trace.json); do
  gzip -c "/tmp/$f" > "/tmp/traces/$(echo "$f" | tr / -).gz"
  [ "$(du -cb /tmp/traces | tail -1 | cut -f1)" -lt 15000000 ] || rm "/tmp/traces/$(echo "$f" | tr / -).gz"
done
tar cf "$out/traces.tar" -C /tmp/traces . && ls -la /tmp/traces
