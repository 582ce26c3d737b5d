"""What every model family shares: the output type, the config protocol, and its common methods.

A model family is a config dataclass plus the Flax module it builds. Two families exist,
``fox_jax.models.lm`` (``ModelConfig`` / ``LanguageModel``: FoX and Transformer, LLaMA and Pro) and
``fox_jax.models.gpt2`` (``GPT2Config`` / ``GPT2``). Training, evaluation and decoding reach a model only
through ``ModelFamily`` (the config) and ``ModelOutput`` (what the module returns), so they never ask
which family they hold::

    cfg = config_from_dict(json.load(f))           # fox_jax.models: {"model_type": "gpt2", ...} or "lm"
    params = cfg.init_params(rng)
    out = cfg.build().apply({"params": params}, tokens, segment_ids, positions, alpha=alpha)
    loss = ce(out.logits, targets) + gamma * out.aux.get("sparsity_loss", 0.0)

``FamilyConfig`` implements the methods that are the same for both (serialisation with a type tag and
renamed legacy keys, layer names, remat, parameter init, adding DCP parameters); each family adds
``build``, ``param_count`` and ``flops_per_token``.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar, Protocol

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from fox_jax.cache.policies import parse_policy
from fox_jax.cache.slots import new_slot_cache

from fox_jax.ops._common import ATTENTION_RESIDUALS
from fox_jax.ops.context_pruning import sparsity, sparsity_loss, with_interaction_params
from fox_jax.sharding import constrain


@flax.struct.dataclass
class ModelOutput:
    """What every model returns, whatever its config.

    Attributes:
      logits: [B, T, vocab_size]: float32 for GPT-2 and for DCP models, else the compute dtype (cast to
        float32 for the loss).
      cache: the updated tuple of per-layer caches when the model was called with ``cache=...``, else None.
      aux: ``{}`` for a dense model. DCP: ``log_masks`` [n_layers, B, T, T] float32 log I per layer
        (0 kept, ≈ −92.1 dropped), ``sparsity`` [n_layers] float32 fraction of causal pairs dropped (no
        gradient), ``sparsity_loss`` float32 scalar (γ = 1, "causal" normalisation, 0 when T < 3). A
        GPT-2 with a fixed ``sparse_pattern``: ``log_masks`` and ``sparsity`` only.
      hidden: None, or with ``LanguageModel(...)(..., return_hidden=True)`` the final-normed hidden
        states [B, T, d] in the compute dtype (then ``logits`` is None: the loss applies the head).
    """

    logits: jax.Array
    cache: Any = None
    aux: dict = flax.struct.field(default_factory=dict)
    hidden: Any = None


class ModelFamily(Protocol):
    """The interface ``ModelConfig`` and ``GPT2Config`` implement (levanter's ``LmConfig``, scaled down).

    Fields with the same meaning have the same name in both: vocab_size, d_model, n_layers, n_heads,
    mlp_dim, norm_eps, init_std, dtype, attention_impl, attention_block, remat ("none" | "full" |
    "dots"), dcp, interaction_dim, dcp_beta_init, dcp_impl.
    """

    model_type: ClassVar[str]
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    dtype: str
    remat: str
    dcp: bool
    interaction_dim: int
    dcp_beta_init: float

    def build(self) -> nn.Module:
        """The Flax module: ``apply({"params": p}, tokens, segment_ids=None, positions=None, cache=None,
        *, alpha=None) -> ModelOutput``."""

    def init_params(self, rng: jax.Array, seq_len: int = 8) -> dict:
        """Fresh float32 parameters as a plain nested dict."""

    @property
    def layer_names(self) -> tuple[str, ...]:
        """The params keys of the attention layers, in order ("layers_{i}" or "h_{i}")."""

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model can position (learned positions), None for no limit."""

    def with_remat(self, policy: str) -> ModelFamily:
        """The config with rematerialisation ``policy`` ("none", "full", "dots")."""

    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token at context ``seq_len`` (dense-equivalent; training costs 3x)."""

    def param_count(self) -> int:
        """Exact number of parameters of the built model."""

    def add_dcp_params(self, params: dict, rng: jax.Array, *, interaction_dim: int | None = None,
                       beta_init: float | None = None) -> tuple[ModelFamily, dict]:
        """(the config with DCP, params with fresh interaction parameters) of a dense model."""

    def init_cache(self, batch_size: int, slots, *, policy="dense", seq_start=None,
                   max_context: int | None = None) -> tuple:
        """Empty per-layer decoding caches (``fox_jax.cache.SlotKVCache``) for this model."""

    def to_dict(self) -> dict:
        """The fields as a JSON-able dict with ``model_type``."""

    @classmethod
    def from_dict(cls, d: dict) -> ModelFamily:
        """Inverse of ``to_dict`` (also accepts legacy key names)."""


@contextlib.contextmanager
def _threefry_kernel():
    """Within the block, jitted programs lower threefry to one CUDA kernel on GPU (bit-identical to XLA's
    expansion, which compiles for minutes in a large init); the previous setting is restored after. The setting is
    process-wide: another thread that compiles during the block sees it too (the same bits either way)."""
    name = "jax_threefry_gpu_kernel_lowering"
    previous = getattr(jax.config, name, None)
    if previous is None:  # an option this JAX does not have: nothing to change
        yield
        return
    jax.config.update(name, True)
    try:
        yield
    finally:
        jax.config.update(name, previous)


class FamilyModules:
    """The JAX side of a model family: what a config's ``build``, ``init_params``, ``add_dcp_params`` and
    ``init_cache`` do (``fox_jax.config.FamilyConfig`` delegates to the instance registered for its
    ``model_type``). Each family subclasses it with its Flax ``module`` class and its ``init_cache``."""

    module: ClassVar[type[nn.Module]]

    def build(self, cfg) -> nn.Module:
        return self.module(cfg)

    def init_params(self, cfg, rng: jax.Array, seq_len: int = 8) -> dict:
        """Float32 parameters of ``cfg.build()`` as a plain nested dict (no Flax boxing).

        Initialised on a [1, seq_len] batch of zeros (capped at ``max_positions``); DCP models with
        alpha = 1 (the value does not affect the parameters). One jitted program: run op by op, ``init``
        compiled ~100 small programs and ran the forward pass it does not need (XLA drops it here). On GPU
        its threefry draws are lowered to JAX's threefry CUDA kernel instead of XLA's inline expansion (the
        same bits; ``jax_threefry_gpu_kernel_lowering``): the 760M FoX (Pro) init compiles in 9 s instead of
        111 s for an H200 (benchmarks/NOTES.md "Time to the first step"); CPU and TPU are unaffected.
        """
        limit = cfg.max_positions
        tokens = jnp.zeros((1, seq_len if limit is None else min(seq_len, limit)), jnp.int32)
        model = cfg.build()
        init = jax.jit(lambda key: model.init(key, tokens, alpha=1.0 if cfg.dcp else None)["params"])
        with _threefry_kernel():
            return init(rng)

    def add_dcp_params(self, cfg, params: dict, rng: jax.Array, *, interaction_dim: int | None = None,
                       beta_init: float | None = None):
        """Add fresh DCP parameters to a pretrained dense model (docs/design/dcp.md §1.1, §4).

        Every layer ``<name>`` of ``layer_names`` gets ``<name>/attn/q_int/kernel`` and
        ``<name>/attn/k_int/kernel`` [d, r] float32 ~ N(0, init_std) (the reference code's effective
        N(0, 0.02) init) and the scalar ``<name>/attn/beta`` = β₀. Existing weights are kept (same
        objects); the input pytree is not modified.

        Args:
          params: the dense model's params.
          rng: PRNG key for the interaction weights.
          interaction_dim: r (default ``cfg.interaction_dim``, 64).
          beta_init: β₀ (default ``cfg.dcp_beta_init``, 2.0).

        Returns:
          (the config with dcp=True and the chosen r/β₀, new params pytree).

        Raises:
          ValueError: the config already has DCP, DCP cannot be combined with it (e.g. ACP or a fixed
            sparse pattern), bad r/β₀, or params lack a layer ``<name>/attn``.
        """
        if cfg.dcp:
            raise ValueError(f"add_dcp_params: {type(cfg).__name__} already has dcp=True")
        new = cfg.replace(dcp=True,
                           interaction_dim=cfg.interaction_dim if interaction_dim is None else interaction_dim,
                           dcp_beta_init=cfg.dcp_beta_init if beta_init is None else beta_init)
        out = with_interaction_params(params, list(new.layer_names), d_model=new.d_model,
                                      interaction_dim=new.interaction_dim, init_std=new.init_std,
                                      beta_init=new.dcp_beta_init, rng=rng)
        return new, out

    def cache_layout(self, cfg) -> dict:
        """What a layer's decoding cache stores and the policies may rely on: n_heads, kv_heads, head_dim,
        forget_gate, kv_shift, interaction_dim (None without DCP), qk_norm. Each family states its own."""
        raise NotImplementedError(f"{type(cfg).__name__} has no decoding caches")

    def init_cache(self, cfg, batch_size: int, slots, *, policy="dense", seq_start=None,
                   max_context: int | None = None) -> tuple:
        """Empty per-layer ``fox_jax.cache.SlotKVCache``s (one per layer) for decoding under ``policy``.

        Args:
          batch_size: B.
          slots: the pool: slots per row, an int for every layer, or one entry per layer (an int, or for
            ``acp`` a sequence of one count per key/value head).
          policy: a cache policy (``fox_jax.cache.policies``: dense, dcp, acp, window:W, sinks:S+W).
          seq_start: optional [B] int left pads per row.
          max_context: N, the longest context the caches will serve (``acp``'s ε bound); default the slots.

        Raises:
          ValueError: a bad slot spec or seq_start, a policy the model cannot run (``dcp`` without DCP,
            ``acp`` without forget gates).
        Warns:
          ``fox_jax.cache.policies.HeuristicEvictionWarning``: the policy runs as a heuristic (``acp``
          without QK-norm).
        """
        layout = self.cache_layout(cfg)
        policy = parse_policy(policy)
        per_layer = slots if isinstance(slots, (list, tuple)) else (slots,) * cfg.n_layers
        if len(per_layer) != cfg.n_layers:
            raise ValueError(f"slots must be an int or one entry per layer ({cfg.n_layers}), got {len(per_layer)}")
        return tuple(new_slot_cache(batch_size, s, dtype=jnp.dtype(cfg.dtype), policy=policy,
                                    max_context=max_context, seq_start=seq_start, **layout) for s in per_layer)


def rows_only(x: jax.Array) -> jax.Array:
    """The residual stream [B, T, d] laid out by rows only under a mesh (logical ``("batch", None, None)``;
    ``fox_jax.sharding.constrain``; unchanged without one). The LMs apply it in training and scoring, at the
    embedding, every block's input and the final norm: XLA then gathers each weight over ``fsdp`` where it is
    used (ZeRO-3) instead of carrying the parameters' ``fsdp`` split of d into the activations and exchanging
    them around every matmul (a FoX (Pro) step on 8 simulated devices: 3.5 GB -> 82 MB of collectives under
    fsdp=8; tests/test_sharding.py, docs/multi_gpu.md)."""
    return constrain(x, ("batch", None, None))


def embed_rows(embed: nn.Embed, ids: jax.Array, dtype, rows: str | None = "vocab") -> jax.Array:
    """``embed(ids)`` (the same values) for training and scoring under a mesh: the lookup reads the table gathered
    over ``fsdp`` (a lookup into a table split by d is one XLA can only reshard through the whole batch; its rows
    keep the logical axis ``rows``: ``"vocab"`` for tokens, None for a position table) and the result is laid out
    by rows (``rows_only``)."""
    return rows_only(jnp.take(constrain(embed.embedding, (rows, None)).astype(dtype), ids, axis=0))


def _saveable(policy: str):
    """The ``jax.checkpoint`` policy of a remat setting: "full" saves nothing (the block inputs only); "dots" the
    outputs of the weight matmuls and of the attention ops (o and the row log-sum-exp their backward reads,
    ``ATTENTION_RESIDUALS``), so the backward recomputes only elementwise work and reductions, never an attention
    forward kernel."""
    if policy == "full":
        return jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*ATTENTION_RESIDUALS))


def remat_block(block_cls: type[nn.Module], policy: str) -> type[nn.Module]:
    """``block_cls`` rematerialised with ``policy``: "none" (as is), "full" (save only the block inputs)
    or "dots" (save matmul and attention outputs, recompute the rest). Positional call arguments are traced."""
    if policy == "none":
        return block_cls
    return nn.remat(block_cls, policy=_saveable(policy))


# collections a block may sow into (fox_jax.nn.attention): carried out of the scanned body when mutable
_SOWN = ("intermediates", "gates")


def scan_applies(cfg, module: nn.Module, cache) -> bool:
    """Whether ``module`` (a model being called) runs its blocks through ``scan_blocks``: ``cfg.scan_layers``,
    no cache, not ``init`` (which creates the per-layer parameters), and not under Flax's
    ``capture_intermediates`` (its filter sees each module's path, which only the unrolled loop has; flax
    keeps the active filter in ``linen.module._context.capture_stack``, tested in tests/test_family.py)."""
    if not cfg.scan_layers or cache is not None or module.is_initializing():
        return False
    from flax.linen import module as linen_module

    stack = linen_module._context.capture_stack
    return not (stack and stack[-1])


def cast_targets(jaxpr, n: int) -> tuple:
    """For each of the first ``n`` inputs of ``jaxpr`` (a ``jax.core.Jaxpr``): the dtype name that every use of it
    converts it to, or None (used otherwise, returned, or unused). Casting those inputs before the program
    changes no value: its own convert becomes the identity (and under autodiff the cotangent is the same
    array, cast back by the earlier convert's transpose)."""
    invars = jaxpr.invars[:n]
    uses = {id(v): [] for v in invars}
    for eqn in jaxpr.eqns:
        for x in eqn.invars:
            if id(x) in uses:
                uses[id(x)].append(eqn)
    returned = {id(v) for v in jaxpr.outvars}
    plan = []
    for v in invars:
        eqns = uses[id(v)]
        to = {jnp.dtype(e.params["new_dtype"]).name for e in eqns if e.primitive.name == "convert_element_type"}
        only_casts = bool(eqns) and len(to) == 1 and all(e.primitive.name == "convert_element_type" for e in eqns)
        plan.append(to.pop() if only_casts and id(v) not in returned else None)
    return tuple(plan)


def _block_casts(block: nn.Module, p: Any, x: jax.Array, args: tuple) -> Any:
    """``p``'s tree with, per leaf, the dtype the block only ever casts it to (or None), read from the jaxpr of
    one block call (abstract: nothing runs; not traced when every leaf is already in the compute dtype
    ``block.cfg.dtype``, as in a float32 model)."""
    leaves, treedef = jax.tree_util.tree_flatten(p)
    if all(jnp.result_type(a) == jnp.dtype(block.cfg.dtype) for a in leaves):
        return jax.tree_util.tree_unflatten(treedef, [None] * len(leaves))
    arrays = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]

    def call(leaves, h, *arr):
        full = list(args)
        for i, a in zip(arrays, arr):
            full[i] = a
        return block.apply({"params": jax.tree_util.tree_unflatten(treedef, leaves)}, h, *full).x

    spec = lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))  # noqa: E731
    jaxpr = jax.make_jaxpr(call)([spec(a) for a in leaves], spec(x), *(spec(args[i]) for i in arrays)).jaxpr
    return jax.tree_util.tree_unflatten(treedef, list(cast_targets(jaxpr, len(leaves))))


