"""The decoding engine: prefill, decode loop and teacher-forced scoring for every model family and cache policy.

Every model family takes the same decoding protocol: ``model.apply({"params": p}, tokens, cache=caches)``
returns a ``ModelOutput`` whose ``cache`` is the updated tuple of per-layer ``SlotKVCache``s (made by the
config's ``init_cache``). The call appends a chunk of T ≥ 1 tokens; what each query sees is decided by the
caches' policy (``fox_jax.cache.policies``: dense, dcp, acp, window:W, sinks:S+W) and any split of a sequence
into chunks gives the same logits under that policy; ``last_logits=True`` returns the last column's logits
alone (a prefill chunk skips the head over the rest). This module never asks which model it holds.

``generate`` is one jitted program: the prompt is prefilled in chunks of ``prefill_chunk`` tokens
(``lax.scan``; left-padded to a multiple of the chunk), then a ``lax.while_loop`` samples up to
``max_new_tokens`` tokens per row in blocks of ``steps_per_check`` steps and stops early, at the end of a
block, once every row has produced a stop token. No host synchronisation happens inside a block; the KV
memory is the pool of ``slots`` per row and layer, allocated once.

Prompts are **left-padded**: ``seq_start[b]`` pads precede row b's first real token, which gets position 0.

Pool size (``slots``): by default what the policy can ever need for the prompt plus the new tokens
(``min_slots``: everything for dense/dcp/acp, W for ``window:W``, S + W for ``sinks:S+W``), so
nothing overflows; every cache rounds its capacity up to a multiple of ``RING_BLOCK`` (the decode kernel's
block). A smaller pool is the fixed KV budget: a policy with a ``fixed_budget`` (dense, window, sinks) needs
at least ``min_slots`` (else ``ValueError``: the budget is too small for one sequence); ``dcp`` and ``acp``
keep a data-dependent number of tokens, so a pool smaller than the context may overflow, which the caches
count (``Generation.overflow``; the tokens are then not the policy's and the CLI says so).

The decode loop multiplies by the weights as the model would cast them, cast once before the loop
(``cast_plan``: only leaves that every use casts to one dtype; the results are bit-identical).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fox_jax.cache.policies import RING_BLOCK, CachePolicy, parse_policy
from fox_jax.models.family import cast_targets
from fox_jax.models.lm import head_table, mlp_tables
from fox_jax.nn.attention import fold_input_norms, gate_tables
from fox_jax.ops._common import check_seq_start
from fox_jax.sharding import place_for_decoding, under_mesh


STEPS_PER_CHECK = 8  # decode steps between two checks for the loop's end (``generate``'s default)


class Generation(NamedTuple):
    """Output of ``generate``.

    Attributes:
      tokens: [B, N] int32 sampled tokens; after a row's stop token (kept) the entries are −1.
      lengths: [B] int32 tokens generated per row (the stop token included).
      live_counts: [N, n_layers, B] float32 live tokens per layer and row (mean over key/value heads) of
        the caches that produced each token; rows after the loop stopped repeat the last value.
      overflow: [B] int32 entries the pool had no slot for (0: the output is exactly the policy's).
      caches: the final per-layer caches (continue with ``extend`` / ``generate(..., caches=...)``).
      provable (property): whether the policy's promise holds for this model (``CachePolicy.provable``;
        False: ``acp`` ran as a heuristic).
    """

    tokens: jax.Array
    lengths: jax.Array
    live_counts: jax.Array
    overflow: jax.Array
    caches: tuple

    @property
    def provable(self) -> bool:
        return all(c.provable for c in self.caches)


def _config(model):
    """The ``ModelFamily`` config of a model module (``model.cfg``)."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(cfg, "init_cache"):
        raise TypeError(f"model must be a fox_jax model (a module with a ModelFamily config .cfg), "
                        f"got {type(model).__name__}")
    return cfg


def min_slots(policy, context: int) -> int:
    """The pool (slots per row and layer) that ``policy`` needs for ``context`` tokens fed: the
    policy's ``max_live`` (dense, dcp, acp: ``context``; ``window:W``: W; ``sinks:S+W``: S + W)."""
    return parse_policy(policy).max_live(context)


def init_cache(model, batch_size: int, slots, *, policy="dense", seq_start=None, max_context: int | None = None):
    """Empty per-layer caches for ``model`` (``model.cfg.init_cache``; see ``FamilyModules.init_cache``)."""
    return _config(model).init_cache(batch_size, slots, policy=policy, seq_start=seq_start, max_context=max_context)


