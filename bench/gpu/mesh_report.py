"""The GPU mesh run's table: in-process vs engine alone vs mesh, per stream count (run_mesh_gpu.sh).

Reads ``inproc_N.json``, ``engine_N.json`` and ``mesh_N.json`` (bench/gpu/mesh_bench.py rows) from
the run's work directory, prints one Markdown table and writes every row plus the ratios as JSON.

    python bench/gpu/mesh_report.py WORKDIR --streams "1 16 64 256" --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from typing import Any

TARGETS = ("inproc", "engine", "mesh")
TARGET_RATIO = 0.98


def _read(path: pathlib.Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float:
    if not a or not b or not b.get("output_tok_s"):
        return math.nan
    return float(a["output_tok_s"]) / float(b["output_tok_s"])


def _tok(r: dict[str, Any] | None) -> str:
    if not r:
        return "—"
    flag = "*" if r.get("errors") or r.get("truncated") else ""
    return f"{r['output_tok_s']:,.1f}{flag}"


def _ttft(r: dict[str, Any] | None) -> str:
    if not r or math.isnan(r.get("ttft_p50_s", math.nan)):
        return "—"
    return f"{r['ttft_p50_s'] * 1000:,.0f} / {r['ttft_p99_s'] * 1000:,.0f}"


def _fmt(x: float) -> str:
    return "—" if math.isnan(x) else f"{x:.3f}"


def report(work: pathlib.Path, streams: list[int]) -> tuple[str, dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    lines = ["| streams | in-process tok/s | engine alone tok/s | mesh tok/s | mesh / in-process | "
             "mesh / engine | engine / in-process | TTFT p50 / p99 ms: in-process | engine | mesh |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    notes: list[str] = []
    for n in streams:
        got = {t: _read(work / f"{t}_{n}.json") for t in TARGETS}
        ratios = {"mesh_over_inproc": _ratio(got["mesh"], got["inproc"]),
                  "mesh_over_engine": _ratio(got["mesh"], got["engine"]),
                  "engine_over_inproc": _ratio(got["engine"], got["inproc"])}
        raw = _read(work / f"raw_cb_{n}.json")   # optional reference: transformers CB alone, one wave
        rows.append({"streams": n, **got, **ratios, **({"raw_cb": raw} if raw else {})})
        if raw:
            notes.append(f"raw_cb {n} (transformers CB alone, own process, fifo, one wave of {raw['requests']}): "
                         f"{raw['output_tok_s']:,.1f} tok/s, TTFT p50 / p99 {raw['ttft_p50_s'] * 1000:,.0f} / "
                         f"{raw['ttft_p99_s'] * 1000:,.0f} ms")
        lines.append(f"| {n} | {_tok(got['inproc'])} | {_tok(got['engine'])} | {_tok(got['mesh'])} | "
                     f"{_fmt(ratios['mesh_over_inproc'])} | {_fmt(ratios['mesh_over_engine'])} | "
                     f"{_fmt(ratios['engine_over_inproc'])} | {_ttft(got['inproc'])} | {_ttft(got['engine'])} | "
                     f"{_ttft(got['mesh'])} |")
        for t, r in got.items():
            if r is None:
                notes.append(f"{t} {n}: no result")
            elif r.get("errors") or r.get("truncated") or r.get("warmup_error"):
                notes.append(f"{t} {n}: {r['ok']}/{r['requests']} ok, truncated={r.get('truncated')}, "
                             f"errors {r.get('error_kinds')} {r.get('warmup_error', '')}")
            if r is not None and r.get("cached_prompt_tokens"):
                notes.append(f"{t} {n}: {r['cached_prompt_tokens']} prompt tokens served from the prefix cache")
    mesh_ratios = [r["mesh_over_inproc"] for r in rows if not math.isnan(r["mesh_over_inproc"])]
    verdict = (f"mesh / in-process: min {min(mesh_ratios):.3f} over {len(mesh_ratios)} stream counts "
               f"(target >= {TARGET_RATIO}: {'met' if min(mesh_ratios) >= TARGET_RATIO else 'NOT met'})"
               if mesh_ratios else "mesh / in-process: no complete pair")
    sample = next((r[t] for r in rows for t in TARGETS if r.get(t)), None) or {}
    head = (f"output tok/s = output tokens / wall s (first submit to last finish); TTFT = submit -> first token "
            f"at the caller. Each phase: {sample.get('requests', '?')}+ requests (max(per-stream x N, min)), "
            f"{sample.get('prompt_tokens', '?')} random prompt ids, {sample.get('output_tokens_per_request', '?')} "
            "output tokens, ignore_eos, closed loop. * = errors or cut short (notes).")
    text = "\n".join([head, "", *lines, "", verdict, *(f"note: {x}" for x in notes)]) + "\n"
    return text, {"rows": rows, "verdict": verdict, "notes": notes, "target_ratio": TARGET_RATIO}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("work", help="the run's work directory")
    p.add_argument("--streams", default="1 16 64 256")
    p.add_argument("--json", default="")
    a = p.parse_args()
    work = pathlib.Path(a.work)
    text, doc = report(work, [int(s) for s in a.streams.split()])
    versions = work / "versions.txt"
    doc["versions"] = versions.read_text() if versions.exists() else ""
    print(text, end="")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
