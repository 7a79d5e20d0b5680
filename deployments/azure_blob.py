"""The ACI target's store: an Azure Blob container and the `zooid-azure-blob-store` block on it.

`python -m deployments.bootstrap --target aci --blob-container NAME [--blob-prefix P]
[--blob-credentials BLOCK | --blob-account-url URL]` calls `bootstrap_blob_store`. The account
comes from a saved prefect-azure `AzureBlobStorageCredentials` block (`--blob-credentials`),
else from `AZURE_STORAGE_CONNECTION_STRING` (read, saved into a credentials block, never
printed), else from an account URL with no secret (`DefaultAzureCredential`: a managed
identity). Running it twice changes nothing the second time.
"""
from __future__ import annotations

import os

from core.errors import ZooidValueError

CREDENTIALS_BLOCK = "zooid-azure-blob"
STORE_BLOCK = "zooid-aci"


def blob_credentials(credentials_block: str | None = None, account_url: str | None = None):
    """(name of the saved credentials block, the block): the named one, else one saved from
    AZURE_STORAGE_CONNECTION_STRING, else one for `account_url`."""
    from prefect_azure.credentials import AzureBlobStorageCredentials

    if credentials_block:
        return credentials_block, AzureBlobStorageCredentials.load(credentials_block)
    connection_string = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    if connection_string:
        block = AzureBlobStorageCredentials(connection_string=connection_string)
    elif account_url:
        block = AzureBlobStorageCredentials(account_url=account_url)
    else:
        raise ZooidValueError("blob_container", "needs a storage account: --blob-credentials BLOCK, "
                              "--blob-account-url URL or AZURE_STORAGE_CONNECTION_STRING")
    block.save(CREDENTIALS_BLOCK, overwrite=True)
    return CREDENTIALS_BLOCK, block


def bootstrap_blob_store(container: str, *, prefix: str = "zooid", credentials_block: str | None = None,
                         account_url: str | None = None, name: str = STORE_BLOCK) -> dict:
    """Create `container` (if absent) and save the store block `name` on it; return what was
    done, no secret: the block is what a job names as its `store`."""
    from blocks.store_block_azure import ZooidAzureBlobStore  # prefect-azure, Azure SDK: only for a blob store

    creds_name, creds = blob_credentials(credentials_block, account_url)
    block = ZooidAzureBlobStore(credentials=creds, container=container, prefix=prefix)
    with block.open() as store:
        created = store.create_container()
    block.save(name, overwrite=True)
    return {"azure_blob_store": f"{block.get_block_type_slug()}/{name}", "url": block.url(),
            "container_created": created, "credentials_block": creds_name}
