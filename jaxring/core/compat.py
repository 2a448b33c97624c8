"""Every use of JAX's private APIs (`jax._src`, `jaxlib` internals, private attributes, `jax.extend.core`'s
jaxpr types) in jaxring, each behind a small named function, so a JAX upgrade is checked in this one file.

Each function says what it does and the JAX versions it was checked on: every one on both ends of the supported
range (pyproject.toml), jax 0.11.2 (the lent GPU machines') and 0.12.1 (the newest the registry serves). A function that may be missing on
another JAX raises ImportError or AttributeError from JAX itself; where jaxring has a fallback, a `has_...`
function says whether the private API is there.

Sections (one per area; add new uses to the matching one, or a new section):
  collectives      lowering of collective primitives (jaxring/core/collectives.py)
  jaxprs           tracing, dead-code elimination and partial evaluation of jaxprs (jaxring/parallel/pipeline/)
  backends         JAX's backends and XLA's HLO cost analysis (jaxring/analysis/gpu.py)
  memory kinds     host-memory arguments of a deviceless GPU program (jaxring/aot/train_step.py)
  cudnn            cuDNN's fused attention primitives, forward with stats and backward (kernels/cudnn_blocks.py)
  tokamax          the optional tokamax package's attention ops: forward with residuals, backward taking them
                   (kernels/tokamax_blocks.py)
"""

from __future__ import annotations

from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Literal, jaxpr_as_fun

__all__ = [
    "ClosedJaxpr",
    "backends_started",
    "close_jaxpr",
    "cudnn_attention_backward",
    "cudnn_attention_forward",
    "cudnn_mask_types",
    "dce_jaxpr",
    "eval_closed_jaxpr",
    "executable_cost_analysis",
    "has_cudnn_attention",
    "has_tokamax_attention",
    "hlo_cost_analysis",
    "is_literal",
    "partial_eval_jaxpr",
    "place_in_host_memory",
    "register_cpu_ppermute_lowering_with_own_channels",
    "tokamax_attention_backward",
    "tokamax_attention_forward",
    "tokamax_mosaic_attention",
    "tokamax_xla_attention",
]


# --------------------------------------------------------------------------------------------- collectives


def register_cpu_ppermute_lowering_with_own_channels() -> bool:
    """Registers, for the CPU platform, a lowering of `lax.ppermute` that gives every collective-permute a
    channel id of its own (JAX gives all of them channel 1 inside shard_map). Returns False, changing nothing,
    when JAX's internals moved (jax._src.interpreters.mlir, jax._src.lax.parallel's
    `_pcollectives_lowering_common`). Checked on jax 0.11.2 and 0.12.1. Used by `jaxring.core.collectives`."""
    try:
        from jax._src.interpreters import mlir
        from jax._src.lax import parallel
        from jax._src.lib.mlir.dialects import hlo

        common = parallel._pcollectives_lowering_common
    except (ImportError, AttributeError):
        return False

    def lowering(ctx: Any, x: Any, *, axis_name: Any, perm: Any) -> Any:
        full_perm, options = common(ctx, axis_name=axis_name, perm=perm, op_name="ppermute")
        if "channel_handle" in options:
            options = dict(
                channel_handle=hlo.ChannelHandle.get(ctx.module_context.new_channel(), mlir.DEVICE_TO_DEVICE_TYPE)
            )
        return hlo.CollectivePermuteOp(x, mlir.dense_int_elements(full_perm), **options).results

    mlir.register_lowering(parallel.ppermute_p, lowering, platform="cpu")
    return True


# ------------------------------------------------------------------------------------------------- jaxprs


def close_jaxpr(jaxpr: Any, consts: list) -> ClosedJaxpr:
    """A `ClosedJaxpr` of an open jaxpr and its constants (`jax.extend.core.ClosedJaxpr`; checked on jax
    0.11.2 and 0.12.1)."""
    return ClosedJaxpr(jaxpr, consts)


def eval_closed_jaxpr(closed: ClosedJaxpr, args: list) -> list:
    """The outputs of a closed jaxpr at `args`, traced into the current trace (`jax.extend.core.jaxpr_as_fun`;
    checked on jax 0.11.2 and 0.12.1)."""
    return jaxpr_as_fun(closed)(*args)


def is_literal(var: Any) -> bool:
    """Whether a jaxpr variable is a literal constant (`jax.extend.core.Literal`; checked on jax 0.11.2 and 0.12.1)."""
    return isinstance(var, Literal)


