"""Plot a `benchmarks/kernels.py` result: speedup over dense cuBLAS against M, one line per kernel.

    python benchmarks/plot_kernels.py benchmarks/results/run/kernels.json [--out kernels.png]

One panel per (dtype, layer shape), M on a log axis, a dashed line at 1x (dense).
"""
import argparse
import json
from pathlib import Path
from typing import List, Optional


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("speedup_vs_dense") is not None]
    if not rows:
        raise SystemExit("no rows with a dense (cublas) baseline to plot against")
    panels = list(dict.fromkeys((r["dtype"], r["shape"]) for r in rows))
    columns = min(3, len(panels))
    lines = -(-len(panels) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(5 * columns, 3.8 * lines), squeeze=False)
    for ax, (dtype, shape) in zip(axes.flat, panels):
        panel = [r for r in rows if r["dtype"] == dtype and r["shape"] == shape]
        for kernel in dict.fromkeys(r["kernel"] for r in panel):
            points = sorted((r["M"], r["speedup_vs_dense"]) for r in panel if r["kernel"] == kernel)
            ax.plot(*zip(*points), marker="o", label=kernel)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{shape} ({panel[0]['K']}x{panel[0]['N']}), {dtype}")
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("speedup over dense cuBLAS")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    meta = result["meta"]
    fig.suptitle(f"{meta['device']}: {meta['bits']}-bit g{meta['group_size']} kernels "
                 f"(copy bandwidth {meta['copy_TBps']:.2f} TB/s)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path, help="kernels.json written by benchmarks/kernels.py")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: beside the JSON)")
    args = parser.parse_args(argv)
    out = args.out or args.result.with_suffix(".png")
    plot(json.loads(args.result.read_text()), out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
