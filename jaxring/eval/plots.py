"""PNG figures of the evaluations (matplotlib, the `eval` extra, imported only here): loss by position bucket
as lines (one per result: before and after a context extension on one figure), the needle's accuracy as a
heatmap of context length × depth."""

from __future__ import annotations

from collections.abc import Sequence


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("the PNG plots need matplotlib: pip install 'jaxring[eval]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def check_available() -> None:
    """ValueError (one line) when matplotlib is missing: said before a model is scored, not after."""
    _pyplot()


def perplexity_plot(results: Sequence[dict], path: str, title: str = "loss by position") -> str:
    """Writes the mean loss of each position bucket (x: the bucket's end, log scale) of each result
    (`jaxring.eval.perplexity.evaluate`'s dicts, labelled by their "label" or "model") to `path`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ends = [b["end"] for b in r["buckets"]]
        ax.plot(ends, [b["loss"] for b in r["buckets"]], marker="o", label=r.get("label") or r["model"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position (bucket end, tokens)")
    ax.set_ylabel("mean loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")  # the path may be a temporary name
    plt.close(fig)
    return path


def needle_heatmap(result: dict, path: str, title: str | None = None) -> str:
    """Writes the needle's exact-match accuracy (rows: depths, columns: context lengths) to `path`."""
    plt = _pyplot()
    lengths, depths, acc = result["lengths"], result["depths"], result["accuracy"]  # acc [length][depth]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.0 + 0.5 * len(depths)))
    grid = [[acc[i][j] for i in range(len(lengths))] for j in range(len(depths))]
    image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    for j in range(len(depths)):
        for i in range(len(lengths)):
            ax.text(i, j, f"{grid[j][i]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title or f"pass key retrieval: {result.get('label') or result['model']}", fontsize=9)
    fig.colorbar(image, ax=ax, label="exact match")
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")  # the path may be a temporary name
    plt.close(fig)
    return path
