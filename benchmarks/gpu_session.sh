#!/usr/bin/env bash
# jaxring's checks on one real NVIDIA GPU, as one short script (a lent GPU machine is held by the minute).
#
#   bash benchmarks/gpu_session.sh [SECTION ...]      # sections: env kernels flash flash-gqa tokamax train
#                                                     #           train-no-offload weights weights-no-offload
#                                                     #           weights-blocks mfu
#   JAXRING_COMMIT=abc123def456 bash benchmarks/gpu_session.sh   # on a copy without .git: the commit it was copied
#                                                     # from (git rev-parse --short=12 HEAD there) stamps the records
#
# With no SECTION it runs env kernels flash flash-gqa tokamax (the cuDNN session of issue 34 and the tokamax
# rows; at most 60 + 200 + 120 + 120 + 90 s = 590 s, under 10 minutes); the training and MFU sections run when
# named.
#
# Runs from the repository root with the machine's own JAX (its CUDA plugin) and jaxring installed there
# (`pip install --no-deps -e .`: train.py finds the model families through the package's entry points). Each
# section has its own time limit and goes on after a failure; logs and JSON land in $OUT (default
# benchmarks/results/gpu_session/), copied into benchmarks/results/ by hand after review.
#   env      nvidia-smi, Python and package versions
#   kernels  tests/device/test_gpu_kernels.py: the compiled Pallas flash kernel and the cuDNN block compute (block_ops
#            "cudnn": zig-zag/striped block positions, GQA, a window, documents falling back) against the dense
#            reference, forward and dq/dk/dv (the tokamax cases run in the tokamax section)
#   train    python train.py on the GPU: Llama-3-8B's layer shape (4 of its 32 layers, its 128K vocabulary),
#            64K tokens, bf16, remat full, tiled loss and MLP, layer inputs offloaded to host memory; the
#            metrics (peak device memory, step time) beside the estimate train.py prints
#   flash    benchmarks/flash_attention.py at head dim 128, 8K and 32K tokens, causal and full: jaxring's Pallas
#            kernel, jaxring's cuDNN block compute ("jaxring-cudnn") and cuDNN called directly
#   flash-gqa  the same with GQA, 32 query heads over 8 K/V heads (hidden 4096), added to the same JSON
#   tokamax  the optional tokamax package (0.0.17; installed first from .whl/tokamax/*.whl if that folder is there:
#            `pip download tokamax==0.0.17 qwix xprof ... -d .whl/tokamax` here, about 40 MB, carried to the machine,
#            which reaches no index): tests/device/test_gpu_kernels.py's tokamax cases with ring-block positions and a
#            window (block_ops "tokamax": the Mosaic GPU kernels given the global lse and the stand-in output; 50 s)
#            and flash_attention.py's rows "jaxring-tokamax" (the block compute), "tokamax"
#            (tokamax.dot_product_attention called directly) and "jaxring" at 8K, d 128, GQA 32:8, causal and full
#            (40 s), added to the same JSON; skipped in one line where tokamax does not import
#   weights  one GPU, 4 of Llama-3-8B's layers at 262,144 tokens with the weights, gradients and AdamW state
#            in host memory (--offload layer_inputs+weights); weights-no-offload: the same with them on the device;
#            weights-blocks: the same offload with recompute blocks of 2 layers (--remat-layers 2: the blocks' inputs
#            and, in a block's backward, its layers' in host memory)
#   mfu      benchmarks/train_step.py --gpu-mfu: gpt2-124m and 1b at 8K tokens, tokens/s and MFU
set -u
OUT=${OUT:-benchmarks/results/gpu_session}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=.95 JAX_PLATFORMS=  # every backend (the tests would default to the CPU)
PY=${PY:-python3}
LOG="$OUT/session.log"

run() {  # run NAME SECONDS COMMAND...: one section, its output appended to the log
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "=== $name: $*" | tee -a "$LOG"
    timeout "$limit" "$@" >>"$LOG" 2>&1
    echo "=== $name: exit $? after $((SECONDS - start)) s" | tee -a "$LOG"
}

sections=${*:-env kernels flash flash-gqa tokamax}
for s in $sections; do
    case $s in
    env)
        run env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $PY -c '
