"""The Prefect server every Zooid server runs (the stack's, the command line's temporary one):
Prefect's own app (`prefect.server.api.server.create_app`, as `prefect server start` serves it in
the foreground), with SQLite's lock conflicts retried inside the server.

On SQLite, a write that meets another connection's write fails at once with "database is
locked" (a transaction that read before it wrote cannot wait for the lock), and Prefect answers
503 so that the client retries. Its client waits 2 s before the first retry (then 4 s, 8 s...),
while the lock it met is held for milliseconds. On the local stack that wait landed on the
critical path of most runs: a flow run's or a worker's start, a concurrency slot, a task run.
So the server tries such a request again itself (`RetryLocked`: after 20 ms, then longer, for
about 2 s in all) before the 503 reaches the client, which then backs off as before. A retried
request is one the client would have sent again: the failed transaction was rolled back.

    python -m deployments.prefect_api --host 127.0.0.1 --port 4200
"""
from __future__ import annotations

import argparse
import asyncio

RETRY_DELAYS_S = (0.02, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8)
"""Pauses before each retry of a request the database's lock turned away (2.2 s in all)."""


class RetryLocked:
    """ASGI middleware: an HTTP request the app answers 503 (Prefect's "try again": the database
    was locked) is run again after each of `delays`, its body replayed; the last answer goes out,
    whatever it is. Any other answer goes out as it comes, streamed."""

    def __init__(self, app, delays: tuple[float, ...] = RETRY_DELAYS_S):
        self.app, self.delays = app, delays
        self.retried = 0
        """Requests run again (all attempts after the first), for tests and logs."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body arrived
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        for delay in (*self.delays, None):
            if not await self._attempt(scope, body, receive, send, last=delay is None):
                return
            self.retried += 1
            await asyncio.sleep(delay)

    async def _attempt(self, scope, body: bytes, receive, send, last: bool) -> bool:
        """Run the request once; True when it was answered 503 and nothing was sent (retry)."""
        given, turned_away = False, False

        async def replay():
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect, when it comes

        async def forward(message) -> None:
            nonlocal turned_away
            if message["type"] == "http.response.start" and message["status"] == 503 and not last:
                turned_away = True
            if not turned_away:
                await send(message)

        try:
            await self.app(dict(scope), replay, forward)  # routing writes into the scope it is given
        except Exception:
            # Starlette's error middleware sends its answer (here the 503), then raises the
            # exception again for the server's log
            if not turned_away:
                raise
        return turned_away


def create_app():
    """Prefect's server app, as `prefect server start` serves it (API, UI, services), behind
    `RetryLocked`."""
    from prefect.server.api.server import create_app as prefect_app

    return RetryLocked(prefect_app(final=True, webserver_only=False))


def main(argv: list[str] | None = None) -> int:
    import prefect
    import uvicorn
    from prefect.settings import (PREFECT_SERVER_API_KEEPALIVE_TIMEOUT, PREFECT_SERVER_API_WEBSOCKET_PING_INTERVAL,
                                  PREFECT_SERVER_API_WEBSOCKET_PING_TIMEOUT, PREFECT_SERVER_LOGGING_LEVEL)

    parser = argparse.ArgumentParser(prog="python -m deployments.prefect_api", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    uvicorn.run(app=create_app(), app_dir=str(prefect.__module_path__.parent), host=args.host, port=args.port,
                timeout_keep_alive=PREFECT_SERVER_API_KEEPALIVE_TIMEOUT.value(),
                ws_ping_interval=PREFECT_SERVER_API_WEBSOCKET_PING_INTERVAL.value(),
                ws_ping_timeout=PREFECT_SERVER_API_WEBSOCKET_PING_TIMEOUT.value(),
                log_level=PREFECT_SERVER_LOGGING_LEVEL.value().lower())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
