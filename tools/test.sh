#!/usr/bin/env bash
# jaxring's tests, in lanes, the fast one first (README: Tests). Run it in the set-up's environment.
#
#   bash tools/test.sh                 # lint, then the unit lane, then the rest: what CI runs
#   bash tools/test.sh unit            # one or more lanes, in the order given
#
# Lanes:
#   lint      ruff, its formatter's check, the import layers (lint-imports)
#   unit      tests/unit/<package>/: each package against its oracle, less the tests marked `heavy` (the fast
#             lane: a few minutes)
#   rest      the unit tests marked `heavy` (whole train steps, strategy matrices, TPU kernels interpreted on 8
#             devices), tests/integration (train.py, README and docs commands, notebooks, faults),
#             tests/compiled and tests/device (these skip without the compile-only extras or a GPU/TPU)
#   compiled  tests/compiled with its slow cases (-m ""): run it in a venv with the gpu-compile or tpu-compile
#             extra (.ci/run's compile lane)
# Tests marked `slow` stay out of unit and rest; `python -m pytest -m ""` runs everything at once.
set -euo pipefail
cd "$(dirname "$0")/.."
for lane in "${@:-lint unit rest}"; do
    for one in $lane; do
        echo "== tools/test.sh: $one"
        case $one in
            lint) ruff check . && ruff format --check . && lint-imports ;;
            unit) python -m pytest -q -m "not slow and not heavy" tests/unit ;;
            rest) python -m pytest -q -m "not slow and (heavy or not unit)" tests ;;
            compiled) python -m pytest -q -m "" tests/compiled ;;
            *) echo "error: tools/test.sh: unknown lane '$one' (lint, unit, rest, compiled)" >&2; exit 2 ;;
        esac
    done
done