def calibrate_slots(caches, *, margin: float = 1.1, multiple: int = RING_BLOCK, max_groups: int = 3):
    """A pool sized from what caches actually held (their ``peak`` live counts, e.g. after generating or
    scoring representative text under a ``dcp`` or ``acp`` policy): per layer an int, or for per-head
    tables (``acp``) one count per key/value head, each ⌈peak · margin⌉ rounded up to ``multiple`` (the
    caches round to ``RING_BLOCK`` in any case).

    With per-head counts, the heads of a layer are binned into at most ``max_groups`` sizes (the sorted
    sizes cut at their largest gaps, each bin sized by its largest head): every distinct size is one more
    group, i.e. one more attention call per layer and step, so a few sizes keep the decode step fast while
    memory still follows the local/global split of the heads. Pass the result as ``slots=`` for the same
    policy. Host ints.
    """
    def size(peak: int) -> int:
        return max(multiple, -(-int(np.ceil(peak * margin)) // multiple) * multiple)

    out = []
    for cache in caches:
        per_head = {}
        for g in cache.groups:
            peaks = np.asarray(g.peak).max(axis=0)  # [nt]: the most any row held
            for i, h in enumerate(g.heads):
                per_head[h] = size(int(peaks[i if peaks.shape[0] > 1 else 0]))
        counts = np.asarray([per_head[h] for h in range(cache.kv_heads)])
        if not cache.policy.per_head:
            out.append(int(counts.max()))
            continue
        sizes = np.unique(counts)                          # ascending; cut the ladder at its largest gaps
        cuts = np.sort(np.argsort(-np.diff(sizes), kind="stable")[:max_groups - 1]) if len(sizes) > max_groups else \
            np.arange(len(sizes) - 1)
        tops = np.append(sizes[cuts], sizes[-1])           # the largest size of each bin
        out.append(tuple(int(tops[np.searchsorted(tops, c)]) for c in counts))
    return tuple(out)


def live_counts(caches) -> jax.Array:
    """[n_layers, B] float32 live tokens per layer and row (mean over key/value heads)."""
    return jnp.stack([c.live_count() for c in caches])


def cache_bytes(caches) -> dict:
    """KV memory of the caches (host ints): ``allocated`` (the pool: every slot of every row and layer)
    and ``live`` (the entries held now; k, v and the per-entry forget gates / interaction keys)."""
    return {"allocated": int(sum(c.allocated_bytes() for c in caches)),
            "live": int(round(float(sum(jnp.sum(c.live_bytes()) for c in caches))))}


def _check_tokens(tokens, name: str) -> jax.Array:
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] < 1 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"{name} must be an int array [B, T] with T ≥ 1, got {tokens.dtype}{tokens.shape}")
    return tokens.astype(jnp.int32)


def _check_positions(cfg, seq_start, fed: int) -> None:
    """Learned positions (GPT-2's) end at ``cfg.max_positions`` − 1; ``fed`` columns include pads."""
    limit = cfg.max_positions
    if limit is not None and fed - int(np.min(np.asarray(seq_start))) > limit:
        raise ValueError(f"the model has {limit} positions; the prompt and new tokens would need "
                         f"{fed - int(np.min(np.asarray(seq_start)))} (shorten the prompt or max_new_tokens)")


def _check_slots(policy: CachePolicy, slots, context: int) -> None:
    need = policy.max_live(context)
    if isinstance(slots, int):
        if slots < 1:
            raise ValueError(f"slots must be a positive int, got {slots}")
        if policy.fixed_budget and slots < need:
            raise ValueError(f"the KV pool is too small for one sequence: cache policy {policy.spec} needs {need} slots "
                             f"per row and layer for the {context} tokens fed (prompt + new tokens − 1, the last "
                             f"sample is never fed back), got {slots}")


def cast_plan(model, params, caches) -> tuple:
    """Which parameters the model only ever casts, and to what: for each leaf of ``params`` (tree order) the
    dtype name that every use of it in one decode step converts it to, or None (used otherwise, or not cast).

    Read from the jaxpr of ``model.apply`` on a [B, 1] chunk with ``caches`` (traced abstractly once per model
    and shapes). Casting those leaves once (``precast``) before a loop removes the per-step converts and
    changes no result: the model's own convert becomes the identity.
    """
    leaves, treedef = jax.tree.flatten(params)
    c_leaves, c_def = jax.tree.flatten(caches)
    spec = lambda xs: tuple(jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in xs)  # noqa: E731
    return _cast_plan(model, treedef, spec(leaves), c_def, spec(c_leaves))


