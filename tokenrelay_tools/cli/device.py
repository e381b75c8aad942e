"""Which torch device `tokenrelay up` gives its `hf` engines, and the dev tenant's prompt cap.

`--device auto` (the default) uses the GPU when torch sees one (`cuda`; several engines are spread
over the GPUs, `cuda:0`, `cuda:1`, ...), else the CPU; the launcher says which, and why. The probe
runs torch in a child process only where an NVIDIA device node exists, so a CPU host pays nothing
and the launcher never keeps torch's memory. A `--engine-arg=--hf-device=...` given by the user wins.

A CPU is slow at prefill (issue 14: 8k tokens of prefill kept a 6-token request waiting ~60 s on the
2-core machine, a 24k-token prompt took 675 s to its first token; measured again with Gemma 3 270M
there: ~170 tokens/s, 1.9k tokens in 11-12 s, 4.3k in 25 s), so the dev tenant's `max_prompt_tokens`
defaults to `CPU_PROMPT_CAP` there: a capped prompt's first token comes in seconds. On a GPU and
with the sim engine it is the model's context (0).
"""

from __future__ import annotations

import glob
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

CPU_PROMPT_CAP = 2048
_PROBE = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"


@dataclass(frozen=True)
class Device:
    name: str          # "cpu" or "cuda"
    gpus: int          # GPUs torch sees (0 on the CPU)
    why: str           # how it was chosen, for the start message

    def for_replica(self, index: int) -> str:
        """The engine replica's torch device: replicas go round the GPUs."""
        return f"cuda:{index % self.gpus}" if self.name == "cuda" and self.gpus > 1 else self.name


def cuda_devices() -> int:
    """GPUs torch sees, from a child process (0 without an NVIDIA device node, or if torch fails)."""
    if not glob.glob("/dev/nvidia[0-9]*"):
        return 0
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip() or 0) if out.returncode == 0 else 0
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def user_device(engine_args: list[str]) -> str:
    """The --hf-device the user passed through --engine-arg, if any (the last one wins)."""
    found = ""
    for i, arg in enumerate(engine_args):
        if arg.startswith("--hf-device="):
            found = arg.split("=", 1)[1]
        elif arg == "--hf-device" and i + 1 < len(engine_args):
            found = engine_args[i + 1]
    return found


def choose_device(requested: str, engine: str, engine_args: list[str],
                  probe: Callable[[], int] = cuda_devices) -> Device:
    """The device of the `hf` engines: the user's --engine-arg, else `requested` (auto: the GPU
    when torch sees one). The sim engine runs no torch."""
    if engine != "hf":
        return Device("cpu", 0, "the sim engine runs no model")
    passed = user_device(engine_args)
    if passed:
        return Device("cpu" if passed == "cpu" else "cuda", 1, f"--engine-arg=--hf-device={passed}")
    if requested == "cpu":
        return Device("cpu", 0, "--device cpu")
    gpus = probe()
    if requested.startswith("cuda"):
        if requested != "cuda":
            return Device(requested, 1, f"--device {requested}")
        return Device("cuda", max(gpus, 1), "--device cuda")
    if gpus:
        return Device("cuda", gpus, f"torch sees {gpus} GPU{'s' if gpus > 1 else ''}")
    return Device("cpu", 0, "torch sees no GPU (pass --device cuda, or install a CUDA build of torch)")


def default_prompt_cap(engine: str, device: Device) -> int:
    """The dev tenant's max_prompt_tokens when `--max-prompt-tokens` is not given (0 = the context)."""
    return CPU_PROMPT_CAP if engine == "hf" and device.name == "cpu" else 0
