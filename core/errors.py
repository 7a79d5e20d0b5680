"""Zooid's one error hierarchy: every error raised on purpose is a `ZooidError`; the ones a
user can fix are `ZooidValueError`s and name the parameter (a job field, or a planner input's
JSON path) in one line."""


class ZooidError(Exception):
    """Base class of every error Zooid raises on purpose."""


class ZooidValueError(ZooidError, ValueError):
    """Bad input a user can fix; the message names the parameter and what is valid."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class PlannerInputError(ZooidValueError):
    """Invalid planner input; `field` is the JSON path of the offending field."""


class StoreError(ZooidError):
    """A store operation failed (connection, permission, missing bucket)."""


class StoreTimeout(StoreError, TimeoutError):
    """A key did not appear in the store before the timeout."""


class OutOfMemory(ZooidError):
    """A worker or stage does not fit its memory; never retried, only re-planned."""


class LeaseExpired(ZooidError):
    """A warm worker's coordinator stopped renewing its lease: the worker stops itself."""
