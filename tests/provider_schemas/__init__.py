"""Fake cloud answers held to the providers' own SDK schemas.

The cloud tests answer ECS, ACI and Kubernetes calls with recorded documents. Each fake passes
every answer (and, where the SDK validates requests, every request) through the checker of
its provider before the code under test sees it, so a field the provider would never send,
a value of the wrong type or a missing required member fails the test instead of shaping it:

- `ecs`: botocore's service model for ECS (shipped inside botocore);
- `aci`: the Azure SDK's models (`azure.mgmt.containerinstance.models`, and
  `azure.mgmt.resource`'s for the ARM deployment the ACI worker creates);
- `k8s`: the kubernetes client's models (`kubernetes.client.models`).

The SDKs themselves read answers leniently (botocore and the Azure SDK drop members they do
not know; the kubernetes client turns a string into whatever a field's type accepts), so each
checker walks the document over the SDK's schema itself, then hands it to the SDK's own reader.
"""
from __future__ import annotations


class SchemaError(AssertionError):
    """A fake's document that the provider's SDK schema refuses; the message lists every path."""

    def __init__(self, what: str, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"{what} does not match the provider's schema: " + "; ".join(self.problems))


def raise_on(what: str, problems: list[str]) -> None:
    """Raise a `SchemaError` for `what` when `problems` is not empty."""
    if problems:
        raise SchemaError(what, problems)
