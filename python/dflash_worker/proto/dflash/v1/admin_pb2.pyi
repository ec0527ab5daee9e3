from dflash_worker.proto.dflash.v1 import provider_pb2 as _provider_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunSpec(_message.Message):
    __slots__ = ("name", "spec_json", "required_client_version", "checkpoint_policy", "max_local_ranks", "required_features", "image", "num_jobs", "capture_shards", "eval_shards")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FEATURES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_JOBS_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_SHARDS_FIELD_NUMBER: _ClassVar[int]
    EVAL_SHARDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    spec_json: str
    required_client_version: str
    checkpoint_policy: str
    max_local_ranks: int
    required_features: _containers.RepeatedScalarFieldContainer[str]
    image: str
    num_jobs: int
    capture_shards: int
    eval_shards: int
    def __init__(self, name: _Optional[str] = ..., spec_json: _Optional[str] = ..., required_client_version: _Optional[str] = ..., checkpoint_policy: _Optional[str] = ..., max_local_ranks: _Optional[int] = ..., required_features: _Optional[_Iterable[str]] = ..., image: _Optional[str] = ..., num_jobs: _Optional[int] = ..., capture_shards: _Optional[int] = ..., eval_shards: _Optional[int] = ...) -> None: ...

class Run(_message.Message):
    __slots__ = ("run_id", "spec", "approved_native_versions", "created_unix", "job_states", "failure")
    class JobStatesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    APPROVED_NATIVE_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    JOB_STATES_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    spec: RunSpec
    approved_native_versions: _containers.RepeatedScalarFieldContainer[str]
    created_unix: int
    job_states: _containers.ScalarMap[str, int]
    failure: str
    def __init__(self, run_id: _Optional[str] = ..., spec: _Optional[_Union[RunSpec, _Mapping]] = ..., approved_native_versions: _Optional[_Iterable[str]] = ..., created_unix: _Optional[int] = ..., job_states: _Optional[_Mapping[str, int]] = ..., failure: _Optional[str] = ...) -> None: ...

class CreateRunRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: RunSpec
    def __init__(self, spec: _Optional[_Union[RunSpec, _Mapping]] = ...) -> None: ...

class CreateRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs", "next_page_token")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[Run]
    next_page_token: str
    def __init__(self, runs: _Optional[_Iterable[_Union[Run, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id", "page_size", "page_token")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    page_size: int
    page_token: str
    def __init__(self, run_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("job_id", "state", "attempts", "artifact_count", "export", "publication", "kind", "shard_index", "shard_count", "needs", "waiting_for", "reason", "waiting_reason", "provenance")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_COUNT_FIELD_NUMBER: _ClassVar[int]
    EXPORT_FIELD_NUMBER: _ClassVar[int]
    PUBLICATION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    NEEDS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WAITING_REASON_FIELD_NUMBER: _ClassVar[int]
    PROVENANCE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: str
    attempts: int
    artifact_count: int
    export: _provider_pb2.Artifact
    publication: Publication
    kind: str
    shard_index: int
    shard_count: int
    needs: _containers.RepeatedScalarFieldContainer[str]
    waiting_for: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    waiting_reason: str
    provenance: _containers.RepeatedCompositeFieldContainer[InputSource]
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[str] = ..., attempts: _Optional[int] = ..., artifact_count: _Optional[int] = ..., export: _Optional[_Union[_provider_pb2.Artifact, _Mapping]] = ..., publication: _Optional[_Union[Publication, _Mapping]] = ..., kind: _Optional[str] = ..., shard_index: _Optional[int] = ..., shard_count: _Optional[int] = ..., needs: _Optional[_Iterable[str]] = ..., waiting_for: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ..., waiting_reason: _Optional[str] = ..., provenance: _Optional[_Iterable[_Union[InputSource, _Mapping]]] = ...) -> None: ...

class InputSource(_message.Message):
    __slots__ = ("role", "job_id", "attempt", "attempt_id", "provider_id", "provider", "attempt_state", "artifacts", "depth")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_STATE_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    role: str
    job_id: str
    attempt: int
    attempt_id: str
    provider_id: str
    provider: str
    attempt_state: str
    artifacts: int
    depth: int
    def __init__(self, role: _Optional[str] = ..., job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., attempt_id: _Optional[str] = ..., provider_id: _Optional[str] = ..., provider: _Optional[str] = ..., attempt_state: _Optional[str] = ..., artifacts: _Optional[int] = ..., depth: _Optional[int] = ...) -> None: ...

class Publication(_message.Message):
    __slots__ = ("published", "verdict", "reason", "decided_unix", "override_unix", "override_note", "override_peer", "tau_released", "tau_trained", "split", "tolerance")
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DECIDED_UNIX_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_UNIX_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_NOTE_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_PEER_FIELD_NUMBER: _ClassVar[int]
    TAU_RELEASED_FIELD_NUMBER: _ClassVar[int]
    TAU_TRAINED_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    published: bool
    verdict: str
    reason: str
    decided_unix: int
    override_unix: int
    override_note: str
    override_peer: str
    tau_released: float
    tau_trained: float
    split: str
    tolerance: float
    def __init__(self, published: _Optional[bool] = ..., verdict: _Optional[str] = ..., reason: _Optional[str] = ..., decided_unix: _Optional[int] = ..., override_unix: _Optional[int] = ..., override_note: _Optional[str] = ..., override_peer: _Optional[str] = ..., tau_released: _Optional[float] = ..., tau_trained: _Optional[float] = ..., split: _Optional[str] = ..., tolerance: _Optional[float] = ...) -> None: ...

class GetRunResponse(_message.Message):
    __slots__ = ("run", "jobs", "next_page_token")
    RUN_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    jobs: _containers.RepeatedCompositeFieldContainer[JobInfo]
    next_page_token: str
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ..., jobs: _Optional[_Iterable[_Union[JobInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ListArtifactsRequest(_message.Message):
    __slots__ = ("run_id", "job_id", "all_attempts", "page_size", "page_token")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ALL_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    job_id: str
    all_attempts: bool
    page_size: int
    page_token: str
    def __init__(self, run_id: _Optional[str] = ..., job_id: _Optional[str] = ..., all_attempts: _Optional[bool] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ArtifactInfo(_message.Message):
    __slots__ = ("job_id", "attempt", "attempt_state", "artifact", "created_unix")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_STATE_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    attempt: int
    attempt_state: str
    artifact: _provider_pb2.Artifact
    created_unix: int
    def __init__(self, job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., attempt_state: _Optional[str] = ..., artifact: _Optional[_Union[_provider_pb2.Artifact, _Mapping]] = ..., created_unix: _Optional[int] = ...) -> None: ...

class ListArtifactsResponse(_message.Message):
    __slots__ = ("artifacts", "next_page_token")
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    artifacts: _containers.RepeatedCompositeFieldContainer[ArtifactInfo]
    next_page_token: str
    def __init__(self, artifacts: _Optional[_Iterable[_Union[ArtifactInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class AdminDownloadRequest(_message.Message):
    __slots__ = ("run_id", "job_id", "name", "sha256", "offset")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    job_id: str
    name: str
    sha256: str
    offset: int
    def __init__(self, run_id: _Optional[str] = ..., job_id: _Optional[str] = ..., name: _Optional[str] = ..., sha256: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class PublishRunRequest(_message.Message):
    __slots__ = ("run_id", "job_id", "override", "note")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    job_id: str
    override: bool
    note: str
    def __init__(self, run_id: _Optional[str] = ..., job_id: _Optional[str] = ..., override: _Optional[bool] = ..., note: _Optional[str] = ...) -> None: ...

class PublishRunResponse(_message.Message):
    __slots__ = ("job_id", "publication")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLICATION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    publication: Publication
    def __init__(self, job_id: _Optional[str] = ..., publication: _Optional[_Union[Publication, _Mapping]] = ...) -> None: ...

class ApproveVersionRequest(_message.Message):
    __slots__ = ("run_id", "version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: str
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class ApproveVersionResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class CreateProviderRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class CreateProviderResponse(_message.Message):
    __slots__ = ("token", "provider_id")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    token: str
    provider_id: str
    def __init__(self, token: _Optional[str] = ..., provider_id: _Optional[str] = ...) -> None: ...

class ProviderInfo(_message.Message):
    __slots__ = ("provider_id", "name", "client_version", "launch_mode", "capabilities", "last_seen_unix", "identity", "revoked_unix", "quarantined_unix", "quarantine_reason", "last_unquarantine")
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_MODE_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    REVOKED_UNIX_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_UNIX_FIELD_NUMBER: _ClassVar[int]
    QUARANTINE_REASON_FIELD_NUMBER: _ClassVar[int]
    LAST_UNQUARANTINE_FIELD_NUMBER: _ClassVar[int]
    provider_id: str
    name: str
    client_version: str
    launch_mode: _provider_pb2.LaunchMode
    capabilities: _provider_pb2.DeviceCapabilities
    last_seen_unix: int
    identity: str
    revoked_unix: int
    quarantined_unix: int
    quarantine_reason: str
    last_unquarantine: AuditRecord
    def __init__(self, provider_id: _Optional[str] = ..., name: _Optional[str] = ..., client_version: _Optional[str] = ..., launch_mode: _Optional[_Union[_provider_pb2.LaunchMode, str]] = ..., capabilities: _Optional[_Union[_provider_pb2.DeviceCapabilities, _Mapping]] = ..., last_seen_unix: _Optional[int] = ..., identity: _Optional[str] = ..., revoked_unix: _Optional[int] = ..., quarantined_unix: _Optional[int] = ..., quarantine_reason: _Optional[str] = ..., last_unquarantine: _Optional[_Union[AuditRecord, _Mapping]] = ...) -> None: ...

class AuditRecord(_message.Message):
    __slots__ = ("created_unix", "action", "provider_id", "reason", "peer", "detail")
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    created_unix: int
    action: str
    provider_id: str
    reason: str
    peer: str
    detail: str
    def __init__(self, created_unix: _Optional[int] = ..., action: _Optional[str] = ..., provider_id: _Optional[str] = ..., reason: _Optional[str] = ..., peer: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class UnquarantineProviderRequest(_message.Message):
    __slots__ = ("provider_id", "reason")
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    provider_id: str
    reason: str
    def __init__(self, provider_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class UnquarantineProviderResponse(_message.Message):
    __slots__ = ("provider", "audit")
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    AUDIT_FIELD_NUMBER: _ClassVar[int]
    provider: ProviderInfo
    audit: AuditRecord
    def __init__(self, provider: _Optional[_Union[ProviderInfo, _Mapping]] = ..., audit: _Optional[_Union[AuditRecord, _Mapping]] = ...) -> None: ...

class ListProvidersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListProvidersResponse(_message.Message):
    __slots__ = ("providers",)
    PROVIDERS_FIELD_NUMBER: _ClassVar[int]
    providers: _containers.RepeatedCompositeFieldContainer[ProviderInfo]
    def __init__(self, providers: _Optional[_Iterable[_Union[ProviderInfo, _Mapping]]] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CancelJobResponse(_message.Message):
    __slots__ = ("job_state",)
    JOB_STATE_FIELD_NUMBER: _ClassVar[int]
    job_state: str
    def __init__(self, job_state: _Optional[str] = ...) -> None: ...

class RequestCheckpointRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class RequestCheckpointResponse(_message.Message):
    __slots__ = ("job_state",)
    JOB_STATE_FIELD_NUMBER: _ClassVar[int]
    job_state: str
    def __init__(self, job_state: _Optional[str] = ...) -> None: ...

class RevokeProviderRequest(_message.Message):
    __slots__ = ("provider_id",)
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    provider_id: str
    def __init__(self, provider_id: _Optional[str] = ...) -> None: ...

class RevokeProviderResponse(_message.Message):
    __slots__ = ("provider", "aborted_leases")
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    ABORTED_LEASES_FIELD_NUMBER: _ClassVar[int]
    provider: ProviderInfo
    aborted_leases: int
    def __init__(self, provider: _Optional[_Union[ProviderInfo, _Mapping]] = ..., aborted_leases: _Optional[int] = ...) -> None: ...

class RotateProviderTokenRequest(_message.Message):
    __slots__ = ("provider_id", "grace_seconds")
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    provider_id: str
    grace_seconds: int
    def __init__(self, provider_id: _Optional[str] = ..., grace_seconds: _Optional[int] = ...) -> None: ...

class RotateProviderTokenResponse(_message.Message):
    __slots__ = ("token", "old_token_expires_unix")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    OLD_TOKEN_EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    token: str
    old_token_expires_unix: int
    def __init__(self, token: _Optional[str] = ..., old_token_expires_unix: _Optional[int] = ...) -> None: ...
