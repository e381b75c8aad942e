"""The flags `tokenrelay up` gives its tokenizer replicas (tokenrelay_tools/cli/launcher.py)."""

from __future__ import annotations

import pathlib

from tokenizer_svc.config import load_settings
from tokenrelay_tools.cli.launcher import tokenizer_argv

MODEL = pathlib.Path("/models/m")


def test_one_replica_keeps_the_whole_library_pool() -> None:
    assert tokenizer_argv(MODEL, 1, [], cores=16) == ["--tokenizer", "/models/m"]


def test_replicas_share_the_cores_and_user_flags_win() -> None:
    assert tokenizer_argv(MODEL, 4, [], cores=16) == ["--tokenizer", "/models/m", "--library-threads", "4"]
    assert tokenizer_argv(MODEL, 3, [], cores=2)[-1] == "1"          # never below one thread
    argv = tokenizer_argv(MODEL, 2, ["--library-threads=6", "--chat-template=chatml"], cores=8)
    assert load_settings(argv).library_threads == 6                   # the user's flag comes last


# ---- the hf engines' device and the dev tenant's prompt cap (issue 14) ----------------------------
from tokenrelay_tools.cli.device import CPU_PROMPT_CAP, Device, choose_device, default_prompt_cap  # noqa: E402
from tokenrelay_tools.cli.launcher import Mesh, MeshOptions, engine_argv  # noqa: E402


def test_auto_takes_the_gpu_when_torch_sees_one_and_says_why() -> None:
    two = choose_device("auto", "hf", [], probe=lambda: 2)
    assert (two.name, two.gpus, two.why) == ("cuda", 2, "torch sees 2 GPUs")
    assert [two.for_replica(i) for i in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]   # round the GPUs
    none = choose_device("auto", "hf", [], probe=lambda: 0)
    assert none.name == "cpu" and "torch sees no GPU" in none.why and "--device cuda" in none.why
    assert choose_device("cpu", "hf", [], probe=lambda: 8).name == "cpu"
    assert choose_device("cuda:1", "hf", [], probe=lambda: 0).for_replica(3) == "cuda:1"
    assert choose_device("auto", "sim", [], probe=lambda: 1 / 0).name == "cpu"      # never probed for sim
    passed = choose_device("auto", "hf", ["--hf-device=cuda:3"], probe=lambda: 1 / 0)
    assert passed.why == "--engine-arg=--hf-device=cuda:3"                          # the user's flag wins


def test_each_engine_replica_gets_its_device() -> None:
    assert engine_argv(MODEL, "hf", 1, [], device="cuda")[-2:] == ["--hf-device", "cuda"]
    assert "--hf-device" not in engine_argv(MODEL, "hf", 1, [])
    assert "--hf-threads" not in engine_argv(MODEL, "hf", 2, [], cores=16, device="cuda:1")  # GPU: no core split
    mesh = Mesh(MeshOptions(model=MODEL, engine="hf", engine_args=["--hf-device", "cpu"]))
    mesh.device = choose_device("auto", "hf", mesh.o.engine_args)
    assert mesh._engine_device(0) == ""                         # the user's --hf-device passes alone


def test_the_dev_tenant_caps_prompts_on_a_cpu_engine_only(tmp_path) -> None:
    cpu, gpu = Device("cpu", 0, ""), Device("cuda", 1, "")
    assert default_prompt_cap("hf", cpu) == CPU_PROMPT_CAP == 2048
    assert default_prompt_cap("hf", gpu) == default_prompt_cap("sim", cpu) == 0
    for given, expected in ((None, "2048"), (0, "0"), (500, "500")):
        mesh = Mesh(MeshOptions(model=MODEL, engine="hf", run_dir=tmp_path, max_prompt_tokens=given))
        mesh.device = cpu
        assert f"max_prompt_tokens: {expected}\n" in mesh._write_tenants().read_text()


