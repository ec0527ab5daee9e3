"""`dflash-coordinator` command line: run the server and administer it.

``serve`` runs the coordinator in this process. Every other subcommand is an
admin client that talks to a running coordinator over gRPC with the admin
token. Data goes to stdout (``--json`` for machine-readable output), logs and
errors to stderr; refused calls exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path

from .. import __version__
from ..cli import run_guarded
from ..errors import ConfigError
from ..proto.dflash.v1 import admin_pb2
from .cli_output import (
    emit_json,
    msg_dict,
    print_artifact,
    print_provider,
    print_run,
    print_run_details,
    print_token,
    publication_line,
    unquarantine_line,
    when,
)
from .grpc import DEFAULT_UPLOAD_IDLE_SECONDS
from .store import DEFAULT_ROTATE_GRACE_SECONDS, MAX_ROTATE_GRACE_SECONDS, MAX_SHARDS, Quotas

# Environment variables (flags take precedence over them).
ENV_ADDRESS = "DFLASH_COORDINATOR"  # coordinator address, HOST:PORT or http://HOST:PORT (shared with run-manager)
ENV_ADMIN_TOKEN = "DFLASH_ADMIN_TOKEN"  # admin bearer token
ENV_ADMIN_TOKEN_FILE = "DFLASH_ADMIN_TOKEN_FILE"  # file holding the admin token
ENV_VIEWER_TOKEN = "DFLASH_VIEWER_TOKEN"  # serve: the status page's read-only viewer token
ENV_TLS_CERT = "DFLASH_TLS_CERT"  # serve: TLS certificate chain (PEM)
ENV_TLS_KEY = "DFLASH_TLS_KEY"  # serve: TLS private key (PEM, unencrypted)
ENV_TLS_CLIENT_CA = "DFLASH_TLS_CLIENT_CA"  # serve: CA whose client certificates are required (mutual TLS)
ENV_TLS_CA = "DFLASH_TLS_CA"  # admin client: CA that signed the coordinator's certificate (default: system roots)
ENV_TLS_CLIENT_CERT = "DFLASH_TLS_CLIENT_CERT"  # admin client: certificate for mutual TLS
ENV_TLS_CLIENT_KEY = "DFLASH_TLS_CLIENT_KEY"  # admin client: its private key

DEFAULT_DB = Path("dflash-work/coordinator/coordinator.db")
DEFAULT_TOKEN_FILE = DEFAULT_DB.parent / "admin-token"
DEFAULT_ADDRESS = "127.0.0.1:50051"


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", type=Path, default=DEFAULT_DB, help=f"SQLite database (created if missing; default `{DEFAULT_DB}`)")
    p.add_argument("--listen", default=DEFAULT_ADDRESS, help=f"HOST:PORT to serve on; port 0 picks a free port (default `{DEFAULT_ADDRESS}`)")
    p.add_argument(
        "--artifact-store",
        default=None,
        metavar="DIR|s3://BUCKET[/PREFIX]",
        help="where artifact bytes are kept, content-addressed: a directory (default: `artifacts/` next to --db) or an S3-compatible bucket "
        "(credentials from the usual AWS_* variables or ~/.aws/config); uploads are staged in `staging/` next to --db either way",
    )
    p.add_argument("--s3-endpoint-url", default=None, metavar="URL", help="S3-compatible endpoint (default: AWS, or `AWS_ENDPOINT_URL`)")
    p.add_argument("--keep-checkpoints", type=int, default=2, metavar="K", help="checkpoints kept per job; older ones and their bytes are deleted (default 2)")
    p.add_argument("--quota-attempt-records", type=int, default=Quotas.attempt_records, metavar="N", help=f"artifact records per attempt (default {Quotas.attempt_records})")
    p.add_argument("--quota-attempt-bytes", type=int, default=Quotas.attempt_bytes, metavar="BYTES", help=f"artifact bytes per attempt (default {Quotas.attempt_bytes})")
    p.add_argument("--quota-run-records", type=int, default=Quotas.run_records, metavar="N", help=f"artifact records per run, all attempts (default {Quotas.run_records})")
    p.add_argument("--quota-run-bytes", type=int, default=Quotas.run_bytes, metavar="BYTES", help=f"artifact bytes per run, all attempts (default {Quotas.run_bytes})")
    p.add_argument(
        "--upload-idle-timeout",
        type=float,
        default=DEFAULT_UPLOAD_IDLE_SECONDS,
        metavar="SECONDS",
        help=f"an upload stream that sends nothing this long is cut; its staged bytes are swept later (default {DEFAULT_UPLOAD_IDLE_SECONDS:g})",
    )
    p.add_argument("--lease-ttl", type=float, default=30.0, help="seconds a lease stays valid without a heartbeat (default 30)")
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=16 * 1024 * 1024,
        help="largest gRPC message accepted or sent; larger ones fail RESOURCE_EXHAUSTED (default 16 MiB)",
    )
    p.add_argument("--expiry-interval", type=float, default=None, help="seconds between sweeps that expire silent leases (default: a quarter of --lease-ttl, at most 1); leases are also checked whenever used")
    p.add_argument("--max-wait", type=float, default=30.0, help="cap in seconds on AcquireLease long-poll waits (default 30)")
    p.add_argument("--max-attempts", type=int, default=5, help="attempts per job before an expired/retryable job fails (default 5)")
    p.add_argument(
        "--admin-token",
        default=None,
        help=f"admin bearer token (env `{ENV_ADMIN_TOKEN}`); when unset, one is generated on first start and written to --admin-token-file",
    )
    p.add_argument("--admin-token-file", type=Path, default=None, help="where a generated admin token is written, mode 0600 (default: `admin-token` next to --db)")
    p.add_argument("--tls-cert", type=Path, default=None, help=f"serve TLS with this PEM certificate chain (env `{ENV_TLS_CERT}`); needs --tls-key")
    p.add_argument("--tls-key", type=Path, default=None, help=f"PEM private key of --tls-cert, unencrypted (env `{ENV_TLS_KEY}`)")
    p.add_argument(
        "--tls-client-ca",
        type=Path,
        default=None,
        help=f"mutual TLS: require client certificates signed by this CA (env `{ENV_TLS_CLIENT_CA}`); a provider's certificate CN must be its name",
    )
    p.add_argument("--insecure", action="store_true", help="allow plaintext on a non-loopback --listen address (tokens travel in the clear; logs a warning)")
    p.add_argument("--auth-failure-limit", type=int, default=20, help="failed authentications a peer address may make per window before its calls are refused (default 20; 0: no limit)")
    p.add_argument("--auth-failure-window", type=float, default=60.0, help="seconds of that window (default 60)")
    p.add_argument(
        "--http-listen",
        default=None,
        metavar="HOST:PORT",
        help="also serve the status page and Prometheus `/metrics` over HTTP here (HTTPS with --tls-cert); port 0 picks one (default: not served)",
    )
    p.add_argument(
        "--viewer-token",
        default=None,
        help=f"the status page's read-only token (env `{ENV_VIEWER_TOKEN}`); when unset, one is generated on first start and written to --viewer-token-file",
    )
    p.add_argument("--viewer-token-file", type=Path, default=None, help="where a generated viewer token is written, mode 0600 (default: `viewer-token` next to --db)")
    p.add_argument("--page-refresh", type=float, default=2.0, metavar="SECONDS", help="how often an open status page refreshes itself (default 2)")
    p.add_argument("-v", "--verbose", action="store_true", help="log at debug level")


def _client_args(p: argparse.ArgumentParser, *, json_flag: bool = True) -> None:
    p.add_argument(
        "--server", default=None, help=f"coordinator address HOST:PORT, or https://HOST:PORT for TLS (env `{ENV_ADDRESS}`, default `{DEFAULT_ADDRESS}`)"
    )
    p.add_argument("--ca-file", type=Path, default=None, help=f"TLS: CA certificate(s) that signed the coordinator's (env `{ENV_TLS_CA}`; default: the system roots)")
    p.add_argument("--client-cert", type=Path, default=None, help=f"mutual TLS: client certificate (env `{ENV_TLS_CLIENT_CERT}`)")
    p.add_argument("--client-key", type=Path, default=None, help=f"mutual TLS: its private key (env `{ENV_TLS_CLIENT_KEY}`)")
    p.add_argument("--admin-token", default=None, help=f"admin bearer token (env `{ENV_ADMIN_TOKEN}`)")
    p.add_argument(
        "--admin-token-file",
        type=Path,
        default=None,
        help=f"read the admin token from this file (env `{ENV_ADMIN_TOKEN_FILE}`, default `{DEFAULT_TOKEN_FILE}`)",
    )
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the coordinator (default 30)")
    if json_flag:
        p.add_argument("--json", action="store_true", help="print the result as JSON")


def _grace(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_ROTATE_GRACE_SECONDS:
        raise argparse.ArgumentTypeError(f"must be whole seconds from 0 to {MAX_ROTATE_GRACE_SECONDS}, got `{text}`")
    return value


def _count(text: str) -> int:
    """A shard count: checked here because a value past uint32 would not even reach the coordinator."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SHARDS:
        raise argparse.ArgumentTypeError(f"must be a whole number from 0 to {MAX_SHARDS}, got `{text}`")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The `dflash-coordinator` parser: `serve` and the admin subcommands, in the order `--help` lists them."""
    parser = argparse.ArgumentParser(
        prog="dflash-coordinator",
        description="Coordinator for dflash-worker providers: runs, jobs, leases, versions and artifacts over gRPC.",
    )
    parser.add_argument("--version", action="version", version=f"dflash-coordinator {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    _serve_args(sub.add_parser("serve", help="run the coordinator", description="Run the coordinator; prints the bound address as one JSON line on stdout."))
    _add_runs(sub)
    _add_versions(sub)
    _add_providers(sub)
    _add_artifacts(sub)
    _add_jobs(sub)
    return parser


def _add_runs(sub) -> None:
    """The `runs` subcommands: create, list, show, publish."""
    runs = sub.add_parser("runs", help="create and inspect runs").add_subparsers(dest="action", metavar="ACTION")
    rc = runs.add_parser("create", help="create a run and its jobs", description="Create a run and queue its jobs.")
    rc.add_argument("--name", required=True, help="run name, unique per coordinator")
    g = rc.add_mutually_exclusive_group(required=True)
    g.add_argument("--spec", type=Path, help="job spec JSON file (recipe, data and model references); `-` reads stdin")
    g.add_argument("--spec-json", help="job spec JSON given inline")
    rc.add_argument("--client-version", required=True, help="client version providers must run (semver)")
    rc.add_argument("--checkpoint-policy", choices=("durable", "ephemeral"), default="durable", help="durable: checkpoints are uploaded; ephemeral: they stay on the provider (never leased to native providers)")
    rc.add_argument("--max-local-ranks", type=int, default=1, help="ranks per job; more than 1 only on CUDA providers and `run-manager --cpu-ranks` CPU providers (default 1)")
    rc.add_argument("--feature", action="append", default=[], metavar="NAME", help="device feature a provider must offer (repeatable), e.g. `cuda`, `flash_attention_2`")
    rc.add_argument("--image", default="", help="container image (tag or digest) for Docker launch mode")
    rc.add_argument("--jobs", type=int, default=1, help="number of jobs to queue (default 1)")
    rc.add_argument(
        "--capture-shards", type=_count, default=0, metavar="N",
        help=f"make the run a job graph: prepare, N capture shards, train, evaluate (at most {MAX_SHARDS}; default 0: --jobs pipeline jobs)",
    )  # fmt: skip
    rc.add_argument("--eval-shards", type=_count, default=0, metavar="M", help="evaluate shards of a job graph (default 1; needs --capture-shards)")
    _client_args(rc)
    rl = runs.add_parser("list", help="list runs with job counts by state")
    _client_args(rl)
    rs = runs.add_parser("show", help="show one run, its jobs and their artifacts")
    rs.add_argument("run_id", help="run id (from `runs list`)")
    _client_args(rs)
    rp = runs.add_parser(
        "publish",
        help="publish an export the regression gate held back (--override; recorded)",
        description="Publish a run's export that the regression gate held back (its evaluation regressed, or there was none). "
        "`--override` is required and the override is recorded with its time, your note and your address.",
    )
    rp.add_argument("run_id", help="run id (from `runs list`)")
    rp.add_argument("--job", default="", help="job id (needed when the run has several jobs)")
    rp.add_argument("--override", action="store_true", help="publish although the gate held the export back")
    rp.add_argument("--note", default="", help="why (recorded with the override; at most 1,000 characters)")
    _client_args(rp)


def _add_versions(sub) -> None:
    """The `versions` subcommand: approve."""
    versions = sub.add_parser("versions", help="approve native client versions").add_subparsers(dest="action", metavar="ACTION")
    va = versions.add_parser("approve", help="allow a native client version for one run", description="Allow providers launching in native mode with this native client version to lease this run's jobs.")
    va.add_argument("run_id", help="run id")
    va.add_argument("version", help="native client version (semver)")
    _client_args(va)


def _add_providers(sub) -> None:
    """The `providers` subcommands: create, list, revoke, rotate, unquarantine."""
    providers = sub.add_parser("providers", help="create, list, revoke, unquarantine providers and rotate their tokens").add_subparsers(dest="action", metavar="ACTION")
    pc = providers.add_parser("create", help="create a provider and print its bearer token (shown once)")
    pc.add_argument("name", help="provider name: its identity (under mutual TLS its certificate's CN must be this name)")
    _client_args(pc)
    pl = providers.add_parser("list", help="list providers and what they registered")
    _client_args(pl)
    pv = providers.add_parser(
        "revoke",
        help="refuse a provider's tokens from now on and abort its live leases",
        description="Revoke a provider: every call with its token is refused (UNAUTHENTICATED) and its live leases are aborted, so their jobs go to other providers.",
    )
    pv.add_argument("provider_id", help="provider id (from `providers list`)")
    _client_args(pv)
    pr = providers.add_parser(
        "rotate",
        help="give a provider a new token (printed once); the old one works for --grace seconds",
        description="Replace a provider's token. The new token is printed once; the old one keeps working for the grace period, then is refused.",
    )
    pr.add_argument("provider_id", help="provider id (from `providers list`)")
    pr.add_argument(
        "--grace",
        type=_grace,
        default=DEFAULT_ROTATE_GRACE_SECONDS,
        metavar="SECONDS",
        help=f"seconds the old token keeps working (default {DEFAULT_ROTATE_GRACE_SECONDS}; 0 refuses it at once; at most 30 days)",
    )
    _client_args(pr)
    pu = providers.add_parser(
        "unquarantine",
        help="lift a provider's quarantine (recorded in the audit log with --reason)",
        description="Lift a provider's quarantine, so it is leased work again. The reason, your address and the quarantine lifted are recorded "
        "in the coordinator's audit log (shown by `providers list` and the status page).",
    )
    pu.add_argument("provider_id", help="provider id (from `providers list`, which marks the quarantined ones QUARANTINED)")
    pu.add_argument("--reason", required=True, metavar="TEXT", help="why (required; one line, at most 1,000 characters)")
    _client_args(pu)


def _add_artifacts(sub) -> None:
    """The `artifacts` subcommands: list, get."""
    arts = sub.add_parser("artifacts", help="list and fetch a run's artifacts").add_subparsers(dest="action", metavar="ACTION")
    al = arts.add_parser(
        "list",
        help="list a job's artifacts (its succeeded attempt's, or --all-attempts)",
        description="List a job's final artifacts: those of its SUCCEEDED attempt. `--all-attempts` shows every attempt's records, newest first.",
    )
    al.add_argument("run_id", help="run id (from `runs list`)")
    al.add_argument("--job", default="", help="job id (needed when the run has several jobs)")
    al.add_argument("--all-attempts", action="store_true", help="every attempt's records, not only the succeeded attempt's")
    _client_args(al)
    ag = arts.add_parser(
        "get",
        help="download an artifact (resumable, sha256-verified)",
        description="Download a job's artifact to a file. Without --sha256 it is the SUCCEEDED attempt's; bytes go to PATH.part first "
        "(running the command again resumes), and PATH appears only once the sha256 matches the record. "
        "`artifacts get RUN --export -o DIR` fetches the whole export (every `export` artifact) into DIR.",
    )
    ag.add_argument("run_id", help="run id (from `runs list`)")
    ag.add_argument("name", nargs="?", default=None, help="artifact name (from `artifacts list`), e.g. `run/export/model.safetensors`")
    ag.add_argument("--export", action="store_true", help="fetch every export artifact of the succeeded attempt into the directory -o names")
    ag.add_argument("--job", default="", help="job id (needed when the run has several jobs)")
    ag.add_argument("--sha256", default="", help="fetch the record with this digest (any attempt's) instead of the succeeded attempt's")
    ag.add_argument("-o", "--output", type=Path, required=True, metavar="PATH", help="file to write (with --export: a directory)")
    ag.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    _client_args(ag)


def _add_jobs(sub) -> None:
    """The `jobs` subcommands: cancel, checkpoint."""
    jobs = sub.add_parser("jobs", help="steer jobs").add_subparsers(dest="action", metavar="ACTION")
    jc = jobs.add_parser("cancel", help="cancel a job (a running attempt gets a CANCEL directive)")
    jc.add_argument("job_id", help="job id (from `runs show`)")
    _client_args(jc)
    jk = jobs.add_parser("checkpoint", help="ask a running job to commit a checkpoint now (CHECKPOINT_NOW directive)")
    jk.add_argument("job_id", help="job id (from `runs show`)")
    _client_args(jk)


def _admin_token(args) -> str:
    token = args.admin_token or os.environ.get(ENV_ADMIN_TOKEN)
    if token:
        return token
    path = args.admin_token_file or Path(os.environ.get(ENV_ADMIN_TOKEN_FILE) or DEFAULT_TOKEN_FILE)
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"no admin token: `--admin-token` and `{ENV_ADMIN_TOKEN}` are unset and `{path}` is unreadable ({exc.strerror})\n"
            "hint: pass `--admin-token-file` pointing at the file `dflash-coordinator serve` wrote"
        ) from None
    if not token:
        raise ConfigError(f"admin token file `{path}` is empty")
    return token


def _path(flag: Path | None, env: str) -> Path | None:
    """A path flag, else its environment variable, else None."""
    return flag or (Path(os.environ[env]) if os.environ.get(env) else None)


def _client(args):
    from .client import AdminClient
    from .tls import ClientTls

    address = args.server or os.environ.get(ENV_ADDRESS) or DEFAULT_ADDRESS
    tls = ClientTls(
        ca_file=_path(args.ca_file, ENV_TLS_CA),
        client_cert=_path(args.client_cert, ENV_TLS_CLIENT_CERT),
        client_key=_path(args.client_key, ENV_TLS_CLIENT_KEY),
    )
    return AdminClient(address, _admin_token(args), timeout=args.timeout, tls=tls)


def _read_spec(args) -> str:
    if args.spec_json is not None:
        return args.spec_json
    if str(args.spec) == "-":
        return sys.stdin.read()
    try:
        return args.spec.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read job spec `{args.spec}`: {exc}") from None


def _cmd_serve(args) -> int:
    from .server import ServeConfig, serve

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServeConfig(
        db=args.db,
        listen=args.listen,
        artifact_store=args.artifact_store,
        s3_endpoint_url=args.s3_endpoint_url,
        keep_checkpoints=args.keep_checkpoints,
        quotas=Quotas(
            attempt_records=args.quota_attempt_records,
            attempt_bytes=args.quota_attempt_bytes,
            run_records=args.quota_run_records,
            run_bytes=args.quota_run_bytes,
        ),
        upload_idle_seconds=args.upload_idle_timeout,
        lease_ttl=args.lease_ttl,
        max_message_bytes=args.max_message_bytes,
        max_wait=args.max_wait,
        max_attempts=args.max_attempts,
        expiry_interval=args.expiry_interval,
        admin_token=args.admin_token or os.environ.get(ENV_ADMIN_TOKEN) or None,
        admin_token_file=args.admin_token_file,
        tls_cert=_path(args.tls_cert, ENV_TLS_CERT),
        tls_key=_path(args.tls_key, ENV_TLS_KEY),
        tls_client_ca=_path(args.tls_client_ca, ENV_TLS_CLIENT_CA),
        insecure=args.insecure,
        auth_failure_limit=args.auth_failure_limit,
        auth_failure_window=args.auth_failure_window,
        http_listen=args.http_listen,
        viewer_token=args.viewer_token or os.environ.get(ENV_VIEWER_TOKEN) or None,
        viewer_token_file=args.viewer_token_file,
        page_refresh_seconds=args.page_refresh,
    )

    def ready(info: dict) -> None:
        # One JSON line so a parent process can read the bound address.
        sys.stdout.write(json.dumps(info, sort_keys=True) + "\n")
        sys.stdout.flush()
        where = f", admin token in `{info['admin_token_file']}`" if info["admin_token_file"] else ""
        how = "mutual TLS" if info["mtls"] else "TLS" if info["tls"] else "plaintext"
        logging.getLogger("dflash_worker.coordinator").info("serving %s on %s%s", how, info["address"], where)
        if info.get("http_address"):
            viewer = f", viewer token in `{info['viewer_token_file']}`" if info["viewer_token_file"] else ""
            logging.getLogger("dflash_worker.coordinator").info("status page on %s/ and metrics on %s/metrics%s", info["http_address"], info["http_address"], viewer)

    asyncio.run(serve(config, on_ready=ready))
    return 0


def _cmd_providers(c, args) -> None:
    if args.action == "create":
        resp = c.create_provider_full(args.name)
        emit_json({"name": args.name, "provider_id": resp.provider_id, "token": resp.token}) if args.json else print_token(resp.token)
    elif args.action == "list":
        providers = c.list_providers()
        if args.json:
            emit_json([msg_dict(p) for p in providers])
        else:
            for p in providers:
                print_provider(p)
    elif args.action == "revoke":
        resp = c.revoke_provider(args.provider_id)
        if args.json:
            emit_json(msg_dict(resp))
        else:
            print(f"{resp.provider.provider_id}  revoked  ({resp.aborted_leases} live lease(s) aborted)")
    elif args.action == "unquarantine":
        resp = c.unquarantine_provider(args.provider_id, args.reason)
        emit_json(msg_dict(resp)) if args.json else print(f"{args.provider_id}  {unquarantine_line(resp.audit)}")
    elif args.action == "rotate":
        resp = c.rotate_token(args.provider_id, args.grace)
        if args.json:
            emit_json({"provider_id": args.provider_id, "token": resp.token, "old_token_expires_unix": resp.old_token_expires_unix})
        else:
            print_token(resp.token)
            print(f"note: the old token works until {when(resp.old_token_expires_unix)}", file=sys.stderr)
    else:
        raise AssertionError(args.action)


def _cmd_get(c, args) -> None:
    if args.export == (args.name is not None):
        raise ConfigError("`artifacts get` takes an artifact NAME or `--export`, not both\nhint: `dflash-coordinator artifacts list RUN` shows the names")
    if args.name is not None:
        got = [(args.name, args.output, args.sha256)]
    else:
        exports = [r.artifact for r in c.list_artifacts(args.run_id, args.job) if r.artifact.kind == "export"]
        if not exports:
            raise ConfigError(f"run `{args.run_id}` has no export from a succeeded attempt\nhint: `dflash-coordinator artifacts list {args.run_id} --all-attempts`")
        common = os.path.commonpath([a.name for a in exports]) if len(exports) > 1 else exports[0].name.rpartition("/")[0]
        got = [(a.name, args.output / os.path.relpath(a.name, common or "."), a.sha256) for a in exports]
    done = []
    for name, dest, sha in got:
        record = c.download(args.run_id, name, dest, job_id=args.job, sha256=sha, progress=not args.no_progress and sys.stderr.isatty())
        done.append({"name": name, "path": str(dest), "sha256": record.sha256, "size_bytes": record.size_bytes})
    if args.json:
        emit_json(done)
    else:
        for d in done:
            print(f"{d['path']}  {d['size_bytes']} B  sha256 {d['sha256']}  (verified)")


def _show_run(c, args) -> None:
    """`runs show`: the run and each job with its final artifacts (the succeeded attempt's, fetched page by page)."""
    resp = c.get_run(args.run_id)
    finals = {j.job_id: [a.artifact for a in c.list_artifacts(args.run_id, j.job_id)] if j.artifact_count else [] for j in resp.jobs}
    if args.json:
        doc = msg_dict(resp)
        for j in doc["jobs"]:
            j["artifacts"] = [msg_dict(a) for a in finals[j["job_id"]]]
        emit_json(doc)
    else:
        print_run_details(resp, finals)


def _cmd_runs(c, args) -> None:
    if args.action == "create":
        spec = admin_pb2.RunSpec(
            name=args.name,
            spec_json=_read_spec(args),
            required_client_version=args.client_version,
            checkpoint_policy=args.checkpoint_policy,
            max_local_ranks=args.max_local_ranks,
            required_features=args.feature,
            image=args.image,
            num_jobs=args.jobs,
            capture_shards=args.capture_shards,
            eval_shards=args.eval_shards,
        )
        run = c.create_run(spec)
        emit_json(msg_dict(run)) if args.json else print_run(run)
    elif args.action == "list":
        runs = c.list_runs()
        if args.json:
            emit_json([msg_dict(r) for r in runs])
        else:
            for r in runs:
                print_run(r)
    elif args.action == "show":
        _show_run(c, args)
    elif args.action == "publish":
        resp = c.publish_run(args.run_id, args.job, override=args.override, note=args.note)
        emit_json(msg_dict(resp)) if args.json else print(f"{resp.job_id}\n{publication_line(resp.publication)}")
    else:
        raise AssertionError(args.action)


def _cmd_admin(args) -> int:
    key = (args.command, args.action)
    with _client(args) as c:
        if key[0] == "runs":
            _cmd_runs(c, args)
        elif key == ("artifacts", "list"):
            rows = c.list_artifacts(args.run_id, args.job, all_attempts=args.all_attempts)
            if args.json:
                emit_json([msg_dict(r) for r in rows])
            else:
                if not rows:
                    print("no artifacts" + ("" if args.all_attempts else " from a succeeded attempt (try --all-attempts)"), file=sys.stderr)
                for r in rows:
                    print(f"  attempt {r.attempt} ({r.attempt_state})", end="")
                    print_artifact(r.artifact)
        elif key == ("artifacts", "get"):
            _cmd_get(c, args)
        elif key == ("versions", "approve"):
            run = c.approve_version(args.run_id, args.version)
            emit_json(msg_dict(run)) if args.json else print_run(run)
        elif key[0] == "providers":
            _cmd_providers(c, args)
        elif key == ("jobs", "cancel"):
            state = c.cancel_job(args.job_id)
            emit_json({"job_id": args.job_id, "job_state": state}) if args.json else print(f"{args.job_id}  {state}")
        elif key == ("jobs", "checkpoint"):
            state = c.request_checkpoint(args.job_id)
            emit_json({"job_id": args.job_id, "job_state": state}) if args.json else print(f"{args.job_id}  {state}  (checkpoint requested)")
        else:
            raise AssertionError(key)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None or (args.command != "serve" and getattr(args, "action", None) is None):
        parser.print_help(sys.stderr)
        return 1
    return run_guarded(lambda: _cmd_serve(args) if args.command == "serve" else _cmd_admin(args))


if __name__ == "__main__":
    sys.exit(main())
