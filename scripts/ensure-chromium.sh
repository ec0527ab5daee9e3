#!/usr/bin/env bash
# Make sure Debian's headless Chromium and its WebDriver are installed, for the status
# page's browser test (tests/coordinator/test_status_browser.py calls this script).
#
# Exit 0 when `chromium` and `chromedriver` are on PATH (installing them with apt-get
# when running as root); exit 3 with the reason on stderr when they are missing and
# cannot be installed here (not root, no apt-get), so the caller can skip and say why.
# No browser build is downloaded from anywhere but Debian's archive.
set -euo pipefail

have() { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; }

if have; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "ensure-chromium: chromium and chromium-driver are not installed and this is not root; install them with: apt-get install -y chromium chromium-driver" >&2
  exit 3
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure-chromium: chromium and chromium-driver are not installed and there is no apt-get here" >&2
  exit 3
fi
echo "ensure-chromium: installing Debian's chromium and chromium-driver (apt-get)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >&2
apt-get install -y -qq --no-install-recommends chromium chromium-driver >&2
if ! have; then
  echo "ensure-chromium: apt-get finished but chromium or chromedriver is still not on PATH" >&2
  exit 3
fi
