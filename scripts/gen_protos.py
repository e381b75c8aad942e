"""Regenerate the Python stubs in services/proto/ from protos/.

Run `python scripts/gen_protos.py` after editing a .proto; `--check` exits 1 when the
committed stubs differ from what the protos generate (used by CI).
"""

from __future__ import annotations

import argparse
import difflib
import pathlib
import re
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "services" / "proto"
# protoc writes `from tokenrelay.v1 import x_pb2`; the stubs live inside the `services` package.
IMPORT_RE = re.compile(r"^from tokenrelay\.v1 import", re.M)
IMPORT_FIX = "from services.proto.tokenrelay.v1 import"


def generate(dest: pathlib.Path) -> None:
    from grpc_tools import protoc  # imported lazily: only needed by developers and CI

    files = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    include = str(pathlib.Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={dest}",
            f"--pyi_out={dest}", f"--grpc_python_out={dest}", *files]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for path in dest.rglob("*.py*"):
        path.write_text(IMPORT_RE.sub(IMPORT_FIX, path.read_text()))
    for pkg in {p.parent for p in dest.rglob("*_pb2.py")} | {dest / "tokenrelay"}:
        (pkg / "__init__.py").touch()
    (dest / "__init__.py").write_text('"""Generated gRPC stubs (scripts/gen_protos.py). Do not edit."""\n')


def snapshot(root: pathlib.Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed stubs are stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = pathlib.Path(tmp) / "proto"
        fresh.mkdir()
        generate(fresh)
        if args.check:
            old, new = snapshot(OUT), snapshot(fresh)
            if old != new:
                for name in sorted(set(old) | set(new)):
                    if old.get(name) != new.get(name):
                        sys.stdout.writelines(difflib.unified_diff(
                            old.get(name, "").splitlines(True), new.get(name, "").splitlines(True),
                            f"committed/{name}", f"generated/{name}", n=1))
                print("stale stubs: run `python scripts/gen_protos.py`", file=sys.stderr)
                return 1
            print("stubs up to date")
            return 0
        shutil.rmtree(OUT, ignore_errors=True)
        shutil.copytree(fresh, OUT)
    print(f"generated stubs in {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
