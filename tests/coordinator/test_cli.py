"""`dflash-coordinator` admin subcommands as a user runs them (real processes, real server)."""

from __future__ import annotations

import json

from coordinator_helpers import REPO, subprocess_env
from prewarmed import coordinator_cli


def run_cli(*argv, env_extra=None, input=None):
    env = subprocess_env()
    env.update(env_extra or {})
    return coordinator_cli(*argv, env=env, cwd=REPO, input=input, timeout=60)


def test_admin_commands_end_to_end(coordinator, tmp_path):
    env = {"DFLASH_COORDINATOR": f"http://{coordinator.address}", "DFLASH_ADMIN_TOKEN": coordinator.admin_token}
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"stages": ["train"], "recipe": {"steps": 2}}))

    r = run_cli("runs", "create", "--name", "cli-run", "--spec", str(spec), "--client-version", "0.3.0", "--checkpoint-policy", "ephemeral", "--jobs", "3", "--json", env_extra=env)
    assert r.returncode == 0, r.stderr
    run = json.loads(r.stdout)
    assert run["job_states"] == {"queued": 3} and run["spec"]["checkpoint_policy"] == "ephemeral"

    r = run_cli("versions", "approve", run["run_id"], "0.2.9", "--json", env_extra=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["approved_native_versions"] == ["0.2.9"]

    r = run_cli("providers", "create", "mac-mini", "--json", env_extra=env)
    assert r.returncode == 0, r.stderr
    token = json.loads(r.stdout)["token"]
    assert len(token) >= 40

    r = run_cli("runs", "list", env_extra=env)
    assert r.returncode == 0 and "cli-run" in r.stdout and "queued 3" in r.stdout

    r = run_cli("runs", "show", run["run_id"], "--json", env_extra=env)
    jobs = json.loads(r.stdout)["jobs"]
    assert len(jobs) == 3
    r = run_cli("jobs", "cancel", jobs[0]["job_id"], "--json", env_extra=env)
    assert r.returncode == 0 and json.loads(r.stdout)["job_state"] == "cancelled"

    # stdin spec, token from the file the server wrote
    r = run_cli("runs", "create", "--name", "stdin-run", "--spec", "-", "--client-version", "0.3.0", "--server", coordinator.address, "--admin-token-file", coordinator.info["admin_token_file"], input='{"a": 1}')
    assert r.returncode == 0, r.stderr


def test_cli_errors_exit_1_with_a_clear_message(coordinator, tmp_path):
    env = {"DFLASH_COORDINATOR": coordinator.address, "DFLASH_ADMIN_TOKEN": coordinator.admin_token}
    bad = tmp_path / "bad.json"
    bad.write_text('{"stages": [}')
    r = run_cli("runs", "create", "--name", "x", "--spec", str(bad), "--client-version", "0.3.0", env_extra=env)
    assert r.returncode == 1 and r.stdout == ""
    assert "INVALID_ARGUMENT" in r.stderr and "spec_json" in r.stderr and "line 1" in r.stderr

    r = run_cli("runs", "list", env_extra={"DFLASH_COORDINATOR": coordinator.address, "DFLASH_ADMIN_TOKEN": "wrong-token-wrong-token"})
    assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr

    r = run_cli("runs", "show", "run-missing", env_extra=env)
    assert r.returncode == 1 and "NOT_FOUND" in r.stderr and "no run `run-missing`" in r.stderr

    r = run_cli("runs", "list", "--server", "127.0.0.1:1", "--timeout", "2", env_extra={"DFLASH_ADMIN_TOKEN": "x" * 20})
    assert r.returncode == 1 and "cannot reach the coordinator" in r.stderr and "hint:" in r.stderr

    r = run_cli("runs", "list", "--admin-token-file", str(tmp_path / "nope"), "--server", coordinator.address)
    assert r.returncode == 1 and "no admin token" in r.stderr


def test_serve_refuses_a_taken_port_and_bad_flags(coordinator, tmp_path):
    r = run_cli("serve", "--db", str(tmp_path / "db2"), "--listen", coordinator.address)
    assert r.returncode == 1 and "cannot listen" in r.stderr
    r = run_cli("serve", "--db", str(tmp_path / "db3"), "--listen", "nonsense")
    assert r.returncode == 1 and "HOST:PORT" in r.stderr
    r = run_cli("serve", "--db", str(tmp_path / "db4"), "--lease-ttl", "0")
    assert r.returncode == 1 and "lease-ttl" in r.stderr
