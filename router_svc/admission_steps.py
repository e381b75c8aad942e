"""How a request lets go of an admission it holds or has asked for: stopped, given back, settled.

Every path out of `router_svc/pipeline.py` after an admission was asked for goes through one of
these, so a lease or a queue entry is never left behind (the lease's TTL is the last resort).
"""

from __future__ import annotations

import asyncio

from services.errors import Reason, TokenrelayError
from services.logging import get_logger
from services.tasks import discard

from .ports import Admitting, Grant
from .request import RequestState

log = get_logger(__name__)

# Refusals that depend on the request's token count: asked again with the real count when the
# estimate an early admission went with was higher.
BUDGET_REFUSALS = frozenset({Reason.TOKEN_RATE_LIMITED, Reason.TOKEN_BUDGET_TOO_SMALL,
                             Reason.QUEUE_WAIT_EXCEEDS_DEADLINE})


def final_refusal(early: asyncio.Future[Admitting]) -> bool:
    """Did the early admission come back refused for a reason the real token count cannot change?"""
    if early.cancelled():
        return False
    exc = early.exception()
    return isinstance(exc, TokenrelayError) and exc.reason not in BUDGET_REFUSALS


async def abandon_early(tokenizing: asyncio.Future[None], early: asyncio.Future[Admitting] | None,
                   state: RequestState) -> None:
    """The request goes no further before its admission: stop tokenizing (a no-op once it ended),
    give back an early admission."""
    await discard(tokenizing)
    if early is not None:
        await give_back(early, state)


async def give_back(admitting: asyncio.Future[Admitting], state: RequestState) -> None:
    """An admission not wanted after all: stopped if still on its way, settled (or taken out of
    the queue) if it came back."""
    admitting.cancel()          # a no-op once it came back
    try:
        got = await asyncio.shield(admitting)
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - refused or cut off: nothing is held
        return
    await end_admission(got, state)


async def end_admission(admitting: Admitting, state: RequestState) -> None:
    """Settle the lease with the request's usage, or — never granted — leave the queue (a grant
    that raced the exit is settled at zero by `abandon`)."""
    grant: Grant | None = admitting.grant
    try:
        if grant is not None:
            await grant.settle(state.usage)
        else:
            await admitting.abandon()
    except Exception as exc:  # noqa: BLE001 - logged; the lease's TTL frees it
        log.warning("settle_failed", request_id=state.request_id, error=str(exc))