import jax, jaxlib, flax, optax, orbax.checkpoint as ocp, sys
print(sys.version.split()[0], \"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__, \"flax\", flax.__version__,
      \"optax\", optax.__version__, \"orbax\", ocp.__version__, jax.devices())
import jaxring, jaxring.models.gpt; print(\"jaxring imports\")'"
        ;;
    kernels)
        run kernels 200 "$PY" -m pytest -q -p no:cacheprovider tests/device/test_gpu_kernels.py -k "not tokamax"
        ;;
    train)
        run train 170 "$PY" train.py --preset llama3-8b --override num_layers=4 --seq-len 65536 --batch-size 1 \
            --precision bf16 --remat full --loss-tile 4096 --mlp-tile 4096 --offload layer_inputs --steps 4 \
            --log-every 1 --sample-tokens 0 --no-eval-at-end --out-dir "$OUT/train"
        ;;
    train-no-offload)  # the same run with its layer inputs kept on the device
        run train-no-offload 120 "$PY" train.py --preset llama3-8b --override num_layers=4 --seq-len 65536 \
            --batch-size 1 --precision bf16 --remat full --loss-tile 4096 --mlp-tile 4096 --offload none --steps 4 \
            --log-every 1 --sample-tokens 0 --no-eval-at-end --out-dir "$OUT/train-no-offload"
        ;;
    weights | weights-no-offload | weights-blocks)
        # issue 35: one GPU, a 4-layer Llama-3-8B-shaped model at 262,144 tokens with the fp32 weights, their
        # gradients and the AdamW state in host memory (--offload layer_inputs+weights), against the same run
        # with them on the device (--offload layer_inputs); peak device memory and step time in the metrics,
        # the process's peak resident host memory from /usr/bin/time -v (pinned buffers included)
        offload=layer_inputs+weights
        [ "$s" = weights-no-offload ] && offload=layer_inputs
        blocks=1
        [ "$s" = weights-blocks ] && blocks=2
        timed=()
        [ -x /usr/bin/time ] && timed=(/usr/bin/time -v)
        run "$s" 240 "${timed[@]}" "$PY" train.py --preset llama3-8b --override num_layers=4 --seq-len 262144 \
            --batch-size 1 --precision bf16 --remat full --remat-layers "$blocks" --loss-tile 4096 --mlp-tile 4096 \
            --offload "$offload" --steps 3 --log-every 1 --sample-tokens 0 --no-eval-at-end \
            --metrics-file "$OUT/$s/metrics.jsonl" --out-dir "$OUT/$s"
        ;;
    flash)
        run flash 120 "$PY" benchmarks/flash_attention.py --seqs 8192 32768 --head-dims 128 \
            --impls jaxring jaxring-cudnn cudnn --runs 5 --out "$OUT/flash_attention.json"
        ;;
    flash-gqa)
        run flash-gqa 120 "$PY" benchmarks/flash_attention.py --seqs 8192 32768 --head-dims 128 --hidden 4096 \
            --kv-heads 8 --impls jaxring jaxring-cudnn cudnn --runs 5 --merge --out "$OUT/flash_attention.json"
        ;;
    tokamax)
        if [ -d .whl/tokamax ]; then
            "$PY" -m pip install -q --no-deps --no-index .whl/tokamax/*.whl >>"$LOG" 2>&1
        fi
        if ! "$PY" -c "import tokamax" >>"$LOG" 2>&1; then
            echo "=== tokamax: skipped (tokamax does not import; see the log)" | tee -a "$LOG"
            continue
        fi
        run tokamax-kernels 50 "$PY" -m pytest -q -p no:cacheprovider tests/device/test_gpu_kernels.py \
            -k "tokamax and (zigzag or striped or window)"
        run tokamax-flash 40 "$PY" benchmarks/flash_attention.py --seqs 8192 --head-dims 128 --hidden 4096 \
            --kv-heads 8 --impls jaxring jaxring-tokamax tokamax --runs 5 --merge --out "$OUT/flash_attention.json"
        ;;
    mfu)
        run mfu 180 "$PY" benchmarks/train_step.py --gpu-mfu --steps 5 --out "$OUT/train_step_gpu.json"
        ;;
    *) echo "unknown section $s (env kernels flash flash-gqa tokamax train train-no-offload weights weights-no-offload weights-blocks mfu)" | tee -a "$LOG" ;;
    esac
done