def dce_jaxpr(jaxpr: Any, used_outputs: list[bool], instantiate: bool = False) -> tuple[Any, list[bool]]:
    """Dead-code elimination of an open jaxpr: (the jaxpr computing only `used_outputs`, which of its inputs
    that reads). `jax._src.interpreters.partial_eval.dce_jaxpr`; checked on jax 0.11.2 and 0.12.1."""
    from jax._src.interpreters import partial_eval as pe

    return pe.dce_jaxpr(jaxpr, list(used_outputs), instantiate=instantiate)


def partial_eval_jaxpr(closed: ClosedJaxpr, unknowns: list[bool], instantiate: bool = False) -> tuple:
    """Splits a closed jaxpr by which inputs are unknown (the machinery of `jax.linearize`): (known jaxpr:
    known inputs -> known outputs + residuals, unknown jaxpr: residuals + unknown inputs -> unknown outputs,
    which outputs are unknown, the residuals' avals). `jax._src.interpreters.partial_eval.partial_eval_jaxpr_nounits`;
    checked on jax 0.11.2 and 0.12.1."""
    from jax._src.interpreters import partial_eval as pe

    return pe.partial_eval_jaxpr_nounits(closed, unknowns, instantiate=instantiate)


# ----------------------------------------------------------------------------------------------- backends


def backends_started() -> bool:
    """Whether JAX has already initialised its backends (after which `jax_platforms` no longer takes effect).
    Reads the private `jax._src.xla_bridge._backends`; checked on jax 0.11.2 and 0.12.1."""
    from jax._src import xla_bridge

    return bool(getattr(xla_bridge, "_backends", None))


def hlo_cost_analysis(hlo_text: str) -> dict[str, float]:
    """XLA's HloCostAnalysis (flops, transcendentals, bytes accessed, ...) of an HLO module given as text, run
    by the host's CPU client. `jaxlib._hlo.hlo_module_from_text` and `jax._src.lib._jax.hlo_module_cost_analysis`;
    checked on jax 0.11.2 and 0.12.1."""
    import jaxlib._hlo as hlo_lib
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    return _jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), hlo_lib.hlo_module_from_text(hlo_text))


def executable_cost_analysis(compiled: jax.stages.Compiled) -> list[dict[str, float]]:
    """XLA's HloCostAnalysis of each HLO module of a compiled program (`jax.stages.Compiled`), run by the host's
    CPU client. `Compiled.runtime_executable()` and `jax._src.lib._jax.hlo_module_cost_analysis`; checked on jax
    0.11.2 and 0.12.1."""
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    backend = xla_bridge.get_backend("cpu")
    return [_jax.hlo_module_cost_analysis(backend, m) for m in compiled.runtime_executable().hlo_modules()]


# -------------------------------------------------------------------------------------------- memory kinds


def place_in_host_memory(lowered: jax.stages.Lowered, arguments: set[int], results: set[int]) -> None:
    """Marks the flat arguments (by their index among the jitted function's leaves) and results of `lowered`
    as living in pinned host memory, in place, before it is compiled.

    For deviceless GPU compiles: the abstract devices of a topology list no memories, so a NamedSharding's
    memory_kind="pinned_host" is dropped there and the arguments would be typed device. The lowered module
    gets the `mhlo.memory_kind = "pinned_host"` attribute that jit gives such arguments on real devices.
    Uses the lowering's `kept_var_idx` (arguments jit dropped as unused) and mutates `compiler_ir()`, which
    `Lowered.compile` compiles. Checked on jax 0.11.2 and 0.12.1."""
    from jax._src.lib.mlir import ir

    module = lowered.compiler_ir("stablehlo")
    kept = sorted(lowered._lowering.compile_args["kept_var_idx"])
    position = {leaf: i for i, leaf in enumerate(kept)}
    main = next(op for op in module.body.operations if ir.StringAttr(op.attributes["sym_name"]).value == "main")

    def marked(name: str, indices: set[int]) -> ir.ArrayAttr:
        attrs = []
        for i, attr in enumerate(ir.ArrayAttr(main.attributes[name])):
            entries = {a.name: a.attr for a in ir.DictAttr(attr)}
            if i in indices:
                entries["mhlo.memory_kind"] = ir.StringAttr.get("pinned_host")
            attrs.append(ir.DictAttr.get(entries))
        return ir.ArrayAttr.get(attrs)

    with module.context:
        main.attributes["arg_attrs"] = marked("arg_attrs", {position[a] for a in arguments if a in position})
        main.attributes["res_attrs"] = marked("res_attrs", set(results))


