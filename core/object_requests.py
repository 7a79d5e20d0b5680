"""How many requests one object takes on a cloud store: the store clients count them so
(`comm.store_s3`, `comm.store_azure`) and the run's prediction counts them so
(`planners.store_prices.StoreOffer.object_requests`).

- S3 (boto3's transfer manager as `comm.store_s3` configures it): one PutObject below
  `S3_MULTIPART_THRESHOLD`, else CreateMultipartUpload, one UploadPart per `S3_MULTIPART_CHUNK`
  and CompleteMultipartUpload; a read is one GetObject.
- Azure Blob (the SDK as `comm.store_azure` configures it): one Put Blob up to
  `AZURE_SINGLE_PUT_BYTES`, else one Put Block per `AZURE_BLOCK_BYTES` and Put Block List; a read
  is one Get Blob for the first `AZURE_SINGLE_GET_BYTES`, then one per `AZURE_BLOCK_BYTES` range.
- Any other store: one request an object.
"""
from __future__ import annotations

S3_MULTIPART_THRESHOLD = 64 * 1024 * 1024
S3_MULTIPART_CHUNK = 16 * 1024 * 1024
AZURE_SINGLE_PUT_BYTES = 64 * 1024 * 1024
AZURE_BLOCK_BYTES = 8 * 1024 * 1024
AZURE_SINGLE_GET_BYTES = 32 * 1024 * 1024


def s3_put_requests(nbytes: int, threshold: int = S3_MULTIPART_THRESHOLD, chunk: int = S3_MULTIPART_CHUNK) -> int:
    """Requests of one S3 put of `nbytes` bytes."""
    return 1 if nbytes < threshold else 2 + -(-nbytes // chunk)


def azure_put_requests(nbytes: int, single_put_bytes: int = AZURE_SINGLE_PUT_BYTES) -> int:
    """Requests of one Azure Blob put of `nbytes` bytes."""
    return 1 if nbytes <= single_put_bytes else 1 + -(-nbytes // AZURE_BLOCK_BYTES)


def azure_get_requests(nbytes: int) -> int:
    """Requests of one Azure Blob read of `nbytes` bytes."""
    return 1 + -(-max(0, nbytes - AZURE_SINGLE_GET_BYTES) // AZURE_BLOCK_BYTES)


def object_requests(kind: str, nbytes: int) -> tuple[int, int]:
    """(put, get) requests of one object of `nbytes` bytes on a store of `kind` (`s3`, `azure`;
    any other: one each)."""
    nbytes = max(0, int(nbytes))
    if kind == "s3":
        return s3_put_requests(nbytes), 1
    if kind == "azure":
        return azure_put_requests(nbytes), azure_get_requests(nbytes)
    return 1, 1
