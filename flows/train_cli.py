"""The `train` flow's command line: `python -m flows.train --param name=value ... [--summary-out PATH]`.

`flows.train` holds the flow and its steps; this module is what a shell adds around them:

- the Prefect API (`prefect_api`): the configured one, else a temporary server of the command's
  own, started before the flow's imports under `python -m flows.train` (`flows.train.EARLY_SERVER`)
  and stopped however the command ends;
- the signals (`CommandLine`, `COMMAND_LINE`, which the recipe consults at its boundaries): the
  first SIGTERM or Ctrl-C tears the run down, bills it, prints three lines (torn down, bill, how
  to resume) and exits 143 or 130;
- the exit status: 0 done, 1 failed, 2 bad input (one line naming the parameter, before
  anything is rented), 128 + the signal that stopped it.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import time

from blocks.store_refs import open_store_ref
from coordinator.bill.cost import read_ledger
from coordinator.report.progress import interrupted_lines
from coordinator.report.report import text_report
from coordinator.run.context import RunContext
from coordinator.run.job import RunSummary
from coordinator.run.job_fields import check_fields, fields_from_args
from coordinator.workers.sweep import worker_pids
from core.errors import ZooidValueError
from core.keys import ledger_key
from deployments.bootstrap import PAID_WORKERS, ensure_concurrency_limit
from deployments.server import TemporaryServer, drain_prefect_clients, temporary_server
from engine.optimizers import load_lazy_modules


def _quiet_console() -> None:
    """Nothing more reaches the terminal from loggers (Prefect's console handler, prints the
    flow logs) or warnings; the API's log handler still gets every line for the UI."""
    import logging
    import warnings

    loggers = [logging.getLogger()] + [lg for lg in logging.root.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    streams = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    for lg in loggers:
        for handler in lg.handlers:
            if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) in streams:
                handler.setLevel(logging.CRITICAL + 1)
    warnings.simplefilter("ignore")


class CommandLine:
    """A `python -m flows.train` run (`active`): the signal that stopped it and what its run
    left (`run`: run id, workers alive at teardown, bill, ledger), for `run_command_line`'s last lines.

    The first SIGTERM or SIGINT quiets the console, then stops the flow as before (Prefect's
    SIGTERM handler raises `TerminationSignal`, SIGINT `KeyboardInterrupt`), so the teardown
    and the bill run without a screen of crash reports; a later signal is ignored, so a second
    Ctrl-C does not cut the teardown short."""

    def __init__(self) -> None:
        self.active = False
        self.signal: int | None = None
        self.run: dict = {}
        self.cancel_checked_at = 0.0

    def reset(self, active: bool) -> None:
        self.active, self.signal, self.run = active, None, {}
        self.cancel_checked_at = time.monotonic()

    def stop(self, signum: int) -> bool:
        """Note the first stop signal and quiet the console; False for a later one."""
        if self.signal is not None:
            return False
        self.signal = signum
        _quiet_console()
        return True

    def raise_if_stopped(self) -> None:
        """Raise for a stop signal already noted. The exception the signal raised can land in
        library code that catches it: the recipe's next boundary, and the epoch's every poll,
        raise it again."""
        if self.active and self.signal is not None:
            raise KeyboardInterrupt(f"signal {self.signal}")

    def raise_if_cancelling(self, flow_run_id: str, every_s: float = 2.0) -> None:
        """At most every `every_s`: a command line's flow run that Prefect set Cancelling (its own
        SIGTERM handler does, when the signal reaches it instead of ours) stops as if the signal
        had been noted. A command line once trained on for minutes after its SIGTERM, its flow
        run Cancelling on the server."""
        now = time.monotonic()
        if not self.active or now - self.cancel_checked_at < every_s:
            return
        self.cancel_checked_at = now
        from prefect.client.orchestration import get_client

        try:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(flow_run_id).state
        except Exception:  # the API's trouble is not a stop
            return
        if state is not None and (state.is_cancelling() or state.is_cancelled()):
            self.stop(signal.SIGTERM)
            self.raise_if_stopped()

    def watch_sigterm(self):
        """Inside the flow (where Prefect's engine owns SIGTERM), on a command line: chain a
        handler that notes the signal before Prefect's raises. Returns the undo."""
        if not self.active:
            return lambda: None
        try:
            inner = signal.getsignal(signal.SIGTERM)
        except ValueError:  # not the main thread
            return lambda: None

        def on_sigterm(signum, frame):
            if not self.stop(signum):
                return
            if callable(inner):
                inner(signum, frame)
            raise KeyboardInterrupt(f"signal {signum}")

        signal.signal(signal.SIGTERM, on_sigterm)
        return lambda: signal.signal(signal.SIGTERM, inner)

    def started(self, ctx: RunContext) -> None:
        """The run the flow started: its id (the resume line), its flow run (set Cancelled)."""
        self.run = {"run_id": ctx.run_id, "flow_run_id": ctx.flow_run_id}

    def live_workers(self, ctx: RunContext) -> int:
        """Worker processes or flow runs of the run still alive, asked before its teardown."""
        try:
            return len(worker_pids(ctx.run_id)) or len(ctx.state.warm.workers if ctx.state.warm is not None else [])
        except Exception:
            return 0

    def ended(self, ctx: RunContext, workers: int, bill_usd: float) -> None:
        """What the run left for the last lines: the workers its teardown stopped, its bill, and
        where its ledger is (a path for a directory store)."""
        ref = ctx.durable_ref
        ledger_at = (f"{ref.removeprefix('file://').rstrip('/')}/{ledger_key(ctx.run_id)}" if ref.startswith("file://")
                     else f"{ref} {ledger_key(ctx.run_id)}")
        self.run.update(workers=workers, bill_usd=bill_usd, ledger_at=ledger_at)


