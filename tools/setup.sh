#!/usr/bin/env bash
# jaxring's set-up on a fresh machine: a virtual environment `.venv` made with a Python >= 3.12 found here,
# and jaxring installed into it (editable) with the extras named.
#
#   bash tools/setup.sh                  # .venv with the dev extra (tests, linters, notebooks' runner)
#   bash tools/setup.sh dev,cuda12       # extras, comma-separated, as pip names them
#   VENV=DIR JAX=0.11.2 bash tools/setup.sh dev   # another folder; a jax pinned before jaxring (CI's lower end)
#   PYTHON=/path/to/python3.12 bash tools/setup.sh  # this Python, not the search
#
# The Python: $PYTHON if set, else the first of python3.12, python3.13, python3.14, python3 and python on PATH
# that runs and is >= 3.12, else the newest >= 3.12 among pyenv's installed versions. A jax already installed in
# the environment stays as it is when it is in jaxring's range (pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-dev}
venv=${VENV:-.venv}

new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

find_python() {
    if [ -n "${PYTHON:-}" ]; then
        new_enough "$PYTHON" && { echo "$PYTHON"; return; }
        echo "error: PYTHON=$PYTHON is not a Python >= 3.12 (jaxring needs it: jax >= 0.11 does)" >&2
        exit 1
    fi
    local candidate
    for candidate in python3.12 python3.13 python3.14 python3 python; do
        if command -v "$candidate" >/dev/null && new_enough "$candidate"; then
            command -v "$candidate"
            return
        fi
    done
    if command -v pyenv >/dev/null; then
        local root version
        root=$(pyenv root)
        for version in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9]|[2-9][0-9])(\.[0-9]+)?$' | sort -rV); do
            if new_enough "$root/versions/$version/bin/python"; then
                echo "$root/versions/$version/bin/python"
                return
            fi
        done
    fi
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
