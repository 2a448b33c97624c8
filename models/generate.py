"""Generation with a KV cache sharded over the plan: sequence-parallel prefill, then one token per step.

    ids = generate(model, plan, [[1, 2, 3], [4, 5]], 20, temperature=0)   # greedy; plan=None: one device

1. Prefill. The prompts, right-padded to one cache length (prompt + max_new_tokens, rounded up to what the
   plan's layout splits), run as ONE forward pass of the plan (its sequence strategy through `plan.attend`,
   its tensor method), and each layer leaves its K/V (`Attention.kv`: after QK-norm and RoPE, GQA's kv heads)
   as a cache [layers, batch, length, kv heads, head_dim] sharded as the training sequence is: over sp in the
   plan's layout (zigzag/striped slots keep their laid-out order; `cache_positions` holds each slot's true
   position) and over tp by heads. Right padding keeps every prompt at its true positions 0..len-1 (one
   position vector for the batch, as the strategies take); a padded slot holds stale K/V, masked by position
   until the step that writes it.
2. Decode (`Block.decode`, `jaxring.nn.inference.decode_attention`). Step t feeds each sequence its last token
   at its own position (the first step re-feeds the last prompt token, whose logits give the first new
   token): every device attends its cache shard (the positions before the token's, within the sliding
   window), the partial outputs are merged once by log-sum-exp over sp, then with the token's own key. The
   MLP and the head run on the one new token per sequence (Megatron: summed over tp; logits gathered over
   tp). After the last layer, every layer's new K/V is written into the slot that owns its position, in place
   (the cache is donated to the step).
3. Sampling (`jaxring.nn.inference.sample`): greedy at temperature 0, else temperature, top-k, top-p.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from jaxring.core.mesh import make_mesh, spec_entry
from jaxring.models.gpt import GPT, check_plan
from jaxring.nn import weight_specs
from jaxring.nn.inference import (
    cache_length,
    cache_spec,
    check_decodable,
    check_sampling,
    decode_embed,
    decode_logits,
    local_kv_heads,
    sample,
    write_cache,
)
from jaxring.parallel.plan import ParallelPlan


def _stacked_layers(model: nnx.Module) -> tuple[nnx.GraphDef, dict]:
    """(one block's graph, the blocks' weights stacked [num_layers, ...] as a pure dict) of a model's stack, for
    scanning the blocks' own decode and KV methods."""
    graphdef, state = nnx.split(model.blocks)
    return graphdef, nnx.to_pure_dict(state)


