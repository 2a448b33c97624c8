#!/usr/bin/env bash
# jaxring's set-up on a fresh machine: a virtual environment `.venv` made with a Python >= 3.12 found here,
# and jaxring installed into it (editable) with the extras named.
#
#   bash tools/setup.sh                  # .venv with the dev extra (tests, linters, notebooks' runner)
#   bash tools/setup.sh dev,cuda12       # extras, comma-separated, as pip names them
#   VENV=DIR JAX=0.11.2 bash tools/setup.sh dev   # another folder; a jax pinned before jaxring (CI's lower end)
#   PYTHON=/path/to/python3.12 bash tools/setup.sh  # this Python, not the search
#
# The Python: $PYTHON if set, else a Python 3.12 (python3.12, python3 or python on PATH, else pyenv's newest
# 3.12.x), else any newer one found the same way. A jax already installed in
# the environment stays as it is when it is in jaxring's range (pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-dev}
venv=${VENV:-.venv}

# exits 0 when the Python $1 runs and is >= 3.12 (with $2 = 3.12: is 3.12 exactly)
new_enough() {
    "$1" -c "import sys; sys.exit(sys.version_info < (3, 12) or ('${2:-}' != '' and sys.version_info[:2] != (3, 12)))" \
        >/dev/null 2>&1
}

# Python 3.12 first (the version Colab and the lent GPU machines run), then any newer one
find_python() {
    if [ -n "${PYTHON:-}" ]; then
        new_enough "$PYTHON" && { echo "$PYTHON"; return; }
        echo "error: PYTHON=$PYTHON is not a Python >= 3.12 (jaxring needs it: jax >= 0.11 does)" >&2
        exit 1
    fi
    local candidates=() candidate exact
    for candidate in python3.12 python3 python python3.13 python3.14; do
        command -v "$candidate" >/dev/null && candidates+=("$(command -v "$candidate")")
    done
    if command -v pyenv >/dev/null; then
        local root version
        root=$(pyenv root)
        for version in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.[0-9]+\.[0-9]+$' | sort -rV); do
            candidates+=("$root/versions/$version/bin/python")
        done
    fi
    for exact in 3.12 ""; do
        for candidate in "${candidates[@]}"; do
            if new_enough "$candidate" "$exact"; then
                echo "$candidate"
                return
            fi
        done
    done
    local found="none"
    command -v python3 >/dev/null && found="python3 is $(python3 -c 'import platform; print(platform.python_version())' 2>/dev/null)"
    echo "error: jaxring needs Python >= 3.12 (jax >= 0.11 does) and found none ($found); install Python 3.12 or set PYTHON=/path/to/python3.12" >&2
    exit 1
}

if [ -x "$venv/bin/python" ] && new_enough "$venv/bin/python"; then
    python=$venv/bin/python
    echo "setup: using $venv (Python $("$python" -c 'import platform; print(platform.python_version())'))"
else
    base=$(find_python)
    echo "setup: making $venv with Python $("$base" -c 'import platform; print(platform.python_version())') ($base)"
    rm -rf "$venv"
    "$base" -m venv "$venv"
    python=$venv/bin/python
fi
"$python" -m pip install -q --upgrade pip
if [ -n "${JAX:-}" ]; then
    "$python" -m pip install -q "jax==$JAX"
fi
"$python" -m pip install -q -e ".[$extras]"
"$python" -c 'import jax, sys; print(f"setup: jaxring installed in '"$venv"' (Python {sys.version.split()[0]}, jax {jax.__version__}); activate it with: . '"$venv"'/bin/activate")'
