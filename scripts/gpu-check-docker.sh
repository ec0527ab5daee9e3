#!/usr/bin/env bash
# Docker launch mode on an NVIDIA machine: build the CUDA flavor of docker/Dockerfile and run
# the e2e pipeline job (the tiny world of tests/e2e) in it with `--gpus all` and every hardening
# flag, through `run-manager --local --launch-mode docker --device cuda`.
#
#   scripts/gpu-check-docker.sh        # needs network (the CUDA base image, PyPI, rustup)
#
# Requirements: an NVIDIA GPU and driver, Docker with the NVIDIA Container Toolkit, a BuildKit
# docker CLI (buildx), and `make install` done (the host's run-manager and the world builder).
# Prints the build time, the image size, torch's view of the GPU inside the hardened container,
# and the job's summary. Exit 0 when the job succeeded; 3 when this machine has no NVIDIA GPU
# or no Docker engine with GPU support.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check-docker: no NVIDIA GPU here (nvidia-smi missing or lists none)" >&2
  exit 3
fi
scripts/ensure-docker.sh || exit 3
export DOCKER_BUILDKIT=1
image=${DFLASH_CUDA_IMAGE:-dflash-worker-cuda:0.1.0}
work=${GPU_CHECK_WORK:-$PWD/dflash-work/gpu-check-docker}
rm -rf "$work" && mkdir -p "$work"

echo "== machine"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
docker version --format 'docker client {{.Client.Version}}, server {{.Server.Version}}'

echo "== build $image (FLAVOR=cuda)"
t0=$(date +%s)
docker build -f docker/Dockerfile --build-arg FLAVOR=cuda \
  --build-arg DFLASH_GIT_COMMIT="$(git rev-parse --short=12 HEAD)" -t "$image" .
echo "built in $(( $(date +%s) - t0 )) s; size $(docker image inspect --format '{{.Size}}' "$image") bytes"
docker history "$image"

echo "== torch in the hardened container"
docker run --rm --gpus all --cap-drop ALL --security-opt no-new-privileges --read-only \
  --tmpfs /tmp:rw,nosuid,nodev,exec --shm-size 8g --user 10001:10001 --env HOME=/tmp \
  --entrypoint python "$image" -c \
  "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0))"

echo "== the e2e pipeline job with --gpus all"
.venv/bin/python - "$work" "$image" <<'EOF'
import json, os, sys
sys.path[:0] = ["tests/e2e", "tests"]  # e2e_helpers imports tests/launchers.py and tests/prewarmed.py
from e2e_helpers import pipeline_spec
from dflash_worker.testing.world import build_world

work, image = sys.argv[1], sys.argv[2]
world = build_world(os.path.join(work, "world"))
for d, _, files in os.walk(world.root):
    os.chmod(d, 0o755)
    for f in files:
        os.chmod(os.path.join(d, f), 0o644)
with open(os.path.join(work, "run.json"), "w") as f:
    json.dump({"name": "gpu-check-docker", "spec": pipeline_spec(world), "image": image}, f)
EOF
.venv/bin/run-manager --local --json --work-dir "$work/work" --spec "$work/run.json" \
  --launch-mode docker --device cuda --docker-mount "$work/world" | tee "$work/summary.json"
.venv/bin/python -c "import json,sys; s=json.load(open(sys.argv[1])); j=s['jobs'][0]; print('job', j['state']); sys.exit(0 if j['state']=='succeeded' else 1)" "$work/summary.json"
