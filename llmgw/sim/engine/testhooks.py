"""``llmgw sim-engine --sim-test-hooks``: faults a test causes on demand (off by default).

Routes added to the OpenAI server with the flag (without it they answer 404 like any
unknown path; they need no API key, as nothing outside ``/v1`` does in vLLM):

``POST /sim/kv_events/drop``, body ``{"batches": N}`` (N >= 1, default 1)
    The next N KV event batches are not sent on the PUB socket but stay in the replay
    buffer, as messages lost on the way: a subscriber sees a seq gap that a replay from
    the first missing seq fills. Answers the state below. 409 when KV events are off.

``GET /sim/kv_events``
    ``{"next_seq": S, "dropping": N, "dropped": [seq, …], "replayed_from": [seq, …]}``:
    the seq the next batch gets, the batches still to drop, the seqs dropped so far and the
    start seq of every replay request answered, oldest first (the last 1000 of each).

There is no authentication: never enable the hooks on an engine others can reach.
"""

from __future__ import annotations

from llmgw.sim.engine.errors import RequestError
from llmgw.sim.engine.http import Handler, HttpRequest, Response
from llmgw.sim.engine.kvpublisher import KvEventPublisher

__all__ = ["DROP_PATH", "STATE_PATH", "kv_event_hooks"]

DROP_PATH = "/sim/kv_events/drop"
STATE_PATH = "/sim/kv_events"


def kv_event_hooks(publisher: KvEventPublisher | None) -> dict[str, dict[str, Handler]]:
    """The hook routes for an engine whose events go through ``publisher`` (None: off)."""

    async def read(request: HttpRequest) -> Response:
        return Response.json(_state(publisher))

    async def drop(request: HttpRequest) -> Response:
        batches = request.json().get("batches", 1) if request.body else 1
        if type(batches) is not int or batches < 1:
            raise RequestError(400, f"batches must be an integer >= 1, not {batches!r}", "batches")
        _state(publisher)  # refuses when events are off
        assert publisher is not None
        publisher.drop_next(batches)
        return Response.json(_state(publisher))

    return {STATE_PATH: {"GET": read}, DROP_PATH: {"POST": drop}}


def _state(publisher: KvEventPublisher | None) -> dict[str, object]:
    if publisher is None:
        raise RequestError(409, "KV events are off: no KV event batches to drop", "kv_events")
    return {
        "next_seq": publisher.next_seq,
        "dropping": publisher.dropping,
        "dropped": list(publisher.dropped),
        "replayed_from": list(publisher.replayed_from),
    }
