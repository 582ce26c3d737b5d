"""The attention layer of FoX and of the Transformer baselines (docs/design/fox_acp.md §2.1–2.4), with
optional Dynamic Context Pruning (docs/design/dcp.md §1)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from fox_jax.cache.slots import fuses_step, slot_attention
from fox_jax.cache.visibility import LayerFacts
from fox_jax.nn.layers import DenseParams, HeadNormScale, fused_dense, normal_init
from fox_jax.ops import acp, forgetting_attention, resolve_implementation
from fox_jax.ops.head_ops import HeadOps, head_epilogue, head_prologue, rms_scale
from fox_jax.ops.context_pruning import cumulative_keep_log_mask, dcp_attention, keep_logits
from fox_jax.ops.decode_attention import gate_table
from fox_jax.ops.pallas import forward_tiling, mosaic_auto_ok


# The layer's float32 gate projections as its parameters name them, in the decode kernel's order.
GATE_PROJECTIONS = ("k_shift_proj", "v_shift_proj", "fgate_proj")
# The projections of the layer's input in the compute dtype (the decode GEMM's rows), in the kernel's row order.
ROW_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "ogate_proj")


def _kv_heads(tree) -> int:
    if "k_shift_proj" in tree:
        return tree["k_shift_proj"]["kernel"].shape[1]
    # H forget gates; H·D query and Hkv·D key columns
    h, kv_columns, q_columns = (tree[n]["kernel"].shape[1] for n in ("fgate_proj", "k_proj", "q_proj"))
    return h * kv_columns // q_columns


def _folded(scale, kernel):
    """s ⊙ W in float32: an input norm's scale [d_in] folded into a projection's kernel [d_in, n]."""
    return scale.astype(jnp.float32)[:, None] * kernel.astype(jnp.float32)


def _table(tree) -> tuple:
    names = [n for n in GATE_PROJECTIONS if n in tree]
    return gate_table(tuple((tree[n]["kernel"], tree[n].get("bias")) for n in names), _kv_heads(tree))


# The layer's projections of its (normed) input: what an input norm's scale folds into (``fold_input_norms``).
INPUT_PROJECTIONS = ROW_PROJECTIONS + GATE_PROJECTIONS + ("q_int", "k_int")


def fold_input_norms(params):
    """``params`` with each block's input RMSNorm scale s folded into its attention layer's input projections, in
    float32: every kernel W of ``INPUT_PROJECTIONS`` becomes s ⊙ W (s scales W's input rows) and ``attn_norm``'s scale
    becomes ones — in the layers a fused decode step can take folded, those with gate projections (FoX; the others
    are returned unchanged). The same function up to rounding: RMSNorm(x)·W = (x · r) · (s ⊙ W) with r =
    rsqrt(mean(x²) + eps), so a prefill or a training-path call with the result gives the original's values to float32
    rounding (bf16: the normed rows and the weights are rounded after the scale instead of before), and a fused
    decode step can multiply the un-normalised residual by the layer's own kernels (``gate_tables(...,
    folded_norms=True)``) with no copy of them.

    Raises:
      ValueError: an attention layer beside an ``attn_norm`` with a projection whose kernel is not known to read the
        layer's input or output (``INPUT_PROJECTIONS``, ``o_proj``): it could not be left unfolded without changing
        the model's values.
    """
    def walk(tree, path):
        if not isinstance(tree, Mapping):
            return tree
        out = {k: walk(v, f"{path}/{k}") for k, v in tree.items()}
        norm, attn = tree.get("attn_norm"), tree.get("attn")
        if isinstance(norm, Mapping) and "scale" in norm and isinstance(attn, Mapping) and any(
                n in attn for n in GATE_PROJECTIONS):
            unknown = [n for n, v in attn.items() if isinstance(v, Mapping) and "kernel" in v
                       and n not in INPUT_PROJECTIONS and n != "o_proj"]
            if unknown:
                raise ValueError(f"fold_input_norms: {path}/attn has projections {unknown} that are neither input "
                                 f"projections {INPUT_PROJECTIONS} nor o_proj")
            scale = norm["scale"]
            out["attn"] = {n: ({**v, "kernel": _folded(scale, v["kernel"])} if n in INPUT_PROJECTIONS else v)
                           for n, v in out["attn"].items()}
            out["attn_norm"] = {**out["attn_norm"], "scale": jnp.ones_like(scale)}
        return out

    return walk(params, "")


def gate_tables(params, folded_norms: bool = False, project_out: bool = False) -> dict:
    """The ``"decode"`` variables of the attention layers of a parameter tree, at each layer's path: for a layer with
    gate projections (KV-shift, forget gates), ``gate_table`` = those projections in the decode kernel's layout
    (``fox_jax.ops.decode_attention.gate_table``: each key/value head's rows contiguous); with ``folded_norms`` — the
    blocks' input norms folded into ``params`` by ``fold_input_norms`` — and a block's input RMSNorm beside the
    layer (``attn_norm``), also ``folded`` = {"gate_table": the same table}: the mark with which a decode step
    multiplies the un-normalised residual x by the layer's own (folded) kernels (``HeadOps.x_norm_eps``: the kernel
    applies the norm as a row scale r, so the step spends no norm kernel before its GEMM; no weight is copied); with
    ``project_out`` also ``project_out`` = the layer's ``o_proj`` kernel (the same array: a mark, no copy), with which
    a fused decode step hands W_o to the decode kernel (``HeadOps.o_proj``: each program projects its heads' output,
    so the step spends no GEMM launch on the output projection). Pass the tree as the decode loop applies it (cast).

    Made once before a decode loop and applied as ``{"params": params, **gate_tables(params)}``, so that no step
    re-arranges the weights (two XLA kernels per layer and step otherwise); the layer uses them when they are there
    and the same numbers without them. Returns {} for a model without gate projections.
    """
    def walk(tree):
        if not isinstance(tree, Mapping):
            return {}
        out = {k: sub for k, v in tree.items() if (sub := walk(v))}
        if any(n in tree for n in GATE_PROJECTIONS):
            out["gate_table"] = _table(tree)
        layer = out.get("attn")
        if folded_norms and layer is not None and "scale" in tree.get("attn_norm", {}):
            out["attn"] = layer = {**layer, "folded": {"gate_table": layer["gate_table"]}}
        if project_out and layer is not None and "kernel" in tree["attn"].get("o_proj", {}):
            out["attn"] = {**layer, "project_out": tree["attn"]["o_proj"]["kernel"]}
        return out

    tables = walk(params)
    return {"decode": tables} if tables else {}


@flax.struct.dataclass
class LayerOutput:
    """What every attention layer and block returns, whatever its config.

    Attributes:
      x: [B, T, d] the layer's output (compute dtype; a block's residual stream).
      cache: the updated per-layer cache when the layer was called with one, else None.
      log_mask: DCP (or a fixed sparse pattern): the layer's log-mask log I [B, T, T] float32 (0 kept,
        ``LOG_FLOOR`` ≈ −92.1 or −inf dropped), else None.
    """

    x: jax.Array
    cache: Any = None
    log_mask: jax.Array | None = None


class ForgettingAttentionLayer(nn.Module):
    """q/k/v projections, forget gate, forgetting attention, output projection (spec §2.1 order).

    FoX (LLaMA): no RoPE; one forget-gate logit per head from ``fgate_proj`` (d → H, with bias,
    bias initialised to 0 so f ≈ 0.5 at init); log f = log_sigmoid(logit) in float32.
    Transformer (LLaMA): no forget gate, RoPE on q and k.
    Pro components (each a config flag): KV-shift of k and v (``k_shift_proj``/``v_shift_proj``: d → Hkv,
    α in float32), then per-head QK-norm, then RoPE; after attention a per-head output RMSNorm times
    σ(``ogate_proj`` x). With QK-norm and ``adaptive_threshold="auto"`` the ACP threshold comes from the
    QK-norm weights (per head, spec §5.2) rather than from the activations. This per-head work is a
    ``fox_jax.ops.head_ops.HeadOps`` (data): applied here without a cache (``head_prologue`` /
    ``head_epilogue``); with a cache the raw projections and the ops go to the cache's attention, which does
    them inside the decode kernel on a decode step (``fox_jax.cache.slots.slot_attention``) — there also the output
    projection when the layer's ``"decode"`` collection has the ``project_out`` mark (``gate_tables(params,
    project_out=True)``; ``HeadOps.o_proj``: each program projects its heads' output, the cache's attention sums them).

    DCP (``cfg.dcp``, docs/design/dcp.md §1.1–1.4): from the same normed input x, in float32, bias-free
    ``q_int``/``k_int`` (d → r, N(0, init_std)) and a scalar ``beta`` (init ``cfg.dcp_beta_init``) give
    the keep logits z = q_int·k_intᵀ/√r + β [B, T, T] and the cumulative keep log-mask
    log I = ``cumulative_keep_log_mask(z, alpha)`` (once per layer, shared by all heads), which
    ``dcp_attention`` adds to the logits, together with the forget-gate decay for FoX archs
    (``log_fgate``; None for Transformer archs). RoPE, QK-norm, KV-shift and the output gate/norm
    are unchanged; ``cfg.attention_impl`` is not used on this path (``dcp_attention`` is blockwise
    XLA with tiles of ``cfg.attention_block``).

    Attributes:
      cfg: the model's ``fox_jax.models.lm.ModelConfig`` (the fields read here; this module does not
        import the models).

    Call args:
      x: [B, T, d] normed hidden states (compute dtype).
      segment_ids: [B, T] int or None (packed documents).
      positions: [B, T] int positions inside each document (RoPE only), default arange.
      cache: optional ``fox_jax.cache.SlotKVCache`` (incremental decoding; then ``segment_ids``
        and ``positions`` must be None). The T ≥ 1 tokens are appended at columns ``cache.length`` ..
        ``cache.length`` + T − 1 and attend over the cached tokens and themselves as the cache's policy
        allows (a prefill is the first chunk of a fresh cache; see ``fox_jax.cache.slots``). Positions
        are the cache columns minus ``cache.seq_start`` (left padding); the KV-shift of the first real
        token sees zeros and any later chunk's shift continues from the cached state. The layer hands the
        cache model facts (``LayerFacts``: the QK-norm logit bound, DCP's q_int / k_int / β); the cache's
        policy decides from them (e.g. ``acp``'s threshold). DCP models decode with the step mask (α = ∞).
      alpha: DCP only (required then, ignored otherwise): α of the α-sigmoid keep probability,
        a Python float ≥ 1, ``float('inf')`` for the inference step mask, or a traced float32 scalar.
      residual: with a cache, the block's residual stream before its input RMSNorm (x = RMSNorm(residual), eps
        ``cfg.norm_eps``), or None. On a fused decode step (``fuses_step``) of a layer whose parameters hold the
        folded s ⊙ W (``fold_input_norms``) and whose ``"decode"`` collection has the ``folded`` mark
        (``gate_tables(params, folded_norms=True)``), the step multiplies the residual by them and the decode kernel
        applies the norm as a row scale (``HeadOps.x_norm_eps``): x itself is not read (XLA drops the norm kernel).
    Returns:
      ``LayerOutput(x [B, T, d] in the compute dtype, cache: the updated cache when one was given,
      log_mask: with DCP log I [B, T, T] float32, 0 = kept, ``LOG_FLOOR`` ≈ −92.1 = dropped)``. With
      ACP on (and no cache), sows ``acp_fraction_skipped`` (a float32 scalar, fraction of causal tiles
      skipped) into the ``intermediates`` collection.
    Raises:
      ValueError: a cache together with segment_ids or positions; a chunk that does not fit the
        cache capacity; DCP without ``alpha`` and without a cache.
    """

    cfg: Any

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None, cache=None, alpha=None, residual=None) -> LayerOutput:
        cfg = self.cfg
        if cfg.dcp and alpha is None and cache is None:
            raise ValueError("alpha is required when ModelConfig.dcp is True (use float('inf') for inference)")
        dtype = jnp.dtype(cfg.dtype)
        b, t, _ = x.shape
        h, hkv, dh = cfg.n_heads, cfg.kv_heads, cfg.dim_per_head
        if cache is not None and (segment_ids is not None or positions is not None):
            raise ValueError("with a cache, segment_ids and positions must be None "
                             "(positions come from the cache columns and seq_start)")
        dense = lambda n, name, bias=False, dt=dtype: nn.Dense(
            n, use_bias=bias, dtype=dt, param_dtype=jnp.float32, kernel_init=normal_init(cfg.init_std), name=name)
        # The projections of x, (output, features, parameter, bias): in the compute dtype and in float32.
        low = [("q", h * dh, "q_proj", False), ("k", hkv * dh, "k_proj", False), ("v", hkv * dh, "v_proj", False)]
        low += [("ogate", h * dh, "ogate_proj", False)] if cfg.output_gate else []
        f32 = [("k_shift", hkv, "k_shift_proj", False), ("v_shift", hkv, "v_shift_proj", False)] \
            if cfg.kv_shift else []
        f32 += [("fgate", h, "fgate_proj", True)] if cfg.use_fgate else []
        f32 += [("q_int", cfg.interaction_dim, "q_int", False), ("k_int", cfg.interaction_dim, "k_int", False)] \
            if cfg.dcp else []
        groups = [(dtype, low), (jnp.dtype(jnp.float32), f32)] if dtype != jnp.float32 else [(dtype, low + f32)]
        # A decode step may multiply the un-normalised residual by the folded projections (see ``residual``).
        fused = cache is not None and fuses_step(cache, t, cfg.use_rope)  # a decode step the kernel does it all for
        fold = (fused and self.has_variable("decode", "folded") and residual is not None and not cfg.dcp
                and x.shape[-1] % 16 == 0 and any(name in GATE_PROJECTIONS for _, _, name, _ in f32))
        if fold:
            row_scale = rms_scale(residual, cfg.norm_eps)  # [B, T, 1]
        y, packed, weights = {}, {}, {}
        for dt, members in groups:
            if not members:
                continue
            if cache is None:  # B·T rows per matmul; each kernel shards by its own heads over `tensor`
                y.update({o: dense(n, name, bias, dt)(x) for o, n, name, bias in members})
            else:  # decoding: a step of B rows is launch-bound, so one matmul per group (same parameters)
                ws = [DenseParams(n, bias, cfg.init_std, name=name)(x.shape[-1]) for _, n, name, bias in members]
                if fold:  # r · (residual · (s ⊙ W)) + bias = RMSNorm(residual) · W + bias, with W here already
                    # s ⊙ W (``fold_input_norms``): the kernel's raw rows
                    raw, packed[members[0][0]] = fused_dense(residual, [(k, None) for k, _ in ws], dt, packed=True)
                    # the XLA paths' values (unread on the kernel's path: XLA drops them)
                    outs = [(row_scale * o.astype(jnp.float32) + (0.0 if b is None else b.astype(jnp.float32))
                             ).astype(dt) for o, (_, b) in zip(raw, ws)]
                else:
                    outs, packed[members[0][0]] = fused_dense(x, ws, dt, packed=True)
                y.update(zip([o for o, *_ in members], outs))
                weights.update(zip([o for o, *_ in members], ws))
        q = y["q"].reshape(b, t, h, dh)
        k = y["k"].reshape(b, t, hkv, dh)
        v = y["v"].reshape(b, t, hkv, dh)
        # The per-head work around attention as data (KV-shift, QK-norm, RoPE; output norm and gate): applied below
        # without a cache, by the cache's attention with one (inside the decode kernel on a decode step).
        ops = HeadOps(qk_eps=1e-5, o_eps=cfg.norm_eps, rope_base=cfg.rope_base if cfg.use_rope else None)
        if cfg.kv_shift:
            ops = ops.replace(k_shift=y["k_shift"], v_shift=y["v_shift"])
        threshold = cfg.adaptive_threshold
        logit_bound = None  # a model fact: |scale·q·k| ≤ U_h for every pair (QK-norm), else no static bound
        if cfg.qk_norm:
            wq = HeadNormScale(cfg.qk_norm_shared, name="q_norm")(h, dh)
            wk = HeadNormScale(cfg.qk_norm_shared, name="k_norm")(hkv, dh)
            ops = ops.replace(q_scale=wq, k_scale=wk)
            if not cfg.qk_norm_shared and hkv != h:
                wk = jnp.repeat(wk, h // hkv, axis=0)
            logit_bound = jnp.broadcast_to(acp.qk_norm_logit_bound(wq, wk), (h,))
            if cache is None and isinstance(threshold, str) and threshold == "auto":
                threshold = jnp.broadcast_to(acp.threshold_from_bound(logit_bound, t), (b, h))
        if cfg.output_norm:
            ops = ops.replace(o_scale=HeadNormScale(False, name="o_norm")(h, dh))
        if cfg.output_gate:
            ops = ops.replace(o_gate=y["ogate"].reshape(b, t, h, dh))
        project = fused and self.has_variable("decode", "project_out")
        if project:  # W_o by query head, for the decode kernel (the same parameters as ``dense(.., "o_proj")``)
            w_o, _ = DenseParams(cfg.d_model, False, cfg.init_std, name="o_proj")(h * dh)
            ops = ops.replace(o_proj=w_o.astype(dtype).reshape(h, dh, cfg.d_model))
        if packed:  # decoding: the GEMM's whole output, for the decode kernel to read in place, and the gates'
            # float32 projections as data (the kernel computes the logits it reads: no kernel of their own)
            rows = packed["q"] if len(packed) > 1 else packed["q"][..., :sum(n for _, n, _, _ in low)]
            gates = [weights[o] for o, _, name, _ in f32 if name in GATE_PROJECTIONS]  # the kernel's order
            table = self.get_variable("decode", "gate_table") if self.has_variable("decode", "gate_table") else None
            ops = ops.replace(rows=rows.reshape(b, t, -1, dh), gate_x=(residual if fold else x) if gates else None,
                              gate_weights=tuple(gates) if gates else None, gate_table=table if gates else None,
                              x_norm_eps=cfg.norm_eps if fold else None)
        log_fgate = None
        if cfg.use_fgate:
            log_fgate = jax.nn.log_sigmoid(y["fgate"])  # [B, T, H] float32
            self.sow("gates", "log_fgate", log_fgate)  # kept only when the caller asks: mutable=["gates"]
        log_mask = q_int = k_int = beta = None
        if cfg.dcp:
            q_int, k_int = y["q_int"], y["k_int"]  # [B, T, r] float32
            beta = self.param("beta", nn.initializers.constant(cfg.dcp_beta_init), (), jnp.float32)
        if cache is not None:  # decoding: the cache's policy decides what each query sees, from model facts
            o, cache = slot_attention(cache, q, k, v, log_fgate, head_ops=ops,
                                      facts=LayerFacts(logit_bound, q_int, k_int, beta))
            if project:  # o is o·W_o already
                return LayerOutput(o, cache, log_mask)
            return LayerOutput(dense(cfg.d_model, "o_proj")(o.reshape(b, t, h * dh)), cache, log_mask)
        q, k, v, _ = head_prologue(ops, q, k, v, positions=positions, segment_ids=segment_ids)
        if cfg.dcp:
            z = keep_logits(q_int, k_int, beta)                   # [B, T, T] float32, dcp.md §1.2
            log_mask = cumulative_keep_log_mask(z, alpha)          # §1.3, §1.5: once per layer
            o = dcp_attention(q, k, v, log_mask, log_fgate, segment_ids=segment_ids,
                              block_q=cfg.attention_block, block_k=cfg.attention_block,
                              implementation=cfg.dcp_impl)
        else:
            o = forgetting_attention(
                q, k, v, log_fgate, segment_ids=segment_ids, adaptive_threshold=threshold,
                implementation=cfg.attention_impl, block_q=cfg.attention_block, block_k=cfg.attention_block)
            if threshold is not None and log_fgate is not None:
                self._sow_pruning(q, k, log_fgate, threshold)
        o = head_epilogue(ops, o)
        return LayerOutput(dense(cfg.d_model, "o_proj")(o.reshape(b, t, h * dh)), cache, log_mask)

    def _sow_pruning(self, q, k, log_fgate, threshold):
        """Sow the fraction of causal attention tiles ACP skips, at the tiling of the implementation
        that runs: the Pallas forward kernel's tiles, or ``attention_block`` for the XLA path."""
        cfg = self.cfg
        t = q.shape[1]
        lam = jax.lax.stop_gradient(jnp.cumsum(log_fgate, axis=1))
        delta = acp.resolve_threshold(threshold, q, k, cfg.dim_per_head ** -0.5)
        impl = resolve_implementation(cfg.attention_impl, mosaic_ok=mosaic_auto_ok(q, k))
        if impl in ("pallas", "mosaic"):
            bq, bk = forward_tiling(impl, cfg.dim_per_head, t, t)
        else:
            bq = bk = min(cfg.attention_block, -(-t // 8) * 8)
        starts = acp.kv_block_start(lam, delta, tq=t, block_q=bq, block_k=bk)
        stats = acp.pruning_stats(starts, tq=t, tk=t, block_q=bq, block_k=bk)
        self.sow("intermediates", "acp_fraction_skipped", stats["fraction_skipped"])
