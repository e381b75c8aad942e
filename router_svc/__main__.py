"""`python -m router_svc`: the client-facing router."""

from __future__ import annotations

import asyncio
import sys

from services.config import parse_settings
from services.logging import configure_logging

from .app import serve
from .config import RouterSettings


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(RouterSettings, argv, prog="router_svc", env_prefix="TOKENRELAY_ROUTER_")
    configure_logging(settings.log_level, settings.log_format, service="router")
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main(sys.argv[1:])
