"""How the admin subcommands print what the coordinator answered: lines for people, JSON for programs (`--json`).

Data goes to stdout, notes to stderr. Pure formatting over the `dflash.v1` admin messages; `cli`
makes the calls.
"""

from __future__ import annotations

import json
import sys
import time

from google.protobuf import json_format

from ..proto.dflash.v1 import admin_pb2, provider_pb2


def emit_json(value) -> None:
    """`value` as indented JSON with sorted keys, one document on stdout."""
    json.dump(value, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


def msg_dict(msg) -> dict:
    """A protobuf message as a JSON-able dict: proto field names, fields at their defaults included."""
    return json_format.MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def when(unix: int) -> str:
    """A Unix time as local `YYYY-MM-DD HH:MM:SS`."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))


def print_run(run: admin_pb2.Run) -> None:
    """One line per run: id, name, client version, checkpoint policy, job counts by state."""
    states = ", ".join(f"{k} {v}" for k, v in sorted(run.job_states.items())) or "no jobs"
    print(f"{run.run_id}  {run.spec.name}  client {run.spec.required_client_version}  {run.spec.checkpoint_policy}  [{states}]")


def job_label(j) -> str:
    """`capture 2/4  ` for a job of a graph run; nothing for a pipeline job (as before graphs)."""
    if j.kind in ("", "pipeline"):
        return ""
    return f"{j.kind} {j.shard_index + 1}/{j.shard_count}  " if j.shard_count > 1 else f"{j.kind}  "


def waits(j) -> str:
    """What a queued job waits for (the one job, or how many of those it needs); nothing otherwise."""
    if not j.waiting_for or j.state != "queued":
        return ""
    if len(j.waiting_for) == 1:
        return f"  waits for {j.waiting_for[0]}"
    return f"  waits for {len(j.waiting_for)} of {len(j.needs)} jobs it needs"


def publication_line(p) -> str:
    """Whether a job's export is published and why, and the override that published it, if any."""
    state = "published" if p.published else "NOT published"
    line = f"    export {state}: {p.reason}"
    if p.override_unix:
        line += f"\n    published by override {when(p.override_unix)} from {p.override_peer or '?'}" + (f": {p.override_note}" if p.override_note else "")
    return line


def print_run_details(resp: admin_pb2.GetRunResponse, finals: dict[str, list]) -> None:
    """`runs show` as text: the run, then each job with its state, why it waits or failed, its export's
    publication and its final artifacts (`finals`: job id -> artifacts)."""
    print_run(resp.run)
    if resp.run.approved_native_versions:
        print(f"  approved native versions: {', '.join(resp.run.approved_native_versions)}")
    if resp.run.failure:
        print(f"  run failed: {resp.run.failure}")
    for j in resp.jobs:
        print(f"  {j.job_id}  {job_label(j)}{j.state}  attempts {j.attempts}{waits(j)}")
        for why in (j.reason, j.waiting_reason):
            if why:
                print("    " + why.replace("\n", "\n    "))
        if j.HasField("publication"):
            print(publication_line(j.publication))
        elif j.HasField("export") and j.kind == "train":
            print("    export not decided yet: the regression gate decides on it when the run's evaluate job (shard 0) succeeds")
        for a in finals[j.job_id]:
            print_artifact(a)


def print_provider(p: admin_pb2.ProviderInfo) -> None:
    """One line per provider (revoked and quarantined ones marked), and the quarantine's reason."""
    mode = provider_pb2.LaunchMode.Name(p.launch_mode) if p.launch_mode in provider_pb2.LaunchMode.values() else str(p.launch_mode)
    seen = when(p.last_seen_unix) if p.last_seen_unix else "never"
    revoked = f"  REVOKED {when(p.revoked_unix)}" if p.revoked_unix else ""
    quarantined = f"  QUARANTINED {when(p.quarantined_unix)}" if p.quarantined_unix else ""
    print(f"{p.provider_id}  {p.identity or p.name}  {p.name}  {p.client_version or '-'}  {mode}  {p.capabilities.backend or '-'}  last seen {seen}{revoked}{quarantined}")
    if p.quarantined_unix:
        print(f"    quarantined: {p.quarantine_reason}")
    if p.HasField("last_unquarantine"):
        print(f"    last {unquarantine_line(p.last_unquarantine)}")


def unquarantine_line(a: admin_pb2.AuditRecord) -> str:
    """An unquarantine audit entry: when, from where, why, and (on a second line) the quarantine it lifted."""
    return f"unquarantined {when(a.created_unix)} from {a.peer or '?'}: {a.reason}\n    lifted: {a.detail}"


def print_token(token: str) -> None:
    """A new token on stdout, the note that it is shown once on stderr."""
    print(token)
    print("note: the token is shown once; the coordinator keeps only its hash", file=sys.stderr)


def print_artifact(a) -> None:
    """One indented line per artifact: kind, name, step, size and the start of its sha256."""
    print(f"    {a.kind:<15} {a.name}  step {a.step}  {a.size_bytes} B  sha256 {a.sha256[:16]}...")
