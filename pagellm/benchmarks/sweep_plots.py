"""The sweep's PNG plots (matplotlib, Agg: no display needed): throughput against load, and TTFT and
TPOT percentiles against load with the SLO limits, the knee and the recommended rung marked on both."""
from __future__ import annotations

from pathlib import Path
from typing import Any

_PERCENTILES = ("p50", "p90", "p99")
_AXIS_LABELS = {"request-rate": "request rate (requests/s)", "max-concurrency": "requests in flight (client)",
                "max-num-seqs": "server --max-num-seqs"}


def plot_sweep(rungs: list[dict[str, Any]], ladder: str, slo: dict[str, float], analysis: dict[str, Any],
               out_dir: Path) -> list[Path]:
    """Write sweep_throughput.png and sweep_latency.png into `out_dir`; returns their paths."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("bench sweep draws its plots with matplotlib: pip install 'pagellm[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    loads = [r["load"] for r in rungs]
    marks = {"knee": analysis["throughput_knee"], "recommended": analysis["recommended"]}
    log_x = loads[-1] / loads[0] >= 8  # a doubling ladder reads best on a log axis

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(loads, [r["total_token_throughput"] for r in rungs], "s--", color="tab:gray", label="total tokens/s")
    ax.plot(loads, [r["output_throughput"] for r in rungs], "o-", color="tab:blue", label="output tokens/s")
    for load, rung in zip(loads, rungs):
        ax.annotate(f"{rung['request_throughput']:.2f} req/s", (load, rung["output_throughput"]),
                    textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title("Throughput against load")
    _finish(ax, ladder, loads, marks, log_x)
    throughput_png = out_dir / "sweep_throughput.png"
    fig.tight_layout()
    fig.savefig(throughput_png, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, metric, title in ((axes[0], "ttft", "Time to first token"), (axes[1], "tpot", "Time per output token")):
        for stat, style in zip(_PERCENTILES, ("o-", "s-", "^-")):
            values = [r[f"{stat}_{metric}_ms"] for r in rungs]
            ax.plot(loads, [float("nan") if v is None else v for v in values], style, label=stat)
        for key, limit in slo.items():
            if key.endswith(f"_{metric}_ms"):
                ax.axhline(limit, color="black", linestyle=":", label=f"SLO {key.split('_')[0]} {limit:g} ms")
        ax.set_ylabel("milliseconds")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        _finish(ax, ladder, loads, marks, log_x)
    latency_png = out_dir / "sweep_latency.png"
    fig.tight_layout()
    fig.savefig(latency_png, dpi=110)
    plt.close(fig)
    return [throughput_png, latency_png]


def _finish(ax: Any, ladder: str, loads: list[float], marks: dict[str, int | None], log_x: bool) -> None:
    """Axis label and scale, the knee's and the recommended rung's lines, the grid and the legend."""
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_xticks(loads, [f"{v:g}" for v in loads])
    ax.set_xlabel(_AXIS_LABELS[ladder])
    ax.margins(x=0.08)
    for (name, index), style in zip(marks.items(), (("tab:red", "-."), ("tab:green", ":"))):
        if index is not None:
            ax.axvline(loads[index], color=style[0], linestyle=style[1], linewidth=2, alpha=0.7,
                       label=f"{name} ({loads[index]:g})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
