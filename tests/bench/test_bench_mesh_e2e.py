"""`tokenrelay bench --compare` against a real mesh (`tokenrelay up --engine sim` with stories260K, else a
tiny Llama built here: the sim engine reads only its tokenizer and config): router, tokenizer, engine and
Redis as real processes on ephemeral ports."""

from __future__ import annotations

import asyncio
import json
import pathlib

import pytest

from tests import artefacts
from tests.bench.benchkit import bench_args
from tests.tiny_model import build_model
from tokenrelay_tools.bench.cli import run_bench
from tokenrelay_tools.cli.launcher import Mesh, MeshOptions


@pytest.mark.parametrize("calls", ["call", "stream"])
async def test_compare_against_a_real_mesh(tmp_path: pathlib.Path, calls: str) -> None:
    """`--mesh-calls stream`: the same chats as Generate requests on one open Stream call."""
    # stories260K's context is 512 tokens; the tiny model's tokenizer is coarser (its vocabulary knows four
    # sentences), so the same chats need a longer context.
    stories = artefacts.optional("stories260K")
    context = 512 if stories is not None else 2048
    model = stories or build_model(tmp_path / "tiny", max_positions=context)
    state = tmp_path / "state.json"
    # The chat turns are served by the tokenizer's built-in chatml (stories260K ships no chat template).
    mesh = Mesh(MeshOptions(model=model, engine="sim", port=0, run_dir=tmp_path / "run", state_file=state,
                            startup_timeout=60, tokenizer_args=["--chat-template=chatml"]))
    try:
        await mesh.start()
        out = tmp_path / "report.json"
        args = bench_args("--workload", "chat-multiturn", "--compare", "--state-file", str(state), "--requests", "16",
                     "--concurrency", "4", "--length-scale", "0.3", "--slo-ttft", "2", "--json", str(out),
                     "--no-progress", "--mesh-calls", calls)
        assert await run_bench(args) == 0
    finally:
        await asyncio.to_thread(mesh.stop, 5.0)
    runs = json.loads(out.read_text())["runs"]
    mesh_run, engine_run = runs["mesh"], runs["engine"]
    assert mesh_run["summary"]["requests"] == mesh_run["summary"]["ok"] == 16, mesh_run["summary"]["errors_by_reason"]
    assert engine_run["summary"]["ok"] == 16
    # The engine replayed the mesh's token counts; the mesh alone reports admission and its own TTFT.
    assert engine_run["summary"]["tokens"]["prompt"] == mesh_run["summary"]["tokens"]["prompt"]
    assert engine_run["summary"]["tokens"]["completion"] == mesh_run["summary"]["tokens"]["completion"]
    assert mesh_run["summary"]["queue"]["n"] == 16 and engine_run["summary"]["queue"] is None
    assert mesh_run["summary"]["server_ttft"]["p50"] <= mesh_run["summary"]["ttft"]["p50"]
    assert mesh_run["target"]["chars_per_token"] > 0 and mesh_run["target"]["max_context"] == context
    assert mesh_run["target"]["calls"] == calls
