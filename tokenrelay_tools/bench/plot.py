"""`--plot DIR`: PNG charts of a run (latency CDFs, throughput over time), drawn with matplotlib.

An axis with nothing to draw says "no data" and why (e.g. no successful requests); the throughput
chart spans the whole run, to the last request's end or failure (drain included), and draws the
failed requests per second beside the completed ones.

matplotlib is optional (the `bench` extra): it is imported only here, only when charts are asked
for, and its absence is reported as a one-line instruction rather than a traceback.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Mapping, Sequence
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


def _no_success_reason(records: Sequence[RequestRecord]) -> str:
    """Why a set of records has no latency to draw: nothing sent, or nothing succeeded."""
    if not records:
        return "no requests were issued"
    failed = sum(1 for r in records if not r.ok)
    return f"no successful requests ({failed} of {len(records)} failed)" if failed == len(records) else ""


def _empty_reason(records: Sequence[RequestRecord], metric: str) -> str:
    """Why ``metric`` has no values among ``records`` (all of a target's records)."""
    why = _no_success_reason(records)
    if why:
        return why
    return {"TTFT": "no successful request streamed a token",
            "inter-token latency": "no successful reply had more than one token",
            }.get(metric, "no timed successful request")


def _note(ax: Any, text: str) -> None:
    """Say on the axes themselves that they are empty, and why, instead of drawing blank axes."""
    note = ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=9, color="0.3",
                   bbox={"boxstyle": "round", "facecolor": "0.95", "edgecolor": "0.7"})
    note.set_in_layout(False)  # a long reason must not squeeze the axes


def _cdf(ax: Any, values: Sequence[float], label: str) -> bool:
    """Draw one CDF; False when there is nothing to draw."""
    if not values:
        return False
    import numpy as np

    x = np.sort(np.asarray(values) * 1000)
    y = np.arange(1, x.size + 1) / x.size
    ax.step(x, y, where="post", label=f"{label} (n={x.size})")
    return True


_METRICS: tuple[tuple[str, Callable[[RequestRecord], Sequence[float]]], ...] = (
    ("TTFT", lambda r: [r.ttft] if r.ttft is not None else []),
    ("inter-token latency", lambda r: r.itl),
    ("end-to-end latency", lambda r: [r.e2e] if r.e2e is not None else []),
)


def latency_figure(results: Mapping[str, RunResult], title: str) -> Any:
    """TTFT, ITL and E2E CDFs side by side; an axis without data says so, and why."""
    plt = require_matplotlib()
    from matplotlib import ticker

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    series = _series(results)
    for ax, (name, get) in zip(axes, _METRICS, strict=True):
        drawn = [_cdf(ax, [v for r in recs for v in get(r)], label) for label, recs in series.items()]
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "inter-token latency" else "fraction of tokens")
        ax.set_ylim(0, 1.01)
        if not any(drawn):
            if len(results) == 1:
                why = _empty_reason(next(iter(results.values())).records, name)
            else:
                why = "\n".join(f"{t}: {_empty_reason(res.records, name)}" for t, res in results.items())
            _note(ax, f"no data\n{why}")
            ax.set_yticks([])
            ax.set_xticks([])
            continue
        if len(results) > 1:  # a target with nothing to show still gets a legend entry saying why
            for (target, res), shown in zip(results.items(), drawn, strict=True):
                if not shown:
                    ax.plot([], [], ls="none", label=f"{target}: no data ({_empty_reason(res.records, name)})")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        for q in (0.5, 0.99):
            ax.axhline(q, color="grey", lw=0.6, ls=":")
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_latency_cdfs(results: Mapping[str, RunResult], path: pathlib.Path, title: str) -> None:
    plt = require_matplotlib()
    fig = latency_figure(results, title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _end(r: RequestRecord) -> float:
    """When a request finished or failed (older records without ``end``: its start plus E2E)."""
    return r.end if r.end is not None else r.start + (r.e2e or 0.0)


def run_end(res: RunResult) -> float:
    """The whole run: up to the last request's end or failure, drain included."""
    return max([res.wall, res.stopped_at or 0.0, *(_end(r) for r in res.records)])


def _bins(ax: Any, edges: Any, values: Any, **kw: Any) -> Any:
    """One value per bin, drawn flat across the whole bin, the last one included."""
    import numpy as np

    (line,) = ax.step(edges, np.append(values, values[-1]), where="post", **kw)
    return line


def throughput_figure(results: Mapping[str, RunResult], title: str, bin_s: float = 1.0) -> Any:
    """Output tokens/s, and completed and failed requests/s, over the whole run (drain shaded)."""
    plt = require_matplotlib()
    import numpy as np

    fig, (ax_tok, ax_req) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    horizon = 0.0
    any_tokens = False
    for name, res in results.items():
        end = run_end(res)
        horizon = max(horizon, end)
        edges = np.arange(0.0, end + bin_s, bin_s)
        if edges.size < 2:
            edges = np.array([0.0, bin_s])
        times = [t for r in res.records if r.ok for t, n in r.deltas for _ in range(max(n, 0))]
        any_tokens = any_tokens or bool(times)
        tokens, _ = np.histogram(times, bins=edges)
        done, _ = np.histogram([_end(r) for r in res.records if r.ok], bins=edges)
        failed, _ = np.histogram([_end(r) for r in res.records if not r.ok], bins=edges)
        line = _bins(ax_tok, edges, tokens / bin_s, label=name)
        color = line.get_color()
        _bins(ax_req, edges, done / bin_s, color=color, label=f"{name} completed")
        if failed.any():
            _bins(ax_req, edges, failed / bin_s, color=color, ls="--", lw=1.6,
                  label=f"{name} failed ({int(failed.sum())})")
        if res.stopped_at is not None and end > res.stopped_at:
            for ax in (ax_tok, ax_req):
                ax.axvspan(res.stopped_at, end, color=color, alpha=0.08,
                           label=f"{name} draining (stopped by {res.stopped_by or '-'})" if ax is ax_req else None)
    if not any_tokens:
        whys = {name: _no_success_reason(res.records) or "no token deltas recorded" for name, res in results.items()}
        why = next(iter(whys.values())) if len(whys) == 1 else "\n".join(f"{n}: {w}" for n, w in whys.items())
        _note(ax_tok, f"no output tokens\n{why}")
    ax_tok.set_ylabel("output tokens/s")
    ax_req.set_ylabel("requests/s (by end time)")
    ax_req.set_xlabel(f"seconds since start ({bin_s:g} s bins)")
    ax_req.set_xlim(0.0, max(horizon, bin_s))
    for ax in (ax_tok, ax_req):
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_throughput(results: Mapping[str, RunResult], path: pathlib.Path, title: str, bin_s: float = 1.0) -> None:
    plt = require_matplotlib()
    fig = throughput_figure(results, title, bin_s)
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
