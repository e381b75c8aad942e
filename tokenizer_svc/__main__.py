"""`python -m tokenizer_svc`: parse settings, configure logging, serve until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import os
import sys

from services.logging import configure_logging
from tokenizer_svc.app import serve
from tokenizer_svc.config import load_settings


def main(argv: list[str] | None = None) -> None:
    settings = load_settings(argv)
    if settings.switch_interval_ms > 0:
        sys.setswitchinterval(settings.switch_interval_ms / 1000)
    if settings.library_threads > 0:   # read by the library when its pool starts, at the first batch
        os.environ["RAYON_NUM_THREADS"] = str(settings.library_threads)
    configure_logging(settings.log_level, settings.log_format, service="tokenizer")
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