@functools.lru_cache(maxsize=32)
def _cast_plan(model, treedef, leaves, c_def, c_leaves) -> tuple:
    caches = jax.tree.unflatten(c_def, c_leaves)
    tokens = jax.ShapeDtypeStruct((caches[0].seq_start.shape[0], 1), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p, c, tok: model.apply({"params": p}, tok, cache=c).logits)(
        jax.tree.unflatten(treedef, leaves), caches, tokens).jaxpr
    return cast_targets(jaxpr, len(leaves))


def precast(params, plan: tuple):
    """``params`` with each leaf cast to its ``cast_plan`` dtype (the others unchanged)."""
    leaves, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(treedef, [x if dt is None else x.astype(dt) for x, dt in zip(leaves, plan)])


# Whether decode loops fold each block's input RMSNorm into its attention's input projections (``decode_variables``:
# ``fox_jax.nn.attention.fold_input_norms``, s ⊙ W in place of W and the norm's scale ones, so no weight is copied).
# On by default: it takes FoX (Pro) 125M's `acp` step from 119 to 114 kernels and 0.410 to 0.401 ms of device time
# (dense 0.669 → 0.663; one H100, 2026-12-06, `profile_decode.py --kernel-variants base folded:norm=folded`, measured
# with the fold's weights in a copy of their own, the same step). The values move by rounding only (the normed rows
# and the weights rounded after the scale instead of before; 1e-5 of the logits in float32). Read when
# ``decode_variables`` runs, i.e. when ``generate`` / ``serve`` trace their program: after changing it, call
# ``jax.clear_caches()`` (a compiled program keeps what it traced).
FOLD_INPUT_NORMS = True

# Whether decode loops run each block's MLP norm and SwiGLU as one op (``decode_variables``: ``mlp_tables``; one Pallas
# kernel per block on GPU instead of XLA's four; no weight copy). Off by default: the `acp` step above goes from 119 to
# 96 kernels but only from 0.410 to 0.407 ms, the kernel taking 9.5 µs per layer, as long as the four it replaces (it
# reads its 8.3 MB at 0.9 TB/s; benchmarks/NOTES.md, "The next device session", item 6 (c)).
FUSE_DECODE_MLP = False

# Whether decode loops hand each FoX attention layer's output projection to its fused decode kernel (``decode_variables``:
# ``gate_tables(..., project_out=True)``; ``HeadOps.o_proj``): each program multiplies its heads' output by their rows
# of W_o and the step sums the float32 shares, so a layer's step spends no GEMM launch on it (one split only: dense
# rings long enough to split project after the combine, one GEMM as before). Values move by float32 summation order only.
# Off by default: it takes FoX (Pro) 125M's `acp` step at 8k from 114 to 102 kernels but from 0.409 to 0.421 ms of device
# time (window:256 0.445 → 0.453; one H100, 2026-12-07, ``profile_decode.py --kernel-variants base proj:proj=kernel``):
# each program's 96 KB of W_o after its attention loop costs ~4 µs a layer, the GEMM it replaces ~2.5.
FUSE_OUTPUT_PROJ = False


