"""Artifact bytes on the coordinator: what an upload claims, where it waits, where it is kept, when it is served.

- `names`: artifact names and the checks on every field an upload claims (`Claim`), the
  record a commit writes (`ArtifactRecord`), checkpoint manifests;
- `staging`: the upload staging area on the coordinator's disk (reservations, free space, sweeps);
- `blobs`: the content-addressed blob store (a directory or S3) verified uploads are committed to;
- `directio`: streamed file writes and reads that bypass the page cache (`O_DIRECT`) where they can;
- `publish`: the regression gate, which decides whether a job's export is served.

`publish` reads the store, and the store imports `names` and `staging`, so `publish` is not
re-exported here (importing the package must not import the store).
"""

from .blobs import BlobStore, LocalBlobStore, open_blob_store
from .names import CHUNK_BYTES, ArtifactRecord, Claim, check_name
from .staging import NOTHING_STAGED, Staged, Staging

__all__ = [
    "CHUNK_BYTES",
    "NOTHING_STAGED",
    "ArtifactRecord",
    "BlobStore",
    "Claim",
    "LocalBlobStore",
    "Staged",
    "Staging",
    "check_name",
    "open_blob_store",
]
