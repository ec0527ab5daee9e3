#!/usr/bin/env bash
# The one prepared check for a machine with NVIDIA GPUs (docs/testing.md, "GPU check").
#
#   scripts/gpu-check.sh            # under 10 minutes on one H200-class GPU
#   GPU_CHECK_BENCH_ARGS="--layers 8" scripts/gpu-check.sh   # a smaller target
#
# 1. installs the project (`make install`; torch's CUDA wheels from PyPI);
# 2. `pytest -m cuda`: the tests of the CUDA paths (placement per LOCAL_RANK, compiled flex
#    attention against SDPA, CUDA against CPU, exact resume on CUDA, two NCCL ranks against one
#    when there are two GPUs), which are skipped on machines without a GPU;
# 3. `bench/gpu.py`: capture, training and speculative generation on a full-width random Qwen3
#    target (hidden 4096, 36 layers, bf16) with a DFlash2 draft of the released geometry, on 1 GPU
#    and on every GPU: absolute throughput, peak memory and the scaling ratio;
# 4. `bench/verify_cost.py`: on the same full-width geometry, whether a 16-token block verify costs
#    about one greedy step here (issue 16's speedup goal is reachable only where its ceiling >= 1);
# 5. `bench/hybrid_check.py`: the hybrid targets the seeds ship, with flash-linear-attention's Gated
#    DeltaNet kernels (requirements/cuda.txt, installed into dist/gpu-check/cuda-kernels and put on
#    PYTHONPATH for this stage alone: `.venv` stays without them, as `make install` leaves it): a
#    full-width `qwen3_5_moe` (hidden 2048, 256 experts, 8 routed + 1 shared, 4 layers: 3 Gated
#    DeltaNet + 1 attention; 3.4 B parameters, 6.7 GB bf16, 13.5 GB in float32 for the speculative
#    phase) and a full-width `qwen3_5` (hidden 5120, 4 layers; 1.5 B, 3.0 GB bf16; its standard
#    draft, 1.8 B, trains with about 29 GB of AdamW state), random weights
#    built on the GPU: capture and online-training throughput, speculative generation lossless
#    against the same kernels' greedy decoding, the loop-cost table (rollback per verify step), and
#    which kernels ran. docs/provider-quickstart.md, "Reading the GPU check's output".
#    GPU_CHECK_HYBRID_ARGS passes options to it (e.g. "--families qwen3_5_moe --layers 8").
# Exit status: 0 when every step passed; 3 when this machine has no NVIDIA GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-check: no NVIDIA GPU here (nvidia-smi missing or lists none); this check is for GPU machines" >&2
    exit 3
fi
start=$(date +%s)
echo "== machine"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
echo "cpus: $(nproc); load: $(cut -d' ' -f1-3 /proc/loadavg)"

echo "== install"
make install

echo "== pytest -m cuda"
.venv/bin/python -m pytest -q -m cuda -p no:cacheprovider tests

echo "== bench/gpu.py"
# shellcheck disable=SC2086  # the extra arguments are meant to split
.venv/bin/python bench/gpu.py --device cuda ${GPU_CHECK_BENCH_ARGS:-}

echo "== bench/verify_cost.py"
.venv/bin/python bench/verify_cost.py --device cuda --dtype bfloat16 --hidden 4096 --layers 36 --heads 32 \
    --kv-heads 8 --head-dim 128 --intermediate 12288 --vocab 151936 --draft standard --draft-layers 5 \
    --block-size 16 --context 512 --repeat 30

echo "== bench/hybrid_check.py (flash-linear-attention kernels)"
kernels=dist/gpu-check/cuda-kernels
rm -rf "$kernels"
.venv/bin/python -m pip install --quiet --no-deps --target "$kernels" -r requirements/cuda.txt
# shellcheck disable=SC2086  # the extra arguments are meant to split
PYTHONPATH="$PWD/$kernels" .venv/bin/python bench/hybrid_check.py --device cuda --scale full ${GPU_CHECK_HYBRID_ARGS:-}

echo "== gpu-check passed in $(( $(date +%s) - start )) s"
