#!/usr/bin/env bash
# Make sure a Docker engine answers on this machine, for the Docker-mode e2e tests
# (tests/e2e/test_e2e_docker.py) and scripts/build-cpu-image.sh.
#
# Exit 0 when `docker info` works: an engine already running, or, as root, one this
# script started (`dockerd`, installing Debian's `docker.io` with apt-get when there is
# no `dockerd`). Exit 3 with the reason on stderr when no engine can be had here (not
# root, no apt-get, a Mac without Docker Desktop running), so callers can skip and say why.
# Exit 4 when one should have been had and was not (root on Linux, yet the install failed
# or the started `dockerd` never answered): a failure, never a reason to skip.
#
# A `dockerd` started here logs to ${DFLASH_DOCKERD_LOG:-/tmp/dflash-dockerd.log} and keeps
# running after this script (the next call finds it); stop it with `kill $(cat /var/run/docker.pid)`.
set -euo pipefail

log=${DFLASH_DOCKERD_LOG:-/tmp/dflash-dockerd.log}

answers() { command -v docker >/dev/null 2>&1 && timeout 20 docker info >/dev/null 2>&1; }

if answers; then
  exit 0
fi
if [ "$(uname -s)" != Linux ]; then
  echo "ensure-docker: no Docker engine answers (\`docker info\` failed) and this is not Linux; start Docker Desktop or another engine" >&2
  exit 3
fi
if [ "$(id -u)" != 0 ]; then
  echo "ensure-docker: no Docker engine answers (\`docker info\` failed) and this is not root, so none can be started here" >&2
  exit 3
fi
if ! command -v dockerd >/dev/null 2>&1 || ! command -v containerd >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-docker: no dockerd here and no apt-get to install Debian's docker.io" >&2
    exit 3
  fi
  echo "ensure-docker: installing Debian's docker.io (apt-get)" >&2
  export DEBIAN_FRONTEND=noninteractive
  if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends docker.io; } >&2; then
    echo "ensure-docker: installing Debian's docker.io failed (output above)" >&2
    exit 4
  fi
fi
if [ -S /var/run/docker.sock ] && ! pgrep -x dockerd >/dev/null 2>&1; then
  rm -f /var/run/docker.sock /var/run/docker.pid
fi
if ! pgrep -x dockerd >/dev/null 2>&1; then
  echo "ensure-docker: starting dockerd (log: $log)" >&2
  # setsid: the engine outlives this script and the test session that called it.
  setsid dockerd >"$log" 2>&1 </dev/null &
fi
for _ in $(seq 1 60); do
  if answers; then
    exit 0
  fi
  sleep 1
done
echo "ensure-docker: dockerd did not answer within 60 s; the end of $log:" >&2
tail -n 20 "$log" >&2 || true
exit 4
