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