def _merged(a: dict, b: dict) -> dict:
    """Two nested dicts merged key by key (``b`` wins where both hold a leaf)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def decode_variables(params, plan: tuple, fold_norms: bool | None = None, fuse_mlp: bool | None = None,
                     project_out: bool | None = None) -> dict:
    """What a decode loop applies the model with, made once before the loop: the parameters cast as ``plan`` says
    (``precast``) and the ``"decode"`` collection: the attention layers' gate projections in the decode kernel's
    layout, with ``fold_norms`` (default ``FOLD_INPUT_NORMS``) the blocks' input norms folded into their attention's
    input projections in the parameters themselves (``fox_jax.nn.attention.fold_input_norms``) and the layers marked
    for the fused step (``gate_tables(..., folded_norms=True)``), with ``fuse_mlp`` (default ``FUSE_DECODE_MLP``) the
    blocks' gate/up weights in the fused MLP's layout (``fox_jax.models.lm.mlp_tables``), with ``project_out`` (default
    ``FUSE_OUTPUT_PROJ``) the attention layers marked to project their output in the decode kernel, and an untied LM head,
    cast, padded to aligned rows (``fox_jax.models.lm.head_table``)."""
    fold = FOLD_INPUT_NORMS if fold_norms is None else fold_norms
    fuse = FUSE_DECODE_MLP if fuse_mlp is None else fuse_mlp
    proj = FUSE_OUTPUT_PROJ if project_out is None else project_out
    cast = precast(fold_input_norms(params) if fold else params, plan)
    decode = gate_tables(cast, folded_norms=fold, project_out=proj).get("decode", {})
    if fuse:
        decode = _merged(decode, mlp_tables(cast).get("decode", {}))
    decode = _merged(decode, head_table(cast).get("decode", {}))
    return {"params": cast, **({"decode": decode} if decode else {})}


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, params, tokens, caches):
    """(float32 logits, caches) of one chunk of T ≥ 1 tokens appended to the caches."""
    out = model.apply({"params": params}, tokens, cache=caches)
    return out.logits.astype(jnp.float32), out.cache


def extend(model, params, caches, tokens) -> tuple[jax.Array, tuple]:
    """Append a chunk of T ≥ 1 tokens per row to live caches (jitted; compiled once per T and cache shape).

    Chunked prefill and multi-turn continuation: the chunk attends over what the caches hold and itself
    under their policy, so prefilling a sequence in any split gives the same logits.

    Args:
      model, params: the model and params the caches were filled with.
      caches: per-layer caches from ``init_cache``, ``prefill``, ``generate`` or a previous call.
      tokens: [B, T] int, the next tokens of each row (left pads only while a row has not reached
        its ``seq_start``).

    Returns:
      (logits [B, T, V] float32, updated caches).

    Raises:
      ValueError: tokens not [B, T] int or of another batch; a dense pool without room (checked on the host,
        one device sync); GPT-2 positions exhausted.
    """
    tokens = _check_tokens(tokens, "tokens")
    cache = caches[0]
    b, t = tokens.shape
    if b != cache.seq_start.shape[0]:
        raise ValueError(f"tokens must be [B, T] with B = {cache.seq_start.shape[0]} (the caches' batch), got {tokens.shape}")
    fed = int(cache.length) + t
    policy = cache.policy
    if policy.fixed_budget and policy.max_live(fed - int(jnp.min(cache.seq_start))) > cache.capacity:
        raise ValueError(f"the KV cache is full: cache policy {policy.spec} would hold "
                         f"{policy.max_live(fed - int(jnp.min(cache.seq_start)))} tokens per row after {int(cache.length)} "
                         f"columns fed and {t} more, the cache holds {cache.capacity}")
    _check_positions(_config(model), cache.seq_start, fed)
    return _forward(model, params, tokens, caches)


def prefill(model, params, tokens, *, policy="dense", slots: int | None = None, seq_start=None,
            max_context: int | None = None) -> tuple[jax.Array, tuple]:
    """Run a prompt through fresh caches in one chunk (``extend`` on ``init_cache``).

    Args:
      tokens: [B, T] int prompt, left-padded; seq_start: optional [B] int pads per row.
      policy: the cache policy; slots: the pool per row and layer (default ``min_slots(policy, T)``).
      max_context: N for ``acp`` (default T).

    Returns:
      (logits [B, T, V] float32, caches). Logits at pad positions are meaningless.
    """
    tokens = _check_tokens(tokens, "tokens")
    b, t = tokens.shape
    policy = parse_policy(policy)
    seq_start = check_seq_start(seq_start, b, t)
    slots = min_slots(policy, t) if slots is None else slots
    _check_slots(policy, slots, t)
    caches = init_cache(model, b, slots, policy=policy, seq_start=seq_start, max_context=max_context or t)
    return extend(model, params, caches, tokens)


def decode_step(model, params, caches, tokens) -> tuple[jax.Array, tuple]:
    """Feed one token per row: ``extend`` with T = 1; returns (logits [B, V] float32, caches)."""
    tokens = jnp.asarray(tokens)
    b = caches[0].seq_start.shape[0]
    if tokens.shape != (b,) or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an int array [B] = ({b},), got {tokens.dtype}{tokens.shape}")
    logits, caches = extend(model, params, caches, tokens[:, None])
    return logits[:, 0], caches


def sample_logits(logits: jax.Array, rng: jax.Array, *, temperature: float = 0.0, top_k: int | None = None,
                  top_p: float | None = None) -> jax.Array:
    """Next tokens from logits: greedy (argmax) when temperature == 0, else a categorical sample of
    softmax(logits / temperature) restricted to the ``top_k`` largest logits and to the smallest set of
    tokens whose probability reaches ``top_p`` (nucleus sampling; the most likely token always stays).

    Args:
      logits: [B, V] float; rng: PRNG key (unused when greedy).
      temperature: ≥ 0; top_k: None or an int in [1, V]; top_p: None or a float in (0, 1] (all static).

    Returns:
      [B] int32.
    """
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs                        # mass of the more likely tokens
        cut = jnp.where(before < top_p, sorted_logits, -jnp.inf)
        logits = jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], order].set(cut)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def _fresh_caches(model, tokens, policy: CachePolicy, slots, seq_start, prefill_chunk: int, context: int,
                  max_context: int | None = None):
    """Check positions and the pool for ``context`` tokens fed, left-pad [B, T] ``tokens`` to a multiple of the
    prefill chunk and make fresh caches (``max_context``: acp's N, default ``context``): (padded tokens, caches,
    chunk)."""
    b, t = tokens.shape
    seq_start = check_seq_start(seq_start, b, t)
    _check_positions(_config(model), seq_start, context)
    real = context - int(jnp.min(seq_start))
    slots = min_slots(policy, real) if slots is None else slots
    _check_slots(policy, slots, real)
    chunk = _chunk_size(policy, prefill_chunk, t)
    tokens, seq_start = _left_pad(tokens, seq_start, chunk)
    return tokens, init_cache(model, b, slots, policy=policy, seq_start=seq_start,
                              max_context=context if max_context is None else max_context), chunk


def _chunk_size(policy: CachePolicy, prefill_chunk: int, t: int) -> int:
    """Prefill chunk: the whole prompt where a fresh cache runs the flash op over it (a policy with a
    ``flash_prefill`` form: linear memory), else ``prefill_chunk`` (the masked path holds [chunk, cache] scores)."""
    return t if policy.flash_prefill() is not None else min(prefill_chunk, t)


def _left_pad(tokens, seq_start, chunk: int):
    """Left-pad [B, T] tokens to a multiple of ``chunk`` columns (more pads; positions are unchanged)."""
    extra = (-tokens.shape[1]) % chunk
    if extra:
        tokens = jnp.pad(tokens, ((0, 0), (extra, 0)))
    return tokens, seq_start + extra


def _scan_chunks(model, params, tokens, caches, chunk: int, targets=None):
    """Feed [B, T] tokens (T a multiple of ``chunk``) through the caches chunk by chunk in a ``lax.scan``; the
    first chunk on its own where a fresh cache takes another form (a policy's flash prefill) or a chunk is one
    token (acp's threshold is set by a fresh cache's first call). Every chunk in the scan is one copy of the model
    in the program instead of two: a third less to compile for ``generate``. Returns (caches, logits of the last
    column [B, V] float32, NLL [B, T] of ``targets`` or None)."""
    b, t = tokens.shape
    split = lambda x: x.reshape(b, t // chunk, chunk).transpose(1, 0, 2)
    xs = split(tokens)
    ys = None if targets is None else split(targets)
    first_alone = chunk == 1 or any(getattr(c, "policy", None) is None or c.policy.flash_prefill() is not None
                                    for c in caches)

    def body(caches, x):
        # without targets only the last column is sampled from: the head runs on that column alone
        out = model.apply({"params": params}, x[0], cache=caches, last_logits=x[1] is None)
        logits = out.logits.astype(jnp.float32)
        nll = None
        if x[1] is not None:
            lse = jax.nn.logsumexp(logits, axis=-1)
            nll = lse - jnp.take_along_axis(logits, x[1][..., None], axis=-1)[..., 0]
        return out.cache, (logits[:, -1], nll)

    nlls = []                                                               # [chunks, B, chunk] pieces
    if first_alone or xs.shape[0] == 1:
        caches, (last, nll) = body(caches, (xs[0], None if ys is None else ys[0]))
        xs, ys, nlls = xs[1:], None if ys is None else ys[1:], [] if nll is None else [nll[None]]
    else:  # the scan's carry: caches that have been fed (a static flag)
        caches = tuple(c.replace(fresh=False) for c in caches)
    if xs.shape[0]:
        caches, (lasts, nll) = lax.scan(body, caches, (xs, ys))
        last, nlls = lasts[-1], nlls + ([] if nll is None else [nll])
    nll = None if targets is None else jnp.concatenate(nlls, axis=0).transpose(1, 0, 2).reshape(b, t)
    return caches, last, nll


@functools.partial(jax.jit, static_argnums=(0,) + tuple(range(5, 13)))
def _generate(model, params, tokens, caches, rng, chunk, max_new_tokens, temperature, top_k, top_p, stop_tokens,
              plan, steps_per_check, steps):
    b = tokens.shape[0]
    variables = decode_variables(params, plan)  # the converts and layouts every step would do, done once
    params = variables["params"]
    sample = functools.partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p)
    stops = jnp.asarray(stop_tokens if stop_tokens else (-1,), jnp.int32)
    caches, logits, _ = _scan_chunks(model, params, tokens, caches, chunk)
    first = sample(logits, jax.random.fold_in(rng, 0))
    out = jnp.full((b, max_new_tokens), -1, jnp.int32).at[:, 0].set(first)
    lives = jnp.zeros((max_new_tokens, len(caches), b), jnp.float32).at[0].set(live_counts(caches))
    done = jnp.isin(first, stops)
    limit = jnp.minimum(steps, max_new_tokens)

    def body(state):
        i, caches, tok, done, out, lives = state
        # Every layer's column counter is the prefill's plus the steps taken: one add per step, not one per layer.
        # The loop carries the prefill's counters unchanged (XLA drops them from the loop state) and sets them after.
        length = caches[0].length + (i - 1)
        step = model.apply(variables, tok[:, None], cache=tuple(c.replace(length=length) for c in caches))
        nxt = sample(step.logits[:, -1].astype(jnp.float32), jax.random.fold_in(rng, i))
        nxt = jnp.where(done, -1, nxt)
        out = out.at[:, i].set(nxt)
        lives = lives.at[i].set(live_counts(step.cache))
        new = tuple(c.replace(length=old.length) for c, old in zip(step.cache, caches))
        return i + 1, new, jnp.where(done, tok, nxt), done | jnp.isin(nxt, stops), out, lives

    # Blocks of K steps with a fixed trip count: a data-dependent loop condition is a device -> host copy and a
    # wait before every iteration on GPU, so it is checked once per block; the < K steps left run one by one.
    k = steps_per_check
    state = (jnp.ones((), jnp.int32), caches, first, done, out, lives)
    if k > 1 and max_new_tokens > k:
        state = lax.while_loop(lambda s: (s[0] + k <= limit) & ~jnp.all(s[3]),
                               lambda s: lax.fori_loop(0, k, lambda _, s: body(s), s), state)
    i, caches, _, _, out, lives = lax.while_loop(lambda s: (s[0] < limit) & ~jnp.all(s[3]), body, state)
    caches = tuple(c.replace(length=c.length + (i - 1)) for c in caches)
    lives = jnp.where(jnp.arange(max_new_tokens)[:, None, None] < i, lives, lives[i - 1])
    lengths = jnp.sum(out >= 0, axis=1, dtype=jnp.int32)
    return Generation(out, lengths, lives, caches[0].overflow if len(caches) == 1 else
                      jnp.max(jnp.stack([c.overflow for c in caches]), axis=0), caches)


def generate(model, params, prompt_tokens, *, max_new_tokens: int, policy="dense", slots=None, seq_start=None,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, stop_tokens=(),
             rng: jax.Array | None = None, prefill_chunk: int = 512, mesh=None,
             max_context: int | None = None, steps: int | None = None,
             steps_per_check: int = STEPS_PER_CHECK) -> Generation:
    """Autoregressive generation under a cache policy, prefill and decode loop in one jitted program.

    Token i is sampled with key ``fold_in(rng, i)``, so the result does not depend on the prefill chunking.

    Args:
      model, params: a ``LanguageModel`` (FoX / Transformer, LLaMA or Pro, with or without DCP) or a ``GPT2``.
      prompt_tokens: [B, T] int, left-padded.
      max_new_tokens: N ≥ 1 tokens to sample per row (fewer when every row stops).
      policy: the cache policy (``fox_jax.cache.policies``: "dense", "dcp", "acp", "acp:LOG_EPS",
        "window:W", "sinks:S+W", or a ``CachePolicy``).
      slots: the KV pool, slots per row and layer: an int, or one entry per layer (for ``acp`` an entry may
        list one count per key/value head). Default ``min_slots(policy, T + N − 1)``.
      seq_start: optional [B] int left pads per row.
      temperature: 0 for greedy decoding, else the softmax temperature; top_k, top_p: sampling filters.
      stop_tokens: token ids that end a row (kept in the output).
      rng: PRNG key, required when temperature > 0.
      prefill_chunk: prompt tokens per prefill chunk for ``dcp``, ``acp`` and ``sinks`` (the prompt is left-padded
        to a multiple of it); ``dense`` and ``window`` prefill the whole prompt at once with the flash
        attention op.
      mesh: a ``jax.sharding.Mesh`` (``fox_jax.sharding.make_mesh``) to run sharded on, as training: params by
        the training rules, prompt rows over ``data`` × ``fsdp``, caches by their ``logical_axes()`` (rows over
        ``data`` × ``fsdp``, key/value heads over ``tensor``); B must be a multiple of data × fsdp. The tokens
        equal the unsharded ones (docs/multi_gpu.md). None: wherever the inputs are (one device). On GPUs the
        decode kernel runs per shard only under the GSPMD partitioner with jax 0.11.2: call
        ``fox_jax.sharding.select_partitioner(mesh)`` first, as ``fox-jax generate --mesh`` does (under Shardy XLA
        gathers the cache around it: correct, not fast).
      max_context: N of ``acp``'s threshold δ = −(2U + log N) + log ε, the most keys a query may see (default
        T + max_new_tokens − 1; ``serve`` uses its longest request's for every request). Other policies ignore it.
      steps: sample at most this many of the N tokens (1 ≤ steps ≤ N; default N), the rest of ``tokens`` −1. A
        runtime value: every ``steps`` runs the same compiled program, so e.g. the prefill alone (``steps=1``)
        is timed with the decode loop's program, not a second compile (``benchmarks/bench_decode.py``).
      steps_per_check: K ≥ 1, decode steps per check for the end (every row stopped, or ``steps`` reached): the
        loop runs blocks of K steps with a fixed trip count, then the < K steps left one by one. On GPU each
        check is a device → host copy and a wait, so K > 1 lets the host queue the next steps' kernels while
        the device runs; the tokens do not depend on K, but after every row stopped the caches may be fed up to
        K − 1 more (masked) steps (``caches[i].length`` says how many).

    Returns:
      ``Generation(tokens, lengths, live_counts, overflow, caches)``.

    Raises:
      ValueError: bad arguments (one line each): an unknown policy, a pool too small for one sequence,
        positions beyond the model's ``max_positions`` (GPT-2's n_positions), a policy the model cannot
        run (``dcp`` without DCP weights, ``acp`` without forget gates), a batch the mesh's data axes do not divide.
      TypeError: not a fox_jax model.
    """
    tokens = _check_tokens(prompt_tokens, "prompt_tokens")
    b, t = tokens.shape
    policy = parse_policy(policy)
    sampling, stop_tokens, rng = _check_decoding(_config(model), max_new_tokens, prefill_chunk, temperature, top_k,
                                                 top_p, stop_tokens, rng)
    context = t + max_new_tokens - 1          # tokens ever fed: the prompt and all but the last sample
    if max_context is not None and (not isinstance(max_context, int) or max_context < 1):
        raise ValueError(f"max_context must be None or a positive int, got {max_context!r}")
    if not isinstance(steps_per_check, int) or steps_per_check < 1:
        raise ValueError(f"steps_per_check must be a positive int, got {steps_per_check!r}")
    if steps is not None and (not isinstance(steps, int) or not 1 <= steps <= max_new_tokens):
        raise ValueError(f"steps must be None or an int in [1, max_new_tokens={max_new_tokens}], got {steps!r}")
    tokens, caches, chunk = _fresh_caches(model, tokens, policy, slots, seq_start, prefill_chunk, context,
                                          max_context)
    plan = cast_plan(model, params, caches)
    run = _generate
    if mesh is not None:
        params, tokens, caches = place_for_decoding(mesh, params, tokens, caches)
        run = under_mesh(mesh, _generate)
    return run(model, params, tokens, caches, rng, chunk, max_new_tokens, *sampling, stop_tokens, plan,
               steps_per_check, jnp.asarray(max_new_tokens if steps is None else steps, jnp.int32))


def _check_decoding(cfg, max_new_tokens, prefill_chunk, temperature, top_k, top_p, stop_tokens, rng):
    """The decoding arguments of ``generate`` / ``serve`` checked: ((temperature, top_k, top_p) as static
    Python values, stop tokens as a tuple of ints, rng (a default key when greedy)).

    Raises:
      ValueError: one line naming the argument.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive int, got {prefill_chunk!r}")
    temperature = float(temperature)
    if temperature < 0:
        raise ValueError(f"temperature must be ≥ 0, got {temperature}")
    if temperature > 0 and rng is None:
        raise ValueError("rng is required when temperature > 0")
    if top_k is not None and (not isinstance(top_k, int) or not 1 <= top_k <= cfg.vocab_size):
        raise ValueError(f"top_k must be None or an int in [1, {cfg.vocab_size}], got {top_k!r}")
    if top_p is not None and not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p must be None or a float in (0, 1], got {top_p!r}")
    rng = jax.random.PRNGKey(0) if rng is None else rng
    return ((temperature, top_k, None if top_p is None else float(top_p)), tuple(int(s) for s in stop_tokens), rng)


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _score(model, params, tokens, caches, chunk, plan, last):
    params = precast(params, plan)
    targets = jnp.concatenate([tokens[:, 1:], last[:, None].astype(tokens.dtype)], axis=1)
    caches, _, nll = _scan_chunks(model, params, tokens, caches, chunk, targets)
    return nll, caches


