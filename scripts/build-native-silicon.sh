#!/usr/bin/env bash
# Build standalone `dflash-native-client` and `run-manager` binaries on macOS
# arm64 (Apple Silicon) against a chosen Python environment:
#
#   - the Python must be arm64 and import torch; its version, MPS availability
#     and an MPS bfloat16 probe are reported (DFLASH_MPS_BF16 overrides the probe
#     in the run-manager; see docs/native-silicon.md);
#   - `cargo build --release` with PYO3_PYTHON set to it;
#   - `install_name_tool -add_rpath` for Python's LIBDIR (libpython) and torch/lib,
#     verified with `otool -l` (LC_RPATH);
#   - the environment's prefix is recorded in the native client at build time
#     (DFLASH_BUILD_PYTHON_HOME), so it finds the site-packages without VIRTUAL_ENV;
#   - verified by running a `noop` job under `env -i PATH=/usr/bin:/bin`.
#
# Output: DIR/dflash-native-client, DIR/run-manager, DIR/build-info.json
# (DIR defaults to dist/native/).
#
# Usage: scripts/build-native-silicon.sh [--python PATH] [--out DIR]
# Environment: PYTHON (default .venv/bin/python), CARGO_TARGET_DIR (reused when set).
# Not run in this project's CI (it needs a Mac); .github/workflows/native-silicon.yml
# runs it on a self-hosted Apple Silicon runner.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/lib/native-build.sh
. "$root/scripts/lib/native-build.sh"
parse_args "$@"

os=$(uname -s)
arch=$(uname -m)
[ "$os" = Darwin ] && [ "$arch" = arm64 ] || die "this script builds for macOS on Apple Silicon (Darwin arm64); this is \`$os $arch\`" \
  "on Linux use scripts/build-native-linux.sh; under Rosetta, run it from an arm64 shell (\`arch -arm64 bash\`)"
for tool in cargo install_name_tool otool; do
  command -v "$tool" >/dev/null || die "\`$tool\` is not on PATH" "install Rust with rustup and the Xcode command line tools (\`xcode-select --install\`)"
done
check_python

facts=$("$python" - <<'EOF'
import os, platform, sys, sysconfig
if platform.machine() != "arm64":
    sys.exit(f"this Python is built for `{platform.machine()}`, not arm64 (an x86_64 Python runs under Rosetta without MPS)")
try:
    import torch
except Exception as exc:  # report any import failure, not only ImportError
    sys.exit(f"cannot import torch: {type(exc).__name__}: {exc}")
mps = torch.backends.mps.is_available()
try:
    # The worker's own probe (a bfloat16 matmul on MPS), ignoring any override.
    from dflash_worker.device import mps_bf16_supported
    ok, how = mps_bf16_supported({})
    bf16 = f"{ok} ({how})"
except Exception as exc:
    bf16 = f"unknown ({type(exc).__name__}: {exc})"
libdir = sysconfig.get_config_var("LIBDIR") or ""
torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
print("\t".join([
    "%d.%d.%d" % sys.version_info[:3], sys.prefix, libdir, str(int(sysconfig.get_config_var("Py_ENABLE_SHARED") or 0)),
    str(int(sysconfig.get_config_var("PYTHONFRAMEWORK") != "")), torch.__version__, str(mps), bf16, torch_lib,
]))
EOF
) || die "\`$python\` is not a usable arm64 Python with torch (see above)" "install the project's environment with \`make install\`"

IFS=$'\t' read -r pyver prefix libdir shared framework torch_version mps bf16 torch_lib <<<"$facts"
log "python $pyver at $python (environment $prefix)"
log "torch $torch_version, MPS available: $mps, MPS bfloat16 probe: $bf16"
[ "$mps" = True ] || log "warning: MPS is not available; jobs will need \`--device cpu\` (DFLASH_REQUIRE_MPS=1 makes them fail instead)"
[ "$shared" = 1 ] || [ "$framework" = 1 ] || die "\`$python\` has no shared libpython or framework build; the native client embeds it" \
  "use python.org's installer, Homebrew's python@3.11, or pyenv with PYTHON_CONFIGURE_OPTS=--enable-shared"
[ -d "$libdir" ] || die "Python's LIBDIR \`$libdir\` does not exist"
[ -d "$torch_lib" ] || die "torch's library directory \`$torch_lib\` does not exist"

build_release build --release --locked -p dflash-native-client --bin dflash-native-client

# Add each rpath once (install_name_tool refuses duplicates), then re-sign:
# arm64 binaries must carry a valid (ad-hoc) signature after being modified.
rpaths() { otool -l "$1" | awk '/cmd LC_RPATH/ {getline; getline; print $2}'; }
for want in "$libdir" "$torch_lib"; do
  if ! rpaths "$nc" | grep -qxF "$want"; then
    install_name_tool -add_rpath "$want" "$nc"
  fi
done
codesign --force --sign - "$nc" 2>/dev/null || log "warning: ad-hoc codesign failed; macOS may refuse to run the binary"
found=$(rpaths "$nc" | tr '\n' ':')
for want in "$libdir" "$torch_lib"; do
  case ":$found" in
    *":$want:"*) ;;
    *) die "\`otool -l $nc\` has no LC_RPATH \`$want\` (found \`$found\`)" ;;
  esac
done
log "rpaths: $found"

verify_noop_job "$nc"

write_build_info macos-arm64 "$found" "mps_available:bool=$mps" "mps_bf16_probe=$bf16"
