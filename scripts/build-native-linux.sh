#!/usr/bin/env bash
# Build standalone `dflash-native-client` and `run-manager` binaries (Linux)
# against a chosen Python environment, so they run with an empty environment:
#
#   - the Python must import torch (its version and CUDA availability are reported);
#   - `cargo build --release` with PYO3_PYTHON set to it;
#   - link-time rpaths (RUNPATH) to Python's LIBDIR (libpython) and to torch/lib;
#   - the environment's prefix is recorded in the native client at build time
#     (DFLASH_BUILD_PYTHON_HOME), so it finds the site-packages without VIRTUAL_ENV;
#   - verified with `readelf -d` and by running a `noop` job under `env -i PATH=...`.
#
# Output: DIR/dflash-native-client, DIR/run-manager, DIR/build-info.json
# (DIR defaults to dist/native/). The binaries keep working while the Python
# environment stays where it was at build time.
#
# Usage: scripts/build-native-linux.sh [--python PATH] [--out DIR]
# Environment: PYTHON (default .venv/bin/python), CARGO_TARGET_DIR (reused when set).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/lib/native-build.sh
. "$root/scripts/lib/native-build.sh"
parse_args "$@"

[ "$(uname -s)" = Linux ] || die "this script builds for Linux; this is \`$(uname -s)\`" \
  "on macOS arm64 use scripts/build-native-silicon.sh"
command -v cargo >/dev/null || die "\`cargo\` is not on PATH" "install Rust with rustup (https://rustup.rs)"
command -v readelf >/dev/null || die "\`readelf\` is not on PATH" "install binutils"
check_python

# One line of facts from the chosen Python (tab-separated), or a clear failure.
facts=$("$python" - <<'EOF'
import sys, sysconfig
try:
    import torch
except Exception as exc:  # report any import failure, not only ImportError
    sys.exit(f"cannot import torch: {type(exc).__name__}: {exc}")
import os
libdir = sysconfig.get_config_var("LIBDIR") or ""
shared = sysconfig.get_config_var("Py_ENABLE_SHARED") or 0
torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
print("\t".join([
    "%d.%d.%d" % sys.version_info[:3], sys.prefix, libdir, str(int(shared)),
    torch.__version__, str(torch.cuda.is_available()), torch.version.cuda or "none", torch_lib,
]))
EOF
) || die "\`$python\` cannot import torch (see above)" "install the project's environment with \`make install\`"

IFS=$'\t' read -r pyver prefix libdir shared torch_version cuda_available cuda_version torch_lib <<<"$facts"
log "python $pyver at $python (environment $prefix)"
log "torch $torch_version, CUDA build $cuda_version, CUDA available: $cuda_available"
[ "$shared" = 1 ] || die "\`$python\` has no shared libpython (Py_ENABLE_SHARED=0); the native client embeds it" \
  "use a Python built with --enable-shared (pyenv: PYTHON_CONFIGURE_OPTS=--enable-shared pyenv install 3.11)"
[ -d "$libdir" ] || die "Python's LIBDIR \`$libdir\` does not exist"
[ -d "$torch_lib" ] || die "torch's library directory \`$torch_lib\` does not exist"
case "$libdir$torch_lib$prefix" in
  *[[:space:],]*) die "paths with spaces or commas cannot be rpaths here: \`$libdir\`, \`$torch_lib\`, \`$prefix\`" ;;
esac

# `cargo rustc` passes the rpath flags to the final binary only, so the
# dependencies stay shared with any other release build in CARGO_TARGET_DIR.
build_release rustc --release --locked -p dflash-native-client --bin dflash-native-client -- \
  -C "link-arg=-Wl,-rpath,$libdir" -C "link-arg=-Wl,-rpath,$torch_lib"

# Verify the rpaths.
dyn=$(readelf -d "$nc")
runpath=$(printf '%s\n' "$dyn" | sed -n 's/.*(R\(UN\)\{0,1\}PATH).*\[\(.*\)\]/\2/p' | tr '\n' ':')
for want in "$libdir" "$torch_lib"; do
  case ":$runpath:" in
    *":$want:"*) ;;
    *) die "\`readelf -d $nc\` has no RUNPATH/RPATH entry \`$want\` (found \`$runpath\`)" ;;
  esac
done
log "rpaths: $runpath"

# Verify it runs a `noop` job with nothing in the environment but PATH.
verify_noop_job "$nc"

write_build_info "linux-$(uname -m)" "$runpath" "torch_cuda=$cuda_version" "cuda_available:bool=$cuda_available"