def token_losses_under_policy(model, params, tokens, *, policy="dense", slots=None, seq_start=None,
                              prefill_chunk: int = 512, mesh=None, next_tokens=None, with_live: bool = False):
    """Teacher-forced next-token losses with exactly the visibility generation has under ``policy``.

    The tokens are fed through the caches in chunks (the prefill path of ``generate``), so every
    prediction sees what the policy's cache would hold at that point: equal to prefill + decode.

    Args:
      tokens: [B, T] int (T ≥ 2), left-padded; seq_start: optional [B] int pads.
      policy, slots, prefill_chunk, mesh: as ``generate`` (default pool: ``min_slots(policy, T)``).
      next_tokens: optional [B] int, the token after each row's last one: then the last position is scored
        too (nll [B, T]: the T predictions of a training window of T inputs and its shifted targets).
      with_live: also return the live tokens the caches hold after the last token ([n_layers, B] float32, mean
        over key/value heads: ``live_counts``), e.g. for the fraction of the context a policy evicted.

    Returns:
      (nll [B, T − 1] float32 (with ``next_tokens``: [B, T]), the loss of token t + 1 given tokens ≤ t
      (meaningless where token t is a pad); overflow [B] int32, > 0 when the pool was too small for the policy)
      and, with ``with_live``, the live counts as a third element.
    """
    tokens = _check_tokens(tokens, "tokens")
    b, t = tokens.shape
    if t < 2 and next_tokens is None:
        raise ValueError(f"tokens must have T ≥ 2 to score a next token, got {tokens.shape}")
    scored = t
    if next_tokens is None:
        next_tokens, scored = jnp.zeros((b,), jnp.int32), t - 1
    else:
        next_tokens = jnp.asarray(next_tokens)
        if next_tokens.shape != (b,) or not jnp.issubdtype(next_tokens.dtype, jnp.integer):
            raise ValueError(f"next_tokens must be an int array [B] = ({b},), got {next_tokens.dtype}{next_tokens.shape}")
    padded, caches, chunk = _fresh_caches(model, tokens, parse_policy(policy), slots, seq_start, prefill_chunk, t)
    plan = cast_plan(model, params, caches)
    score = _score
    if mesh is not None:
        params, padded, caches = place_for_decoding(mesh, params, padded, caches)
        score = under_mesh(mesh, _score)
    nll, caches = score(model, params, padded, caches, chunk, plan, next_tokens)
    overflow = jnp.max(jnp.stack([c.overflow for c in caches]), axis=0)
    nll = nll[:, padded.shape[1] - t:][:, :scored]
    return (nll, overflow, live_counts(caches)) if with_live else (nll, overflow)


__all__ = ["Generation", "cache_bytes", "calibrate_slots", "cast_plan", "decode_step", "decode_variables", "extend",
           "generate", "init_cache", "live_counts", "min_slots", "precast", "prefill", "sample_logits",
           "token_losses_under_policy"]
