#!/usr/bin/env bash
# jaxring's checks on a real TPU VM (or a Colab TPU runtime), as one short script: what the CPU machine cannot
# settle (the TPU kernels run by Mosaic, their speed, a training run using every chip).
#
#   bash benchmarks/tpu_session.sh [SECTION ...]      # sections: env kernels flash flash-gqa train
#   JAXRING_COMMIT=abc123def456 bash benchmarks/tpu_session.sh   # on a copy without .git: the commit it was copied
#                                                     # from (git rev-parse --short=12 HEAD there) stamps the records
#
# With no SECTION it runs all of them (at most 60 + 180 + 120 + 120 + 180 s = 660 s, about ten minutes).
# Runs from the repository root with jax[tpu] installed (`JAX=0.12.0 bash tools/setup.sh dev,tpu-compile` on
# the VM, or `pip install --no-deps -e .` beside the VM's own jax). Each section has its own time limit and
# goes on after a failure; logs and JSON land in $OUT (default benchmarks/results/tpu_session/), copied into
# benchmarks/results/ by hand after review.
#   env      the TPU devices, Python and package versions
#   kernels  tests/device/test_tpu_kernels.py: the TPU flash kernels compiled by Mosaic (block_ops "pallas_tpu") against
#            the dense reference, out, lse and dq/dk/dv, for a ring step's blocks in fp32 and bf16, and the
#            zig-zag ring over every chip of the host
#   flash    benchmarks/flash_attention.py at head dim 128, 8K and 32K tokens, causal and full: jaxring's TPU
#            block compute ("jaxring-tpu") against JAX's splash attention ("splash") and XLA's attention
#   flash-gqa  the same with 32 query heads over 8 K/V heads (hidden 4096), added to the same JSON
#   train    python train.py with no flags but the model's shape: the ring over every chip (--plan auto), the
#            TPU block compute chosen by "auto", bf16; Llama-3-8B's layer shape (4 of its 32 layers) at 32K tokens
set -u
OUT=${OUT:-benchmarks/results/tpu_session}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 JAX_PLATFORMS=  # every backend (tests default to the CPU)
PY=${PY:-python3}
LOG="$OUT/session.log"

run() {  # run NAME SECONDS COMMAND...: one section, its output appended to the log
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "=== $name: $*" | tee -a "$LOG"
    timeout "$limit" "$@" >>"$LOG" 2>&1
    echo "=== $name: exit $? after $((SECONDS - start)) s" | tee -a "$LOG"
}

sections=${*:-env kernels flash flash-gqa train}
for s in $sections; do
    case $s in
    env)
        run env 60 "$PY" -c '
import jax, jaxlib, flax, optax, orbax.checkpoint as ocp, sys
print(sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__, "flax", flax.__version__,
      "optax", optax.__version__, "orbax", ocp.__version__, jax.devices())
import jaxring, jaxring.models.gpt; from jaxring.kernels.block_compute import resolve_name
print("jaxring imports; auto block compute:", resolve_name("auto"))'
        ;;
    kernels)
        run kernels 180 "$PY" -m pytest -q -p no:cacheprovider -n 0 tests/device/test_tpu_kernels.py
        ;;
    flash)
        run flash 120 "$PY" benchmarks/flash_attention.py --seqs 8192 32768 --head-dims 128 \
            --impls jaxring-tpu splash xla --runs 5 --out "$OUT/flash_attention.json"
        ;;
    flash-gqa)
        run flash-gqa 120 "$PY" benchmarks/flash_attention.py --seqs 8192 32768 --head-dims 128 --hidden 4096 \
            --kv-heads 8 --impls jaxring-tpu splash xla --runs 5 --merge --out "$OUT/flash_attention.json"
        ;;
    train)
        run train 180 "$PY" train.py --preset llama3-8b --override num_layers=4 --seq-len 32768 --batch-size 1 \
            --plan auto --steps 4 --log-every 1 --sample-tokens 0 --no-eval-at-end \
            --metrics-file "$OUT/train/metrics.jsonl" --out-dir "$OUT/train"
        ;;
    *) echo "unknown section $s (env kernels flash flash-gqa train)" | tee -a "$LOG" ;;
    esac
done