# ------------------------------------------------------------------------------------------------- cudnn
# cuDNN's fused attention through `jax._src.cudnn.fused_attention_stablehlo`'s two wrapper primitives (the
# public `jax.nn.dot_product_attention(implementation="cudnn")` returns no softmax stats and has no backward
# that takes another output's stats). Read from the source of jax 0.11.2 and 0.12.1 (0.12 added the flex
# attention `score_mod`: a parameter, None here, and `score_mod_args` operands, none here); run on a GPU only
# by benchmarks/gpu_session.sh. The call contract, mirrored by `kernels/cudnn_contract.py` on CPU:
#   forward(query, key, value, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_table_k, page_table_v,
#           *, scale, seed, dropout_rate, variadic_args, mask_type, layout, sliding_window_length, is_training)
#     -> (out [B, T, N, H] in the inputs' dtype, stats fp32 [B, N, T]) when is_training
#   backward(same ten operands, stats, fwd_output, grad_output, *, the same parameters but is_training)
#     -> (dq, dk, dv) in the inputs' dtypes
# Unused operands are empty arrays (jnp.zeros(0)), as the public wrapper passes them.

_CUDNN_OPERANDS = ["query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets"]
_CUDNN_OPERANDS += ["page_table_k", "page_table_v"]
_CUDNN_PARAMS = ["scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout", "sliding_window_length"]

# the forward implementation's parameters, by the JAX versions that have them
_CUDNN_FORWARD_SIGNATURES = {
    "0.11": _CUDNN_OPERANDS + _CUDNN_PARAMS + ["is_training"],
    "0.12": _CUDNN_OPERANDS + ["score_mod_args"] + _CUDNN_PARAMS + ["score_mod", "is_training"],
}


def _cudnn_signature() -> str | None:
    """Which of `_CUDNN_FORWARD_SIGNATURES` this JAX has ("0.11", "0.12"), or None."""
    import inspect

    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError:
        return None
    needed = ("_dot_product_attention_fwd_p_wrapper", "_dot_product_attention_bwd_p_wrapper", "MaskType")
    impl = getattr(fa, "_dot_product_attention_fwd_impl", None)
    if impl is None or not all(hasattr(fa, name) for name in needed):
        return None
    parameters = list(inspect.signature(impl).parameters)
    return next((name for name, sig in _CUDNN_FORWARD_SIGNATURES.items() if sig == parameters), None)


def has_cudnn_attention() -> bool:
    """Whether this JAX has cuDNN's fused attention primitives with one of the call contracts checked (jax 0.11.2,
    0.12.1)."""
    return _cudnn_signature() is not None


def _cudnn_extra_params() -> dict[str, Any]:
    """The parameters jax 0.12 added to both primitives (`score_mod=None`: no flex-attention score function)."""
    return {"score_mod": None} if _cudnn_signature() == "0.12" else {}


def cudnn_mask_types() -> dict[str, Any]:
    """{"none", "padding", "causal", "padding_causal"} -> the private `MaskType` members (jax 0.11.2, 0.12.1)."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType

    return {
        "none": MaskType.NO_MASK,
        "padding": MaskType.PADDING,
        "causal": MaskType.CAUSAL,
        "padding_causal": MaskType.PADDING_CAUSAL,
    }


def cudnn_attention_forward(*operands: jax.Array, **params: Any) -> tuple[jax.Array, jax.Array]:
    """Binds `_dot_product_attention_fwd_p_wrapper` (jax 0.11.2, 0.12.1) with is_training=True: (out, stats)."""
    from jax._src.cudnn.fused_attention_stablehlo import _dot_product_attention_fwd_p_wrapper

    out, stats = _dot_product_attention_fwd_p_wrapper.bind(
        *operands, **params, **_cudnn_extra_params(), is_training=True
    )
    return out, stats


def cudnn_attention_backward(*operands: jax.Array, **params: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Binds `_dot_product_attention_bwd_p_wrapper` (jax 0.11.2, 0.12.1): (dq, dk, dv) (no bias, so no dbias)."""
    from jax._src.cudnn.fused_attention_stablehlo import _dot_product_attention_bwd_p_wrapper

    dq, dk, dv = _dot_product_attention_bwd_p_wrapper.bind(*operands, **params, **_cudnn_extra_params())
    return dq, dk, dv


