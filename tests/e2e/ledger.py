"""One Generate stream read to its end the way the e2e ledgers count it (test_supervision.py,
test_chaos.py through it, test_admission_mesh.py): what arrived, and exactly how it ended as its
client saw it — "done", or "CODE/REASON"."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc

from services.errors import REASON_KEY

# No tokenrelay reason on a DEADLINE_EXCEEDED: the *client's* deadline fired, i.e. the request hung.
CLIENT_DEADLINE = "CLIENT_DEADLINE"
# No reason on any other status: the connection broke (its router died), which the client does see.
CONNECTION_LOST = "CONNECTION_LOST"


@dataclass
class Stream:
    """What one client saw of its stream."""

    accepted: bool = False
    first_token: bool = False
    positions: list[int] = field(default_factory=list)    # of its `accepted` messages (0: admitted at once)
    terminals: list[str] = field(default_factory=list)   # "done", or "CODE/REASON"

    def hung(self) -> bool:
        return any(t.endswith(CLIENT_DEADLINE) for t in self.terminals)


def terminal(err: grpc.aio.AioRpcError) -> str:
    reason = dict(err.trailing_metadata() or ()).get(REASON_KEY, "")
    if not reason:
        reason = CLIENT_DEADLINE if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED else CONNECTION_LOST
    return f"{err.code().name}/{reason}"


async def follow(call: Any, out: Stream) -> None:
    """Read `call` (a Generate stream) to its end into `out`."""
    try:
        async for msg in call:
            kind = msg.WhichOneof("event")
            if kind == "delta":
                out.first_token = True
            elif kind == "accepted":
                out.accepted = True
                out.positions.append(msg.accepted.queue_position)
            elif kind == "done":
                out.terminals.append("done")
    except grpc.aio.AioRpcError as err:
        how = terminal(err)
        # The connection broke after `done` but before the call's OK status (its router killed
        # between the two frames; seen once in a CI run of test_chaos's router kill): the client has
        # its whole answer, so that is not a second ending. Any status with a reason still is.
        if not (out.terminals == ["done"] and how.endswith(CONNECTION_LOST)):
            out.terminals.append(how)
