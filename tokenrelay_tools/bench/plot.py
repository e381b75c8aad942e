"""`--plot DIR`: PNG charts of a run (latency CDFs, throughput over time), drawn with matplotlib.

matplotlib is optional (the `bench` extra): it is imported only here, only when charts are asked
for, and its absence is reported as a one-line instruction rather than a traceback.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from .runner import RequestRecord, RunResult


class PlotUnavailable(RuntimeError):
    pass


def require_matplotlib() -> Any:
    try:
        import matplotlib
        import numpy  # noqa: F401 - the charts' arithmetic; checked here so a missing one is one message
    except ImportError as exc:
        raise PlotUnavailable(f"--plot needs {exc.name}: pip install 'tokenrelay[bench]' "
                              "(or pip install matplotlib numpy)") from None
    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    return plt


def _series(results: Mapping[str, RunResult]) -> dict[str, list[RequestRecord]]:
    """What the lines are: one per target when comparing, else the whole run plus one per tenant."""
    if len(results) > 1:
        return {name: [r for r in res.records if r.ok] for name, res in results.items()}
    (res,) = results.values()
    ok = [r for r in res.records if r.ok]
    lines = {"all": ok}
    tenants = sorted({r.tenant for r in ok})
    if len(tenants) > 1:
        lines.update({t: [r for r in ok if r.tenant == t] for t in tenants})
    return lines


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    if not values:
        return
    import numpy as np

    x = np.sort(np.asarray(values) * 1000)
    y = np.arange(1, x.size + 1) / x.size
    ax.step(x, y, where="post", label=f"{label} (n={x.size})")


def plot_latency_cdfs(results: Mapping[str, RunResult], path: pathlib.Path, title: str) -> None:
    plt = require_matplotlib()
    from matplotlib import ticker

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    series = _series(results)
    metrics = (("TTFT", lambda r: [r.ttft] if r.ttft is not None else []),
               ("inter-token latency", lambda r: r.itl),
               ("end-to-end latency", lambda r: [r.e2e] if r.e2e is not None else []))
    for ax, (name, get) in zip(axes, metrics, strict=True):
        for label, recs in series.items():
            _cdf(ax, [v for r in recs for v in get(r)], label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "inter-token latency" else "fraction of tokens")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.set_ylim(0, 1.01)
        for q in (0.5, 0.99):
            ax.axhline(q, color="grey", lw=0.6, ls=":")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput(results: Mapping[str, RunResult], path: pathlib.Path, title: str, bin_s: float = 1.0) -> None:
    plt = require_matplotlib()
    import numpy as np

    fig, (ax_tok, ax_req) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for name, res in results.items():
        edges = np.arange(0.0, res.wall + bin_s, bin_s)
        if edges.size < 2:
            continue
        times = [t for r in res.records if r.ok for t, n in r.deltas for _ in range(max(n, 0))]
        tokens, _ = np.histogram(times, bins=edges)
        done, _ = np.histogram([r.start + (r.e2e or 0.0) for r in res.records if r.ok], bins=edges)
        failed, _ = np.histogram([r.start for r in res.records if not r.ok], bins=edges)
        ax_tok.step(edges[:-1], tokens / bin_s, where="post", label=name)
        ax_req.step(edges[:-1], done / bin_s, where="post", label=f"{name} completed")
        if failed.any():
            ax_req.step(edges[:-1], failed / bin_s, where="post", ls="--", label=f"{name} failed")
    ax_tok.set_ylabel("output tokens/s")
    ax_req.set_ylabel("requests/s")
    ax_req.set_xlabel(f"seconds since start ({bin_s:g} s bins)")
    for ax in (ax_tok, ax_req):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(results: Mapping[str, RunResult], out_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """Write latency_cdf.png and throughput.png into ``out_dir``; returns their paths."""
    require_matplotlib()  # fail before creating anything when matplotlib is missing
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    first = next(iter(results.values()))
    title = f"{first.workload}: " + " vs ".join(results)
    paths = [out / "latency_cdf.png", out / "throughput.png"]
    plot_latency_cdfs(results, paths[0], title)
    plot_throughput(results, paths[1], title)
    return paths