# ------------------------------------------------------------------------------------------------ tokamax
# The optional `tokamax` package (Apache-2.0; `pip install jaxring[tokamax]`), read and run on tokamax 0.0.17
# with jax 0.12.1 (CPU: its XLA op; the Mosaic GPU op compiled deviceless for an H100 with jax 0.12.0). Its public
# `tokamax.dot_product_attention` returns the output only, and its public GPU alias
# `tokamax.ops.gpu.PallasMosaicFlashAttention` does not import without `jax_triton` (not a tokamax dependency),
# so the op classes come from their private modules (`tokamax._src.ops.attention`). The ops' own contract (the
# `Op` base class, `tokamax.Op`): `op(q, k, v, ..., return_residuals=True)` -> (out, (max, sum)); `op.vjp(residuals,
# out, dout, *bound args)` -> {"q": dq, "k": dk, "v": dv, ...}. The Mosaic GPU backward reads the residuals and
# D = rowsum(out * dout) (both given); tokamax's XLA backward recomputes the softmax and ignores them.


def has_tokamax_attention() -> bool:
    """Whether tokamax is installed with the attention modules and names read on 0.0.17."""
    try:
        from tokamax._src.ops.attention import base, pallas_mosaic_gpu
    except ImportError:
        return False
    return all(hasattr(base, n) for n in ("Mask", "DotProductAttention")) and hasattr(
        pallas_mosaic_gpu, "PallasMosaicGpuFlashAttention"
    )


def tokamax_mosaic_attention(config: Any = None) -> Any:
    """tokamax's Mosaic GPU flash attention op (`pallas_mosaic_gpu.PallasMosaicGpuFlashAttention`, tokamax 0.0.17;
    sm80 forward only, sm90 and sm100 forward and backward), with its backward op as `.vjp`. `config`: a kernel
    config (None: tokamax's heuristics for the device)."""
    from tokamax._src.ops.attention.pallas_mosaic_gpu import PallasMosaicGpuFlashAttention

    return PallasMosaicGpuFlashAttention(config=config)


def tokamax_xla_attention(with_vjp: bool = False) -> Any:
    """tokamax's XLA attention op (`base.DotProductAttention`, tokamax 0.0.17; runs on CPU). Its forward returns
    the same residuals as the Mosaic GPU op. It has no `.vjp` (XLA autodiff) unless `with_vjp`: then tokamax's
    XLA backward op (`base.DotProductAttentionVjp`), which takes residuals and an output but recomputes the
    softmax instead of reading them (tests show so)."""
    from tokamax._src.ops.attention.base import DotProductAttention, DotProductAttentionVjp

    return DotProductAttention(vjp=DotProductAttentionVjp() if with_vjp else None)


def _tokamax_mask(k_start: Any, k_end: Any) -> Any:
    """tokamax's `base.Mask` keeping keys k_start <= j < k_end per query row (None when neither bound is set)."""
    from tokamax._src.ops.attention.base import Mask

    return None if k_start is None and k_end is None else Mask(k_start=k_start, k_end=k_end)


def tokamax_attention_forward(
    op: Any, q: jax.Array, k: jax.Array, v: jax.Array, *, k_start: Any, k_end: Any, sm_scale: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(out like q, max fp32 [b, hq, nq], sum fp32 [b, hq, nq]) of tokamax's attention op `op` with the key
    range mask: query i sees keys k_start[..., i] <= j < k_end[..., i] (int [1, 1, nq], or None: no bound).

    max is the row's largest scaled score and sum = Σ exp(s - max), natural log (read on tokamax 0.0.17: the
    Mosaic sm90 kernel stores its base-2 running max times ln 2), so lse = max + log(sum)."""
    mask = _tokamax_mask(k_start, k_end)
    out, (m, s) = op(q, k, v, logits_scale=float(sm_scale), mask=mask, return_residuals=True)
    return out, m, s


def tokamax_attention_backward(
    op: Any,
    m: jax.Array,
    s: jax.Array,
    out: jax.Array,
    dout: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    k_start: Any,
    k_end: Any,
    sm_scale: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) from `op.vjp` (tokamax 0.0.17's Mosaic GPU backward) given the residuals (m, s) [b, hq, nq]
    and an output: P = exp(scale q k^T - m) / s and D = rowsum(out * dout), both read as given."""
    if op.vjp is None:
        raise NotImplementedError(f"{type(op).__name__} has no backward that takes residuals")
    ba = op.bind(q, k, v, logits_scale=float(sm_scale), mask=_tokamax_mask(k_start, k_end))  # canonical arguments
    kwargs = dict(ba.kwargs)
    kwargs.pop("return_residuals", None)
    grads = op.vjp((m, s), out, dout, *ba.args, **kwargs)
    return grads["q"], grads["k"], grads["v"]