def test_routers_wait_out_a_cpu_prefill(monkeypatch) -> None:
    """A CPU hf engine is silent while it prefills (1.9k tokens took 11 s here): the router's 10 s
    progress timeout made such prompts ENGINE_STALLED, so the launcher gives its routers more."""
    monkeypatch.delenv("TOKENRELAY_ROUTER_ENGINE_PROGRESS_TIMEOUT", raising=False)
    flags = {}
    for engine, device, cap in (("hf", "cpu", None), ("hf", "cpu", 0), ("hf", "cuda", None), ("sim", "cpu", None)):
        mesh = Mesh(MeshOptions(model=MODEL, engine=engine, max_prompt_tokens=cap))
        mesh.device = Device(device, 0, "")
        flags[(engine, device, cap)] = mesh.router_flags()
    assert flags == {("hf", "cpu", None): ["--engine-progress-timeout", "60"],
                     ("hf", "cpu", 0): ["--engine-progress-timeout", "600"],
                     ("hf", "cuda", None): [], ("sim", "cpu", None): []}
    monkeypatch.setenv("TOKENRELAY_ROUTER_ENGINE_PROGRESS_TIMEOUT", "5")
    mesh = Mesh(MeshOptions(model=MODEL, engine="hf"))
    mesh.device = Device("cpu", 0, "")
    assert mesh.router_flags() == []                                   # the user's own setting wins


def test_routers_tokenize_short_prompts_and_detokenize_in_process_unless_told_otherwise(monkeypatch) -> None:
    for name in ("TOKENRELAY_ROUTER_DETOKENIZE", "TOKENRELAY_ROUTER_TOKENIZE_LOCAL_BYTES",
                 "TOKENRELAY_TOKENIZER_CHAT_TEMPLATE"):
        monkeypatch.delenv(name, raising=False)
    local = ["--detokenize", "local", "--tokenize-local-bytes", "16384"]
    assert Mesh(MeshOptions(model=MODEL, engine="sim")).local_tokenizer_flags() == local
    # The user's flags come after these and win; a config file or template of theirs turns them off.
    for router_args, tokenizer_args in ((["--config=r.yaml"], []), ([], ["--chat-template", "chatml"]),
                                        ([], ["--config", "t.yaml"])):
        mesh = Mesh(MeshOptions(model=MODEL, engine="sim", router_args=router_args, tokenizer_args=tokenizer_args))
        assert mesh.local_tokenizer_flags() == [], (router_args, tokenizer_args)
    monkeypatch.setenv("TOKENRELAY_ROUTER_DETOKENIZE", "tokenizer")
    assert Mesh(MeshOptions(model=MODEL, engine="sim")).local_tokenizer_flags() == []


# ---- the sim's replies with `up --engine sim`'s own tokenizer ----------------------------------------
async def test_sim_replies_with_the_byte_tokenizer_re_tokenize_to_the_same_ids(tmp_path) -> None:
    # Through the mesh a chat turn resends the last reply as text; with the sim drawing every id of the
    # byte-level tokenizer (lone bytes of multi-byte UTF-8, the turn markers) that text came back as other
    # ids, so the mesh's prompts hit the prefix cache less than the engine alone's (61% against 73%).
    import asyncio

    from tokenizers import Tokenizer

    from engine_svc.backends.base import GenerationRequest
    from engine_svc.backends.sim import SimBackend
    from engine_svc.config import EngineSettings
    from services.config import load_settings as parse
    from tests.engine.engine_testkit import run_backend
    from tokenrelay_tools.cli.byte_tokenizer import ensure_byte_tokenizer
    from tokenrelay_tools.cli.launcher import engine_args_for

    model = ensure_byte_tokenizer(tmp_path)
    flags = engine_args_for(model, "sim")
    assert "--sim-sample-ids-from" in flags
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    for argv, round_trips in ((flags, True), (flags[:2], False)):       # flags[:2]: the vocabulary alone
        sim = SimBackend(parse(EngineSettings, ["--backend", "sim", "--sim-profile", "instant", *argv]).sim)
        await sim.start()
        try:
            reqs = [GenerationRequest(request_id=f"r{i}", prompt_token_ids=[40 + i], max_tokens=200,
                                      temperature=1.0, seed=i) for i in range(10)]
            out = await asyncio.wait_for(run_backend(sim, reqs), 30)
        finally:
            await sim.close()
        same = [tok.encode(tok.decode(out.tokens(r.request_id), skip_special_tokens=False),
                           add_special_tokens=False).ids == out.tokens(r.request_id) for r in reqs]
        assert all(same) if round_trips else not any(same), argv
