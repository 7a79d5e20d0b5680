"""The stack's Prefect server retries SQLite's lock conflicts itself (`deployments.prefect_api`):
a request the app turns away with 503 runs again, body and all, and only the last answer goes out."""
from __future__ import annotations

import asyncio

from deployments.prefect_api import RetryLocked


class LockedApp:
    """An ASGI app that answers 503 `locked` times (raising afterwards, as Starlette's error
    middleware does), then echoes the body it read with 200, in two chunks; it writes into the
    scope it is given, as a router does."""

    def __init__(self, locked: int):
        self.locked, self.calls, self.scopes = locked, 0, []

    async def __call__(self, scope, receive, send):
        self.calls += 1
        self.scopes.append(dict(scope))
        scope["root_path"] = scope.get("root_path", "") + "/api"
        body = (await receive())["body"]
        if self.calls <= self.locked:
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": b"Service Unavailable"})
            raise RuntimeError("database is locked")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body[:3], "more_body": True})
        await send({"type": "http.response.body", "body": body[3:]})


def _request(app, body: bytes, chunk: int = 4) -> tuple[list[dict], BaseException | None]:
    """Send one POST with `body` in chunks of `chunk` bytes through `app`: the messages sent back
    and what it raised (None)."""
    parts = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    incoming = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    sent = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/api/flow_runs/", "root_path": "", "headers": []}
    try:
        asyncio.run(app(scope, receive, send))
    except Exception as exc:
        return sent, exc
    return sent, None


def test_a_request_the_lock_turned_away_is_answered_by_a_later_attempt_with_its_whole_body():
    inner = LockedApp(locked=2)
    app = RetryLocked(inner, delays=(0.0, 0.0, 0.0))
    sent, error = _request(app, b"the request's body")
    assert error is None
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200]
    assert b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body") == b"the request's body"
    assert inner.calls == 3 and app.retried == 2
    assert all(s["root_path"] == "" for s in inner.scopes)  # every attempt routed from the original scope


def test_a_lock_that_outlasts_every_retry_reaches_the_client_as_503():
    inner = LockedApp(locked=10)
    app = RetryLocked(inner, delays=(0.0, 0.0))
    sent, error = _request(app, b"x")
    assert inner.calls == 3 and app.retried == 2
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [503]
    assert isinstance(error, RuntimeError)  # on to the server's log, as without the retries


def test_other_answers_and_other_protocols_pass_through_once():
    inner = LockedApp(locked=0)
    app = RetryLocked(inner, delays=(0.0,))
    sent, error = _request(app, b"hello world")
    assert error is None and inner.calls == 1 and app.retried == 0
    assert [m.get("more_body", False) for m in sent if m["type"] == "http.response.body"] == [True, False]
    seen = []

    async def other(scope, receive, send):
        seen.append(scope["type"])

    asyncio.run(RetryLocked(other)({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"]
