#!/usr/bin/env bash
# The one prepared check for an Apple Silicon Mac (docs/native-silicon.md, "The Mac check"): what
# .github/workflows/native-silicon.yml runs, plus the hybrid targets on MPS, from one command.
#
#   scripts/mac-check.sh
#   MAC_CHECK_HYBRID_ARGS="--families qwen3_5_moe" scripts/mac-check.sh   # less memory
#
# 1. installs the project (`make install`; torch's macOS wheel has MPS);
# 2. `scripts/build-native-silicon.sh`: the standalone `dflash-native-client` and `run-manager` a Mac
#    provider runs (rpaths checked with otool, a `noop` job run through the native client under
#    `env -i`), and the MPS bf16 probe;
# 3. `pytest -m mps` with `DFLASH_REQUIRE_MPS=1 PYTORCH_ENABLE_MPS_FALLBACK=0`: no silent CPU
#    fallback, a missing MPS kernel fails;
# 4. `bench/hybrid_check.py --device mps`: in the environment the native client embeds, the same
#    stage as scripts/gpu-check.sh (a full-width `qwen3_5_moe`, hidden 2048 with 256 experts, 8
#    routed + 1 shared, and a full-width `qwen3_5`, hidden 5120, 4 layers each, random weights built
#    on MPS): capture and online-training throughput, speculative generation lossless against the
#    same kernels' greedy decoding, the loop-cost table (rollback per verify step), and which
#    kernels ran (transformers' torch reference on MPS). Capture runs in bf16 where the probe allows
#    it, else float16. Memory: the MoE target is 6.7 GB in bf16 and 13.5 GB in float32 (the
#    speculative phase), the dense one's draft trains with about 29 GB of AdamW state: a Mac with
#    48 GB of unified memory or more; on a smaller one, pass `--families qwen3_5_moe`.
# Exit status: 0 when every step passed; 3 when this is not an Apple Silicon Mac.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname -s)" != Darwin ] || [ "$(uname -m)" != arm64 ]; then
    echo "mac-check: this is \`$(uname -s) $(uname -m)\`, not an Apple Silicon Mac (Darwin arm64); this check is for Macs (scripts/gpu-check.sh is for NVIDIA machines)" >&2
    exit 3
fi
start=$(date +%s)
echo "== machine"
sw_vers
echo "chip: $(sysctl -n machdep.cpu.brand_string); memory: $(( $(sysctl -n hw.memsize) / 1073741824 )) GiB"

echo "== install"
make install

echo "== native client"
scripts/build-native-silicon.sh --python .venv/bin/python --out dist/native

export DFLASH_REQUIRE_MPS=1 PYTORCH_ENABLE_MPS_FALLBACK=0
echo "== pytest -m mps"
.venv/bin/python -m pytest -q -m mps -ra -p no:cacheprovider tests

echo "== bench/hybrid_check.py (MPS)"
dtype=$(.venv/bin/python -c "from dflash_worker.device import mps_bf16_supported; print('bfloat16' if mps_bf16_supported()[0] else 'float16')")
# shellcheck disable=SC2086  # the extra arguments are meant to split
.venv/bin/python bench/hybrid_check.py --device mps --scale full --dtype "$dtype" ${MAC_CHECK_HYBRID_ARGS:-}

echo "== mac-check passed in $(( $(date +%s) - start )) s"