COMMAND_LINE = CommandLine()


@contextlib.contextmanager
def prefect_api(server=None):
    """The Prefect API for a command-line run: the configured one, or a temporary server of
    our own that outlives a Ctrl-C (`deployments.server.temporary_server`, with the paid-workers
    limit a bootstrapped API has). SIGTERM and SIGINT are noted (`COMMAND_LINE`: the console
    goes quiet) and raised as KeyboardInterrupt (inside the flow, Prefect's TerminationSignal),
    so either one runs the flow's teardown and bill before exiting."""
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    def interrupt(signum, frame):
        if COMMAND_LINE.stop(signum):
            raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    previous_int = signal.signal(signal.SIGINT, interrupt)
    try:
        if PREFECT_API_URL.value():
            yield
            return

        # The temporary server lives and dies with this command: no one is left to tell a crashed
        # flow run by its heartbeats, and Prefect's heartbeat thread, which sleeps in whole
        # seconds, held the end of every command by up to 1 s (0.66 s measured) while it joined.
        with temporary_server(started=server) as url, \
                temporary_settings(updates={PREFECT_API_URL: url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            _ensure_paid_workers_limit()
            try:
                yield
            finally:  # the run's logs and events reach the server before it stops
                drain_prefect_clients()
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def _ensure_paid_workers_limit() -> None:
    """The paid-workers limit the flows take slots of, on a temporary server as on a
    bootstrapped one (else Prefect warns that it does not exist at every launch)."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            ensure_concurrency_limit(client, PAID_WORKERS)
    except Exception:  # only a warning is at stake
        pass


def run_command_line(train, argv: list[str] | None = None, *, early: TemporaryServer | None = None,
                     description: str | None = None) -> int:
    """`python -m flows.train --param name=value ... [--summary-out PATH]`, running the flow
    `train` (`flows.train.main` hands it over). The temporary Prefect server it starts (before
    the flow's imports, `early`, or for the run) is stopped however it ends."""
    import argparse

    server = None
    try:
        parser = argparse.ArgumentParser(prog="python -m flows.train", description=description)
        parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                            help="a TrainJob field, e.g. workers=4 (repeat)")
        parser.add_argument("--summary-out", metavar="PATH", help="also write the summary JSON here")
        args = parser.parse_args(argv)
        try:
            fields = fields_from_args(args.param)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        fields.setdefault("target", "inline")
        server = early_server(early)  # its start-up overlaps the job's validation
        return _validated_run(train, args, fields, server)
    finally:
        for started in (server, early):
            if started is not None:
                started.stop()  # (idempotent: a no-op once the run's own teardown stopped it)


def early_server(early: TemporaryServer | None = None):
    """The command line's temporary Prefect server when no API is configured: the one started
    before the flow's imports (`early`, under `python -m flows.train`), else one started now."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():  # configured in a Prefect profile: `run_command_line` stops the early one unused
        return None
    if early is not None and early.pid is not None:
        return early

    return TemporaryServer()


def _validated_run(train, args, fields: dict, server) -> int:
    try:
        job = check_fields(fields)  # what `make run` checks before it starts its stack
    except ZooidValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if server is not None:  # while the server boots: staging's first optimizer would load them (0.6 s)
        load_lazy_modules()
    COMMAND_LINE.reset(active=True)
    try:
        with prefect_api(server):
            try:
                summary = train(job)
            except BaseException:
                if COMMAND_LINE.signal is not None:
                    _set_cancelled(COMMAND_LINE.run.get("flow_run_id"))
                raise
    except BaseException as exc:
        if COMMAND_LINE.signal is not None or isinstance(exc, KeyboardInterrupt):
            return _interrupted(args.param)
        if isinstance(exc, ZooidValueError):  # found once measured, e.g. a stage that does not fit memory
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if not isinstance(exc, Exception):
            raise
        print(f"error: run failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
              file=sys.stderr)
        return 1
    finally:
        COMMAND_LINE.active = False
    print(text_report(summary, _ledger_of(summary)))
    if args.summary_out:
        with open(args.summary_out, "w") as fh:
            fh.write(summary.model_dump_json(indent=1))
    return 0 if summary.status != "failed" else 1


def _ledger_of(summary: RunSummary) -> dict | None:
    """The ledger the run wrote beside its summary (the report's wall time and infrastructure)."""
    try:
        store = open_store_ref(summary.store_url)
        try:
            return read_ledger(store, summary.run_id)
        finally:
            store.close()
    except Exception:  # the report without it still says what ran
        return None


def _set_cancelled(flow_run_id: str | None) -> None:
    """The flow run of a command line its user stopped ends Cancelled on the API, as one
    cancelled from the UI does (the engine records the interrupt as a crash)."""
    if not flow_run_id:
        return
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    with contextlib.suppress(Exception):  # the run's own end goes on whatever happens here
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, Cancelled(message="stopped on the command line"), force=True)


def _interrupted(params: list[str]) -> int:
    """A command-line run stopped by SIGTERM or Ctrl-C: at most three lines (what was torn
    down, the bill so far, how to resume), exit 128 + the signal (130 SIGINT, 143 SIGTERM)."""
    import shlex

    signum = COMMAND_LINE.signal or signal.SIGINT
    run = COMMAND_LINE.run
    kept = "".join(f"--param {shlex.quote(p)} " for p in params if not p.startswith("resume="))
    torn_down = {"workers": run["workers"]} if "workers" in run else None
    for line in interrupted_lines(signal.Signals(signum).name, run.get("run_id"), torn_down,
                                  run.get("bill_usd"), run.get("ledger_at"), kept):
        print(line, file=sys.stderr)
    return 128 + int(signum)
