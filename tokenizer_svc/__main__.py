"""`python -m tokenizer_svc`: parse settings, configure logging, serve until SIGTERM/SIGINT."""

from __future__ import annotations

import sys

from services.eventloop import resolve, run
from services.logging import configure_logging, get_logger
from tokenizer_svc.app import serve
from tokenizer_svc.config import load_settings


def main(argv: list[str] | None = None) -> None:
    settings = load_settings(argv)
    if settings.switch_interval_ms > 0:
        sys.setswitchinterval(settings.switch_interval_ms / 1000)
    configure_logging(settings.telemetry.log_level, settings.telemetry.log_format, service="tokenizer")
    get_logger(__name__).info("settings", event_loop_running=resolve(settings.server.event_loop), **settings.public())
    run(serve(settings), settings.server.event_loop)


if __name__ == "__main__":
    main()
