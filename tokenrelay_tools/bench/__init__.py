"""`tokenrelay bench`: a load generator for the mesh and for one engine alone.

Modules, one responsibility each: `spec` (the workload dataclasses), `workload` (YAML/JSON
loading, named workloads, seeded sampling), `trace` (JSONL traces), `arrivals`
(open-loop arrival times), `prompts` (synthetic text / token ids), `targets` (mesh and engine
clients), `runner` (drives a target, records timings), `report` (statistics and tables),
`progress` (stderr progress bar), `plot` (PNG charts), `cli` (the command line).
"""

from .cli import add_bench_parser, run_bench

__all__ = ["add_bench_parser", "run_bench"]
