"""`python -m engine_svc`: token ids in, token ids streamed out."""

from __future__ import annotations

import sys

from services.config import load_settings
from services.eventloop import resolve, run
from services.logging import configure_logging, get_logger

from .app import serve
from .config import EngineSettings


def main(argv: list[str] | None = None) -> None:
    settings = load_settings(EngineSettings, argv)
    configure_logging(settings.telemetry.log_level, settings.telemetry.log_format, service="engine")
    get_logger(__name__).info("settings", event_loop_running=resolve(settings.server.event_loop), **settings.public())
    run(serve(settings), settings.server.event_loop)


if __name__ == "__main__":
    main(sys.argv[1:])
