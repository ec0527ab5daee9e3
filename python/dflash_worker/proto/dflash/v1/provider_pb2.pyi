from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LaunchMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LAUNCH_MODE_UNSPECIFIED: _ClassVar[LaunchMode]
    LAUNCH_MODE_DOCKER: _ClassVar[LaunchMode]
    LAUNCH_MODE_NATIVE: _ClassVar[LaunchMode]

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_STARTING: _ClassVar[Phase]
    PHASE_PREPARE: _ClassVar[Phase]
    PHASE_CHECK: _ClassVar[Phase]
    PHASE_CAPTURE: _ClassVar[Phase]
    PHASE_TRAIN: _ClassVar[Phase]
    PHASE_EXPORT: _ClassVar[Phase]
    PHASE_EVALUATE: _ClassVar[Phase]
    PHASE_FINISHING: _ClassVar[Phase]

class Directive(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIRECTIVE_UNSPECIFIED: _ClassVar[Directive]
    DIRECTIVE_CONTINUE: _ClassVar[Directive]
    DIRECTIVE_CANCEL: _ClassVar[Directive]
    DIRECTIVE_CHECKPOINT_NOW: _ClassVar[Directive]

class AttemptOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ATTEMPT_OUTCOME_UNSPECIFIED: _ClassVar[AttemptOutcome]
    ATTEMPT_OUTCOME_SUCCEEDED: _ClassVar[AttemptOutcome]
    ATTEMPT_OUTCOME_FAILED: _ClassVar[AttemptOutcome]
    ATTEMPT_OUTCOME_CANCELLED: _ClassVar[AttemptOutcome]
    ATTEMPT_OUTCOME_RETRYABLE: _ClassVar[AttemptOutcome]
LAUNCH_MODE_UNSPECIFIED: LaunchMode
LAUNCH_MODE_DOCKER: LaunchMode
LAUNCH_MODE_NATIVE: LaunchMode
PHASE_UNSPECIFIED: Phase
PHASE_STARTING: Phase
PHASE_PREPARE: Phase
PHASE_CHECK: Phase
PHASE_CAPTURE: Phase
PHASE_TRAIN: Phase
PHASE_EXPORT: Phase
PHASE_EVALUATE: Phase
PHASE_FINISHING: Phase
DIRECTIVE_UNSPECIFIED: Directive
DIRECTIVE_CONTINUE: Directive
DIRECTIVE_CANCEL: Directive
DIRECTIVE_CHECKPOINT_NOW: Directive
ATTEMPT_OUTCOME_UNSPECIFIED: AttemptOutcome
ATTEMPT_OUTCOME_SUCCEEDED: AttemptOutcome
ATTEMPT_OUTCOME_FAILED: AttemptOutcome
ATTEMPT_OUTCOME_CANCELLED: AttemptOutcome
ATTEMPT_OUTCOME_RETRYABLE: AttemptOutcome

class DeviceCapabilities(_message.Message):
    __slots__ = ("backend", "device_count", "memory_bytes", "supports_bf16", "features", "platform")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_BF16_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    backend: str
    device_count: int
    memory_bytes: int
    supports_bf16: bool
    features: _containers.RepeatedScalarFieldContainer[str]
    platform: str
    def __init__(self, backend: _Optional[str] = ..., device_count: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., supports_bf16: _Optional[bool] = ..., features: _Optional[_Iterable[str]] = ..., platform: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("client_version", "protocol_version", "launch_mode", "capabilities", "name", "native_client_version")
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_MODE_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NATIVE_CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    client_version: str
    protocol_version: str
    launch_mode: LaunchMode
    capabilities: DeviceCapabilities
    name: str
    native_client_version: str
    def __init__(self, client_version: _Optional[str] = ..., protocol_version: _Optional[str] = ..., launch_mode: _Optional[_Union[LaunchMode, str]] = ..., capabilities: _Optional[_Union[DeviceCapabilities, _Mapping]] = ..., name: _Optional[str] = ..., native_client_version: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("provider_id", "lease_ttl_seconds", "heartbeat_interval_seconds")
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    provider_id: str
    lease_ttl_seconds: int
    heartbeat_interval_seconds: int
    def __init__(self, provider_id: _Optional[str] = ..., lease_ttl_seconds: _Optional[int] = ..., heartbeat_interval_seconds: _Optional[int] = ...) -> None: ...

class AcquireLeaseRequest(_message.Message):
    __slots__ = ("provider_id", "wait_seconds")
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    provider_id: str
    wait_seconds: int
    def __init__(self, provider_id: _Optional[str] = ..., wait_seconds: _Optional[int] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "run_id", "job_id", "attempt", "spec_json", "ttl_seconds", "resume_checkpoint", "checkpoint_policy", "local_ranks", "required_features", "required_client_version", "image", "kind", "shard_index", "shard_count", "inputs")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_POLICY_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FEATURES_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    run_id: str
    job_id: str
    attempt: int
    spec_json: str
    ttl_seconds: int
    resume_checkpoint: Artifact
    checkpoint_policy: str
    local_ranks: int
    required_features: _containers.RepeatedScalarFieldContainer[str]
    required_client_version: str
    image: str
    kind: str
    shard_index: int
    shard_count: int
    inputs: _containers.RepeatedCompositeFieldContainer[Artifact]
    def __init__(self, lease_id: _Optional[str] = ..., run_id: _Optional[str] = ..., job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., spec_json: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., resume_checkpoint: _Optional[_Union[Artifact, _Mapping]] = ..., checkpoint_policy: _Optional[str] = ..., local_ranks: _Optional[int] = ..., required_features: _Optional[_Iterable[str]] = ..., required_client_version: _Optional[str] = ..., image: _Optional[str] = ..., kind: _Optional[str] = ..., shard_index: _Optional[int] = ..., shard_count: _Optional[int] = ..., inputs: _Optional[_Iterable[_Union[Artifact, _Mapping]]] = ...) -> None: ...

class NoWork(_message.Message):
    __slots__ = ("retry_after_seconds",)
    RETRY_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    retry_after_seconds: int
    def __init__(self, retry_after_seconds: _Optional[int] = ...) -> None: ...

class UpgradeRequired(_message.Message):
    __slots__ = ("required_client_version", "message")
    REQUIRED_CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    required_client_version: str
    message: str
    def __init__(self, required_client_version: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class AcquireLeaseResponse(_message.Message):
    __slots__ = ("lease", "no_work", "upgrade_required")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    NO_WORK_FIELD_NUMBER: _ClassVar[int]
    UPGRADE_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    no_work: NoWork
    upgrade_required: UpgradeRequired
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., no_work: _Optional[_Union[NoWork, _Mapping]] = ..., upgrade_required: _Optional[_Union[UpgradeRequired, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("lease_id", "phase", "step", "total_steps", "metrics", "committed_step")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    phase: Phase
    step: int
    total_steps: int
    metrics: _containers.ScalarMap[str, float]
    committed_step: int
    def __init__(self, lease_id: _Optional[str] = ..., phase: _Optional[_Union[Phase, str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., committed_step: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("directive", "lease_expires_unix")
    DIRECTIVE_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    directive: Directive
    lease_expires_unix: int
    def __init__(self, directive: _Optional[_Union[Directive, str]] = ..., lease_expires_unix: _Optional[int] = ...) -> None: ...

class Artifact(_message.Message):
    __slots__ = ("name", "kind", "sha256", "size_bytes", "uri", "step")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    sha256: str
    size_bytes: int
    uri: str
    step: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ..., uri: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class UploadHeader(_message.Message):
    __slots__ = ("lease_id", "artifact", "offset")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    artifact: Artifact
    offset: int
    def __init__(self, lease_id: _Optional[str] = ..., artifact: _Optional[_Union[Artifact, _Mapping]] = ..., offset: _Optional[int] = ...) -> None: ...

class UploadArtifactRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UploadHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[UploadHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class UploadArtifactResponse(_message.Message):
    __slots__ = ("artifact",)
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    artifact: Artifact
    def __init__(self, artifact: _Optional[_Union[Artifact, _Mapping]] = ...) -> None: ...

class UploadOffsetRequest(_message.Message):
    __slots__ = ("lease_id", "artifact")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    artifact: Artifact
    def __init__(self, lease_id: _Optional[str] = ..., artifact: _Optional[_Union[Artifact, _Mapping]] = ...) -> None: ...

class UploadOffsetResponse(_message.Message):
    __slots__ = ("offset", "committed")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    offset: int
    committed: bool
    def __init__(self, offset: _Optional[int] = ..., committed: _Optional[bool] = ...) -> None: ...

class DownloadArtifactRequest(_message.Message):
    __slots__ = ("lease_id", "name", "sha256", "offset")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    name: str
    sha256: str
    offset: int
    def __init__(self, lease_id: _Optional[str] = ..., name: _Optional[str] = ..., sha256: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class DownloadArtifactResponse(_message.Message):
    __slots__ = ("artifact", "chunk")
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    artifact: Artifact
    chunk: bytes
    def __init__(self, artifact: _Optional[_Union[Artifact, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class FinishAttemptRequest(_message.Message):
    __slots__ = ("lease_id", "outcome", "message")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    outcome: AttemptOutcome
    message: str
    def __init__(self, lease_id: _Optional[str] = ..., outcome: _Optional[_Union[AttemptOutcome, str]] = ..., message: _Optional[str] = ...) -> None: ...

class FinishAttemptResponse(_message.Message):
    __slots__ = ("job_state",)
    JOB_STATE_FIELD_NUMBER: _ClassVar[int]
    job_state: str
    def __init__(self, job_state: _Optional[str] = ...) -> None: ...
