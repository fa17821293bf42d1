"""GPU time of the executor's GEMMs for a model's layer shapes: several requests' rows each alone, one
after another and side by side on streams of their own (as same-GPU tenants' calls run in place),
against the same rows packed into one GEMM (plus the two copies packing costs), forward (x · Wᵀ)
and backward (g · W). What [Batch data path] in base_executor/executor.cpp decides on: which
requests run in place, one GEMM each, and which are packed; with --tokens 8, what eight decoding
tenants would gain from reading a layer's weights once (issue 45's N = 8 target).

    python3 bench/gemm_shapes.py [--tokens 1024] [--requests 1,2,4,8] [--hidden 2048 --kv 512 --intermediate 8192]

bf16, cuBLAS through PyTorch, CUDA events, median of --repeat runs after warm-up; each run cycles
through several input sets, and the L2 cache is overwritten before each (outside the timing), so
that neither the inputs nor the weight sit in L2, as in a decode step, where every other layer's
weights pass through it between two uses of one.
"""
import argparse
import statistics

import torch


def time_ms(fn, repeat, flush):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeat):
        flush.zero_()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1024, help="rows of one request")
    parser.add_argument("--requests", default="1,2,4,8", help="requests per batch")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--kv", type=int, default=512, help="k_proj/v_proj outputs")
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    h, kv, i = args.hidden, args.kv, args.intermediate
    layers = {"q/o": (h, h), "k/v": (h, kv), "gate/up": (h, i), "down": (i, h)}
    flush = torch.empty(256 << 20, device=dev, dtype=torch.uint8)  # more than any GPU's L2
    print(f"{'layer':8} {'op':8} {'reqs':>4} {'alone ms':>9} {'beside ms':>9} {'packed ms':>9} {'copies ms':>9}"
          f" {'packed/alone':>12} {'packed/beside':>13} {'TFLOP/s alone':>13} {'packed':>7}")
    for name, (n_in, n_out) in layers.items():
        weight = torch.randn(n_out, n_in, device=dev, dtype=torch.bfloat16)
        for op in ("forward", "backward"):
            k, n = (n_in, n_out) if op == "forward" else (n_out, n_in)
            w = weight.t() if op == "forward" else weight
            for reqs in [int(r) for r in args.requests.split(",")]:
                sets = 4
                xs = [[torch.randn(args.tokens, k, device=dev, dtype=torch.bfloat16) for _ in range(reqs)]
                      for _ in range(sets)]
                outs = [torch.empty(args.tokens, n, device=dev, dtype=torch.bfloat16) for _ in range(reqs)]
                packed_in = torch.empty(reqs * args.tokens, k, device=dev, dtype=torch.bfloat16)
                packed_out = torch.empty(reqs * args.tokens, n, device=dev, dtype=torch.bfloat16)
                state = {"set": 0}
                streams = [torch.cuda.Stream() for _ in range(reqs)]

                def alone():
                    xset = xs[state["set"] % sets]
                    state["set"] += 1
                    for x, out in zip(xset, outs):
                        torch.mm(x, w, out=out)

                def beside():
                    xset = xs[state["set"] % sets]
                    state["set"] += 1
                    main_stream = torch.cuda.current_stream()
                    for stream, x, out in zip(streams, xset, outs):
                        stream.wait_stream(main_stream)
                        with torch.cuda.stream(stream):
                            torch.mm(x, w, out=out)
                    for stream in streams:
                        main_stream.wait_stream(stream)

                def packed(copies=True):
                    xset = xs[state["set"] % sets]
                    state["set"] += 1
                    if copies:
                        torch.cat(xset, out=packed_in)
                    torch.mm(packed_in, w, out=packed_out)
                    if copies:
                        for r, out in enumerate(outs):
                            out.copy_(packed_out[r * args.tokens:(r + 1) * args.tokens])

                def copies_only():
                    xset = xs[state["set"] % sets]
                    state["set"] += 1
                    torch.cat(xset, out=packed_in)
                    for r, out in enumerate(outs):
                        out.copy_(packed_out[r * args.tokens:(r + 1) * args.tokens])

                for fn in (alone, beside, packed, copies_only):
                    for _ in range(5):
                        fn()
                torch.cuda.synchronize()
                t_alone = time_ms(alone, args.repeat, flush)
                t_beside = time_ms(beside, args.repeat, flush)
                t_packed = time_ms(packed, args.repeat, flush)
                t_copies = time_ms(copies_only, args.repeat, flush)
                flop = 2.0 * reqs * args.tokens * k * n
                print(f"{name:8} {op:8} {reqs:4d} {t_alone:9.4f} {t_beside:9.4f} {t_packed:9.4f} {t_copies:9.4f}"
                      f" {t_packed / t_alone:12.3f} {t_packed / t_beside:13.3f}"
                      f" {flop / t_alone / 1e9:13.0f} {flop / t_packed / 1e9:7.0f}")


if __name__ == "__main__":
    main()
