"""`python -m tokenizer_svc`: parse settings, configure logging, serve until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import sys

from services.logging import configure_logging, get_logger
from tokenizer_svc.app import serve
from tokenizer_svc.config import load_settings


def main(argv: list[str] | None = None) -> None:
    settings = load_settings(argv)
    if settings.switch_interval_ms > 0:
        sys.setswitchinterval(settings.switch_interval_ms / 1000)
    configure_logging(settings.telemetry.log_level, settings.telemetry.log_format, service="tokenizer")
    get_logger(__name__).info("settings", **settings.public())
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