class Decoder:
    """The compiled prefill and decoding step of `model` on `plan` (built once; reused over batches)."""

    def __init__(self, model: GPT, plan: ParallelPlan | None = None):
        plan = plan if plan is not None else ParallelPlan(make_mesh(devices=jax.devices()[:1]))
        check_decodable(plan)
        self.model, self.plan, self.cfg = model, plan, model.cfg
        self.graphdef, state = nnx.split(model)
        self._state = nnx.to_pure_dict(state)
        self.specs = weight_specs(state, plan)
        self.param_shardings = jax.tree.map(
            lambda s: NamedSharding(plan.run_mesh, s), self.specs, is_leaf=lambda s: isinstance(s, P)
        )
        self.cache_spec = cache_spec(plan)

    @functools.cached_property
    def params(self):
        """The weights placed as the plan splits them (replicated over sp, heads/vocab over tp)."""
        return jax.device_put(self._state, self.param_shardings)

    # ------------------------------------------------------------------ shapes and layout
    def cache_shape(self, batch: int, length: int) -> tuple[int, ...]:
        """Global shape of the K (or V) cache: [layers, batch, length, kv heads (tp copies when fewer), head_dim]."""
        cfg, plan = self.cfg, self.plan
        heads = local_kv_heads(plan, cfg.num_kv_heads or cfg.num_heads) * plan.tp
        return (cfg.num_layers, batch, length, heads, cfg.attn_head_dim)

    def abstract_cache(self, batch: int, length: int):
        """jax.ShapeDtypeStruct of the K (or V) cache with its sharding (fp32)."""
        sharding = NamedSharding(self.plan.run_mesh, self.cache_spec)
        return jax.ShapeDtypeStruct(self.cache_shape(batch, length), jnp.float32, sharding=sharding)

    def abstract_step_inputs(self, batch: int, length: int) -> tuple:
        """The arguments of `step` as sharded jax.ShapeDtypeStructs (greedy rule): for `step.lower(*...)`
        with no weights or devices present (e.g. a deviceless GPU compile of an `nnx.eval_shape` model)."""
        shaped = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        params = jax.tree.map(shaped, self._state, self.param_shardings)
        rows = jax.ShapeDtypeStruct(
            (batch,), jnp.int32, sharding=self.plan.sharding(P(spec_entry(self.plan.batch_axes)))
        )
        slots = jax.ShapeDtypeStruct((length,), jnp.int32, sharding=self.plan.sharding(P(self.plan.seq_axis)))
        cache = self.abstract_cache(batch, length)
        key = jax.ShapeDtypeStruct((2,), jnp.uint32)
        rule = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), sampling_rule(0.0))
        return params, cache, cache, slots, rows, rows, key, rule

    def cache_positions(self, length: int) -> jax.Array:
        """int32 [length]: the true position of every cache slot, in the plan's layout, sharded over sp."""
        _, positions = self.plan.layout_tokens(np.zeros((1, length), np.int32), causal=True)
        return jax.device_put(np.asarray(positions, np.int32), self.plan.sharding(P(self.plan.seq_axis)))

    # ------------------------------------------------------------------ prefill
    @functools.cached_property
    def _prefill(self):
        plan, graphdef = self.plan, self.graphdef

        def local(params, tokens, positions):
            m = nnx.merge(graphdef, params)
            layer_graphdef, stacked = _stacked_layers(m)
            carry = m.embed_tokens(tokens, positions, jnp.float32, plan=plan)

            def body(carry, layer_params):
                block = nnx.merge(layer_graphdef, layer_params)
                kv = block.attn.kv(block.ln1(carry["x"], plan), positions, plan)
                return GPT.block_step(block, carry, positions, plan), kv

            _, (k, v) = lax.scan(body, carry, stacked)
            return k, v

        token = plan.token_spec()
        return jax.jit(plan.shard_map(local, (self.specs, token, token), (self.cache_spec, self.cache_spec)))

    def prefill(self, tokens: np.ndarray):
        """(k, v) caches [layers, batch, length, kv heads, head_dim] of tokens int [batch, length] (natural
        order), sharded by `cache_spec`; the forward runs as the plan's training forward does."""
        (laid,), positions = self.plan.layout_tokens(np.asarray(tokens, np.int32), causal=True)
        positions = np.broadcast_to(positions, laid.shape).astype(np.int32)
        return self._prefill(self.params, laid, positions)

    # ------------------------------------------------------------------ one decoding step
    @functools.cached_property
    def step(self):
        """The jitted step(params, k, v, cache_positions, tokens int [b], positions int [b], key, rule) -> (next
        tokens int32 [b], logits fp32 [b, vocab], k, v): feeds each sequence's token at its position, writes its
        K/V into the cache (donated) and draws the next token by `rule` = `sampling_rule(...)` (traced: one
        compile for every temperature, top-k and top-p)."""
        plan, graphdef, cfg = self.plan, self.graphdef, self.cfg
        rows = P(spec_entry(plan.batch_axes))

        def local(params, k, v, cache_positions, tokens, positions):
            m = nnx.merge(graphdef, params)
            pos_table = m.pos_embed[...] if cfg.positions == "learned" else None
            x = decode_embed(plan, tokens, m.embed.table[...], positions, pos_table)
            layer_graphdef, stacked = _stacked_layers(m)

            def body(x, xs):
                layer_params, k, v = xs
                block = nnx.merge(layer_graphdef, layer_params)
                return block.decode(x, positions, (k, v), cache_positions, plan)

            x, (k_new, v_new) = lax.scan(body, x, (stacked, k, v))  # the cache is only read here
            k = write_cache(k, k_new, cache_positions, positions)  # then written once, in place (donated)
            v = write_cache(v, v_new, cache_positions, positions)
            w, tied = m.head_weight(jnp.float32)
            return decode_logits(plan, m.ln_f(x, plan), w, tied=tied), k, v

        in_specs = (self.specs, self.cache_spec, self.cache_spec, P(plan.seq_axis), rows, rows)
        out_specs = (P(spec_entry(plan.batch_axes), None), self.cache_spec, self.cache_spec)
        sharded = plan.shard_map(local, in_specs, out_specs)

        def step(params, k, v, cache_positions, tokens, positions, key, rule):
            logits, k, v = sharded(params, k, v, cache_positions, tokens, positions)
            return sample(logits, key, **rule), logits, k, v

        return jax.jit(step, donate_argnums=(1, 2))


def sampling_rule(temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None) -> dict:
    """The decoding step's sampling settings as arrays (top_k None: every token; top_p None: 1)."""
    return {
        "temperature": jnp.float32(temperature),
        "top_k": jnp.int32(np.iinfo(np.int32).max if top_k is None else top_k),
        "top_p": jnp.float32(1.0 if top_p is None else top_p),
    }


