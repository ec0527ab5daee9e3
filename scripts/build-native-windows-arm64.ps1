<#
.SYNOPSIS
  Check a Windows on Arm (arm64) machine for a CPU-only dflash-worker setup and
  write a reusable environment script.

.DESCRIPTION
  CPU only: there is no CUDA or MPS on Windows on Arm, and the run-manager's
  launch policy runs one local rank on CPU. This helper does NOT build or
  verify the native client: the run-manager and native client use Unix
  signals and process groups (SIGTERM, SIGUSR1, setpgid) and do not compile
  for Windows today. What it does:

    1. checks the OS architecture is ARM64 (not x64 emulation);
    2. checks the Rust target `aarch64-pc-windows-msvc` is installed (rustup);
    3. checks the chosen Python is a native ARM64 build (not x64 under emulation)
       and that it imports torch, reporting torch's version;
    4. writes `dist\native\dflash-env.ps1`, which sets PYO3_PYTHON,
       DFLASH_BUILD_PYTHON_HOME, VIRTUAL_ENV and PATH for that Python, for use
       in later sessions (`. dist\native\dflash-env.ps1`), e.g. to run
       `dflash-worker` (the Python CLI) standalone on CPU.

  It has never been run in this project's CI (no Windows on Arm runner).

.PARAMETER Python
  Python interpreter to check (default: .venv\Scripts\python.exe, or $env:PYTHON).

.PARAMETER Out
  Output directory for the environment script (default: dist\native).
#>
[CmdletBinding()]
param(
    [string]$Python = $(if ($env:PYTHON) { $env:PYTHON } else { Join-Path $PSScriptRoot '..\.venv\Scripts\python.exe' }),
    [string]$Out = (Join-Path $PSScriptRoot '..\dist\native')
)

$ErrorActionPreference = 'Stop'

function Fail([string]$Message, [string]$Hint = '') {
    Write-Host "build-native-windows-arm64: error: $Message" -ForegroundColor Red
    if ($Hint) { Write-Host "hint: $Hint" }
    exit 1
}
function Log([string]$Message) { Write-Host "build-native-windows-arm64: $Message" }

# 1. Architecture: the OS, not this (possibly emulated) PowerShell process.
$osArch = [System.Runtime.InteropServices.RuntimeInformation]::OSArchitecture
if (-not $IsWindows -and $PSVersionTable.PSEdition -eq 'Core') {
    Fail "this helper is for Windows on Arm; this is $([System.Runtime.InteropServices.RuntimeInformation]::OSDescription)" 'on Linux use scripts/build-native-linux.sh, on macOS arm64 scripts/build-native-silicon.sh'
}
if ("$osArch" -ne 'Arm64') {
    Fail "the OS architecture is `"$osArch`", not Arm64" 'this helper is only for Windows on Arm'
}
Log "OS architecture: $osArch"

# 2. Rust target.
if (-not (Get-Command rustup -ErrorAction SilentlyContinue)) {
    Fail '`rustup` is not on PATH' 'install Rust from https://rustup.rs (choose the aarch64-pc-windows-msvc host)'
}
$targets = & rustup target list --installed
if ($targets -notcontains 'aarch64-pc-windows-msvc') {
    Fail 'the Rust target `aarch64-pc-windows-msvc` is not installed' 'run `rustup target add aarch64-pc-windows-msvc`'
}
Log 'Rust target aarch64-pc-windows-msvc: installed'

# 3. Python architecture and torch.
if (-not (Test-Path $Python)) {
    Fail "Python `"$Python`" does not exist" 'pass -Python C:\path\to\python.exe (a native ARM64 CPython 3.11+)'
}
$Python = (Resolve-Path $Python).Path
$probe = @'
import platform, sys, sysconfig
machine = platform.machine()
try:
    import torch
    tv = torch.__version__
except Exception as exc:
    tv = f"ERROR {type(exc).__name__}: {exc}"
print(machine)
print("%d.%d.%d" % sys.version_info[:3])
print(sys.prefix)
print(tv)
'@
$lines = @($probe | & $Python -)
if ($LASTEXITCODE -ne 0 -or $lines.Count -lt 4) {
    Fail "`"$Python`" did not run the probe" 'check the interpreter starts: & python -c "print(1)"'
}
$pyArch, $pyVer, $prefix, $torchVersion = $lines[0..3]
if ($pyArch -ne 'ARM64') {
    Fail "Python `"$Python`" is built for $pyArch, not ARM64 (it would run under emulation)" 'install the ARM64 CPython from python.org'
}
if ($torchVersion -like 'ERROR*') {
    Fail "Python `"$Python`" cannot import torch: $torchVersion" 'install a torch build for win-arm64 into that environment (CPU only)'
}
Log "Python $pyVer ($pyArch) at $Python, environment $prefix"
Log "torch $torchVersion (CPU only on Windows on Arm)"

# 4. Reusable environment script.
New-Item -ItemType Directory -Force -Path $Out | Out-Null
$envScript = Join-Path $Out 'dflash-env.ps1'
@"
# Written by scripts/build-native-windows-arm64.ps1; dot-source it: . '$envScript'
`$env:PYO3_PYTHON = '$Python'
`$env:DFLASH_BUILD_PYTHON_HOME = '$prefix'
`$env:VIRTUAL_ENV = '$prefix'
`$env:PATH = '$(Join-Path $prefix 'Scripts');' + `$env:PATH
`$env:CARGO_BUILD_TARGET = 'aarch64-pc-windows-msvc'
"@ | Set-Content -Encoding UTF8 -Path $envScript
Log "wrote $envScript"
Log 'not built: run-manager and dflash-native-client need Unix signals and do not compile for Windows yet'
