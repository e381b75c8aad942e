"""What a full garbage collection costs a service process, before and after `services.gcstats.settle()`.

Imports what a service imports (the three services and the CLI; with ``--hf`` also torch and
transformers, as an `hf` engine does), then times ``gc.collect()`` three times, freezes (as each
service does once it is ready to serve) and times it again. The baseline is the same process before
the freeze.

    python bench/bench_gc.py [--hf]
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def _collect_ms() -> float:
    start = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - start) * 1000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf", action="store_true", help="also import torch and transformers")
    args = p.parse_args(argv)
    import engine_svc.app  # noqa: F401
    import router_svc.app  # noqa: F401
    import tokenizer_svc.app  # noqa: F401
    import tokenrelay_tools.cli.main  # noqa: F401
    from services import gcstats

    if args.hf:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    print(f"objects tracked: {len(gc.get_objects()):,}")
    before = [_collect_ms() for _ in range(3)]
    frozen = gcstats.settle()
    after = [_collect_ms() for _ in range(3)]
    print(f"full collection, ms: before freeze {', '.join(f'{v:.1f}' for v in before)}; "
          f"after freezing {frozen:,} objects {', '.join(f'{v:.2f}' for v in after)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
