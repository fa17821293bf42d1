"""Plots a symbiosis-bench results.json: aggregate tokens/s and mean iteration time per run."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(results_path: str, png_path: str) -> None:
    with open(results_path) as f:
        results = json.load(f)
    runs = [(r["policy"], r["aggregate_tokens_per_s"], r["mean_iteration_s"]) for r in results["runs"]]
    if "baseline" in results:
        b = results["baseline"]
        runs.append(("monolithic\nbaseline", b["aggregate_tokens_per_s"], b["mean_iteration_s"]))
    names = [r[0] for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(names, [r[1] for r in runs], color="tab:blue")
    ax1.set_ylabel("aggregate tokens/s")
    ax2.bar(names, [1e3 * r[2] for r in runs], color="tab:orange")
    ax2.set_ylabel("mean iteration time (ms)")
    fig.suptitle(results["scenario"].get("name", "symbiosis-bench"))
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
