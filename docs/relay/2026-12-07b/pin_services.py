"""Pin each process of a running `tokenrelay up` mesh (its state file's `services`) to a physical core of its
own, for measurement only (docs/benchmarks.md, eleventh session): the router, the engine, Redis and the
tokenizer each get the first logical CPU of a distinct physical core among CPUS (every thread of the process,
`taskset -a`), the sibling hyperthreads left idle. Prints the host's topology and the placement.
    python3 docs/relay/2026-12-07b/pin_services.py STATE_FILE [CPUS, default 0-7]
"""

import json
import pathlib
import subprocess
import sys


def cpus(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def main() -> None:
    services = json.loads(pathlib.Path(sys.argv[1]).read_text())["services"]
    allowed = cpus(sys.argv[2] if len(sys.argv) > 2 else "0-7")
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in allowed:
        topo = pathlib.Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        key = ((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip())
        cores.setdefault(key, []).append(cpu)
    print("physical cores (logical CPUs):", sorted(cores.values()))
    firsts = [group[0] for group in sorted(cores.values())]
    for name, cpu in zip(("router", "engine", "redis", "tokenizer"), firsts, strict=False):
        pid = services[name]["pid"]
        subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(pid)], check=True, capture_output=True)
        print(f"{name} (pid {pid}) on CPU {cpu}")


if __name__ == "__main__":
    main()
