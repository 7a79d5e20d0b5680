"""Zooid's one error hierarchy: every error raised on purpose is a `ZooidError`; the ones a
user can fix are `ZooidValueError`s and name the parameter (a job field, or a planner input's
JSON path) in one line."""


class ZooidError(Exception):
    """Base class of every error Zooid raises on purpose.

    Pickles whatever a subclass's `__init__` takes (Prefect may persist a failed task's
    exception): it is rebuilt from its `args` and attributes without calling `__init__`."""

    def __reduce__(self):
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type, args: tuple, state: dict) -> "ZooidError":
    """A pickled `ZooidError` back, as it was, without running its class's `__init__`."""
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


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


class DataError(ZooidError):
    """The job's data cannot be read as the store holds it (a dataset shard missing or corrupt
    after its reads): another attempt would read the same bytes, so it is never retried."""


class LeaseExpired(ZooidError):
    """A warm worker's coordinator stopped renewing its lease: the worker stops itself."""


class Preempted(ZooidError):
    """A worker got the provider's notice (SIGTERM before the stop) and left at a step
    boundary, after handing over what its protocol allows (`engine.preemption`); retried on
    new capacity, never counted as a crash."""
