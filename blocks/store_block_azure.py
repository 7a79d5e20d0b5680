"""`ZooidAzureBlobStore`: a container (and a key prefix) in an Azure storage account, as a
`StoreBlock` (`blocks.store_block`: `url()`, `open()`, `worker_environment()`, `ref()`).

It wraps prefect-azure's `AzureBlobStorageCredentials` block: a connection string (secret),
or an account URL with a service principal (secret) or with no secret at all
(`DefaultAzureCredential`: an ACI managed identity). `open()` hands them to the blob client
as arguments; nothing of them goes into `os.environ`, a URL or a log line. Workers receive
`block:zooid-azure-blob-store/<name>` and load the block themselves.
"""
from __future__ import annotations

from prefect_azure.credentials import AzureBlobStorageCredentials
from pydantic import Field

from blocks.store_block import StoreBlock
from comm.store import open_store
from core.errors import ZooidValueError


class ZooidAzureBlobStore(StoreBlock):
    """Tensors, subsets, checkpoints and ledgers in an Azure Blob Storage container."""

    _block_type_name = "Zooid Azure Blob Store"
    _block_type_slug = "zooid-azure-blob-store"
    _description = "An Azure Blob Storage container (with its prefect-azure credentials block) and a key prefix."

    credentials: AzureBlobStorageCredentials = Field(
        ..., title="Azure Blob Storage credentials",
        description="A prefect-azure credentials block: a connection string, or an account URL "
                    "(service principal or managed identity).")
    container: str = Field(..., title="Container", description="The blob container (3-63 lowercase letters, digits, -).")
    prefix: str = Field("zooid", title="Key prefix", description="Every key lives below this prefix.")

    def url(self) -> str:
        """`az://container/prefix`, with `?account_url=` when the block names an account URL; no secret."""
        account_url = self.credentials.account_url if self.credentials.connection_string is None else None
        query = f"?account_url={account_url}" if account_url else ""
        return f"az://{self.container}/{self.prefix.strip('/')}{query}"

    def _account(self) -> dict:
        """The client arguments of the credentials block (secrets included: never log this)."""
        creds = self.credentials
        if creds.connection_string is not None:
            return {"connection_string": creds.connection_string.get_secret_value()}
        if creds.client_secret is not None:
            from azure.identity import ClientSecretCredential

            return {"credential": ClientSecretCredential(
                tenant_id=creds.tenant_id, client_id=creds.client_id,
                client_secret=creds.client_secret.get_secret_value())}
        if not creds.account_url:
            raise ZooidValueError("store", "the Azure Blob Storage credentials block has neither a connection "
                                  "string nor an account URL")
        return {}  # the account URL with DefaultAzureCredential (a managed identity)

    def open(self):
        """Open the store in this process, the block's credentials handed to the client."""
        return open_store(self.url(), azure_account=self._account())
