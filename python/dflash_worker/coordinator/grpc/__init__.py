"""The coordinator's two gRPC services (`dflash.v1`) and what they share.

- `provider`: `ProviderService`, what a run-manager calls (register, lease, heartbeat, upload,
  download, finish), and `WorkSignal`, which wakes its long polls;
- `admin`: `AdminService`, what the admin CLI calls;
- `uploads`: the upload engine both use (`Artifacts`: admission, staging, verification, commit,
  resumable offsets, downloads, blob garbage collection);
- `convert`: store records to protobuf messages and back.

Authentication and the mapping of errors to status codes are the interceptor's (`auth`,
`status`), shared with the admin client.
"""

from .admin import AdminService
from .provider import ProviderService, WorkSignal
from .uploads import DEFAULT_UPLOAD_IDLE_SECONDS, Artifacts

__all__ = ["DEFAULT_UPLOAD_IDLE_SECONDS", "AdminService", "Artifacts", "ProviderService", "WorkSignal"]