def check_prompts(prompts, vocab_size: int) -> None:
    """One-line errors for prompts that are not a non-empty list of non-empty lists of ids in [0, vocab)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of token-id lists; got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not isinstance(p, (list, tuple, np.ndarray)) or len(p) == 0:
            raise ValueError(f"prompt {i} must be a non-empty list of token ids; got {p!r:.60}")
        ids = np.asarray(p)
        if not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"prompt {i}: token ids must be integers in [0, vocab_size = {vocab_size})")


def generate(
    model: GPT,
    plan: ParallelPlan | None,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    key=None,
    progress: bool = False,
    decoder: Decoder | None = None,
    stop_tokens: int | list[int] | None = None,
) -> list[list[int]]:
    """`max_new_tokens` ids after each of `prompts` (token-id lists of any lengths; right-padded inside), with
    the KV cache sharded over `plan` (None: one device). temperature 0: greedy; else sampled with `key`
    (default PRNGKey(0)) after top_k / top_p. progress: a tqdm bar over the tokens. decoder: a `Decoder` of
    this model and plan to reuse its compiled steps. stop_tokens: an id or ids (the tokenizer's end of
    sequence, as `eos_token_id` in transformers) that end a prompt's generation: its list ends with the first
    one it produces, and decoding stops once every prompt has ended. Returns one list of new ids per prompt."""
    cfg = model.cfg
    check_prompts(prompts, cfg.vocab_size)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens {max_new_tokens!r} must be an integer >= 0")
    check_sampling(temperature, top_k, top_p)
    stops = check_stop_tokens(stop_tokens, cfg.vocab_size)
    if max_new_tokens == 0:
        return [[] for _ in prompts]
    decoder = decoder if decoder is not None else Decoder(model, plan)
    plan = decoder.plan
    lengths = np.array([len(p) for p in prompts], np.int32)
    needed = int(lengths.max()) + max_new_tokens
    if cfg.positions == "learned" and needed > cfg.max_seq_len:
        raise ValueError(
            f"longest prompt {lengths.max()} + max_new_tokens {max_new_tokens} = {needed} exceeds the learned "
            f"positions' max_seq_len {cfg.max_seq_len}"
        )
    length = cache_length(plan, needed)
    batch = -(-len(prompts) // plan.data_degree) * plan.data_degree  # padded with copies of the first prompt
    check_plan(cfg, plan, batch, length)
    tokens = np.zeros((batch, length), np.int32)
    lengths = np.concatenate([lengths, np.full(batch - len(prompts), lengths[0], np.int32)])
    for i in range(batch):
        p = prompts[i] if i < len(prompts) else prompts[0]
        tokens[i, : len(p)] = np.asarray(p, np.int32)

    k, v = decoder.prefill(tokens)
    rule = sampling_rule(temperature, top_k, top_p)
    cache_positions = decoder.cache_positions(length)
    key = jax.random.PRNGKey(0) if key is None else key
    rows = decoder.plan.sharding(P(spec_entry(plan.batch_axes)))  # one placement every step: one compile
    token = tokens[np.arange(batch), lengths - 1]
    out = []
    ended = np.zeros(len(prompts), bool)
    for i in tqdm(range(max_new_tokens), desc="sampling", unit="token", disable=not progress, leave=False):
        key, sub = jax.random.split(key)
        token, positions = jax.device_put((token, lengths - 1 + i), rows)
        token, _, k, v = decoder.step(decoder.params, k, v, cache_positions, token, positions, sub, rule)
        out.append(token)
        if stops.size:  # reading the ids back waits for this step; only asked for with stop tokens
            ended |= np.isin(np.asarray(token)[: len(prompts)], stops)
            if ended.all():
                break
    ids = np.stack([np.asarray(t) for t in out], axis=1)[: len(prompts)]
    return [_up_to_stop(row.tolist(), stops) for row in ids]


def check_stop_tokens(stop_tokens: int | list[int] | None, vocab_size: int) -> np.ndarray:
    """The stop ids as an int array (empty: none); one-line error for ids outside [0, vocab_size)."""
    if stop_tokens is None:
        return np.zeros(0, np.int32)
    ids = np.atleast_1d(np.asarray(stop_tokens))
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"stop_tokens {stop_tokens!r} must be token ids (integers) in [0, vocab_size = {vocab_size})")
    return ids.astype(np.int32)


def _up_to_stop(row: list[int], stops: np.ndarray) -> list[int]:
    """`row` up to and including its first stop id."""
    for j, t in enumerate(row):
        if t in stops:
            return row[: j + 1]
    return row