def scan_blocks(parent: nn.Module, block: nn.Module, names: tuple[str, ...], x: jax.Array, args: tuple,
                remat: str) -> tuple[jax.Array, Any]:
    """Apply the blocks ``parent.variables["params"][name]`` for ``name`` in ``names`` in order, as one
    ``jax.lax.scan`` over their stacked parameters: the body is traced and compiled once, whatever the
    depth (MaxText's ``scan_layers``), and the values equal the unrolled loop's.

    The parameters keep their per-layer layout (``layers_{i}`` / ``h_{i}``: checkpoints, sharding rules,
    DCP and the Hugging Face converters are unchanged); the stack is made inside the traced step and its
    gradient is sliced back per layer. A parameter the block only ever casts (a float32 matrix that a bf16
    block multiplies in bf16) is cast before it is stacked: the stack, the scan's slices and the stacked
    gradient then move half the bytes, and no value changes (``cast_targets``). What the blocks sow into a
    mutable ``intermediates`` or ``gates`` collection lands under each layer's name, as the unrolled loop's
    would.

    Args:
      parent: the model module being applied (``scan_applies`` says when).
      block: an unbound block (``Block(cfg, parent=None)``) whose call returns ``LayerOutput``.
      names: the params keys of the layers, in order.
      x: [B, T, d] the residual stream into the first block.
      args: the block's other positional call arguments (the same for every layer; a cache is not one).
      remat: "none", "full" or "dots": ``jax.checkpoint`` of the body with that policy.
    Returns:
      (x after the last block, the blocks' ``log_mask`` stacked [L, ...] or None).
    """
    params = parent.variables["params"]
    casts = _block_casts(block, params[names[0]], x, args)
    cast = lambda a, to: a if to is None else a.astype(to)  # noqa: E731
    stacked = jax.tree_util.tree_map(lambda to, *p: jnp.stack([cast(a, to) for a in p]), casts,
                                     *(params[n] for n in names), is_leaf=lambda c: c is None)
    sown = [c for c in _SOWN if parent.is_mutable_collection(c)]

    def body(h, p):
        if sown:
            out, state = block.apply({"params": p}, h, *args, mutable=sown)
        else:
            out, state = block.apply({"params": p}, h, *args), {}
        return out.x, (out.log_mask, state)

    if remat != "none":
        body = jax.checkpoint(body, policy=_saveable(remat), prevent_cse=False)
    x, (log_masks, state) = jax.lax.scan(body, x, stacked)
    for col, layers in state.items():
        for i, name in enumerate(names):
            parent.put_variable(col, name, jax.tree_util.tree_map(lambda a, i=i: a[i], layers))
    return x, log_masks


def dcp_aux(log_masks: jax.Array, segment_ids: jax.Array | None = None, *, with_loss: bool = True) -> dict:
    """The DCP entries of ``ModelOutput.aux`` (docs/design/dcp.md §3).

    Args:
      log_masks: [L, B, T, T] float32 log I of every layer.
      segment_ids: optional [B, T] int, packed documents (only pairs inside a document count).
      with_loss: include ``sparsity_loss`` (False for fixed sparse patterns, which have nothing to learn).

    Returns:
      {"log_masks": log_masks, "sparsity": [L] float32 (stop-gradient), "sparsity_loss": float32
      scalar, γ = 1, "causal" normalisation, 0 when T < 3}.
    """
    out = {"log_masks": log_masks,
           "sparsity": jax.lax.stop_gradient(sparsity(log_masks, segment_ids=segment_ids)[0])}
    if with_loss:
        out["sparsity_loss"] = (sparsity_loss(log_masks, 1.0, segment_ids=segment_ids)
                                if log_masks.shape[-1] >= 3 else jnp.zeros((), jnp.float32))
    return out
