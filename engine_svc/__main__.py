"""`python -m engine_svc`: token ids in, token ids streamed out."""

from __future__ import annotations

import asyncio
import sys

from services.config import parse_settings
from services.logging import configure_logging

from .app import serve
from .config import EngineSettings


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(EngineSettings, argv, prog="engine_svc", env_prefix="TOKENRELAY_ENGINE_")
    configure_logging(settings.log_level, settings.log_format, service="engine")
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main(sys.argv[1:])
