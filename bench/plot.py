"""Plots a symbiosis-bench results.json: aggregate tokens/s and mean iteration time of each run
(system, batching policy and number of clients)."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(results_path: str, png_path: str) -> None:
    with open(results_path) as f:
        results = json.load(f)
    runs = [r for r in results["runs"] if "aggregate_tokens_per_s" in r]
    names = [f"{r['system']}{'/' + r['policy'] if 'policy' in r else ''}\nN={r['count']}" for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(10, 1.2 * len(runs)), 4.5))
    ax1.bar(names, [r["aggregate_tokens_per_s"] for r in runs], color="tab:blue")
    ax1.set_ylabel("aggregate tokens/s")
    ax2.bar(names, [1e3 * r["mean_iteration_s"] for r in runs], color="tab:orange")
    ax2.set_ylabel("mean iteration time (ms)")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(results["scenario"].get("name", "symbiosis-bench"))
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
