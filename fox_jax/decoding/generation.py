"""Prefill, decode steps and ``generate`` for FoX / Transformer and GPT-2 (dense or DCP-pruned caches).

Every model family takes the same decoding protocol: ``model.apply({"params": p}, tokens,
cache=caches)`` returns a ``ModelOutput`` whose ``cache`` is the updated tuple with one cache per layer
(``LayerKVCache`` or, for DCP GPT-2, ``PackedKVCache``), made by the config's ``init_cache``. What
differs between families comes from the config (``model.cfg``: ``init_cache``, ``max_positions``,
``vocab_size``) and from the cache type (``check_room``); this module never asks which model it holds.
The call appends a chunk of T ≥ 1 tokens to the caches: a prefill on fresh caches (``prefill``), a chunk of a chunked prefill or the next turn of a
conversation (``extend``), one decode step (``decode_step``); any split of a sequence gives the logits
of one forward pass over it. Prompts are **left-padded**: ``seq_start[b]`` pads precede row b's first
real token, which gets position 0.

Cache capacity (the decision for a full cache):

* **dense** caches are allocated once with C = ``cache_capacity`` columns (default: exactly
  T + max_new_tokens − 1, all the tokens that are ever fed). They never grow; a request that would
  overflow raises ``ValueError`` before anything runs (``generate`` checks statically,
  ``extend`` and ``decode_step`` read the length back).
* **packed** (DCP) caches are sized on the host between chunks of ``chunk_size`` decode steps: the
  live slots are compacted and C is set to the power-of-two bucket (≥ 64) of max live + chunk, so
  a chunk can never overflow, memory follows the live count, and each bucket compiles once.
  ``cache_capacity`` is then the upper limit of C; ``generate`` raises ``ValueError`` when the live
  tokens reach it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fox_jax.cache.packed import resize_packed_cache
from fox_jax.ops._common import check_seq_start

MIN_BUCKET = 64


class Generation(NamedTuple):
    """Output of ``generate``.

    Attributes:
      tokens: [B, max_new_tokens] int32 sampled tokens.
      live_counts: [max_new_tokens, n_layers, B] int32 real tokens held per layer and row by the cache
        that produced each token (after the prefill for token 0; constant across layers for dense
        caches, the DCP survivors for packed ones).
      caches: the final per-layer caches.
    """

    tokens: jax.Array
    live_counts: jax.Array
    caches: tuple


def _config(model):
    """The ``ModelFamily`` config of a model module (``model.cfg``)."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(cfg, "init_cache"):
        raise TypeError(f"model must be a fox_jax model (a module with a ModelFamily config .cfg), "
                        f"got {type(model).__name__}")
    return cfg


def init_cache(model, batch_size: int, capacity: int, *, seq_start=None, packed: bool = False) -> tuple:
    """Empty per-layer caches for ``model`` (``model.cfg.init_cache``).

    Args:
      model: a fox_jax model (``LanguageModel`` or ``GPT2``).
      batch_size: B.
      capacity: C, columns (dense) or slots (packed) per layer.
      seq_start: optional [B] int left pads per row.
      packed: DCP packed caches (GPT-2 with ``cfg.dcp`` only); else dense ``LayerKVCache``.

    Returns:
      tuple of ``n_layers`` ``LayerKVCache`` or ``PackedKVCache``.

    Raises:
      TypeError: not a fox_jax model. ValueError: packed for a model without packed caches, bad
        capacity/seq_start. NotImplementedError: a model that cannot decode (a DCP ``LanguageModel``).
    """
    return _config(model).init_cache(batch_size, capacity, seq_start=seq_start, packed=packed)


def live_counts(caches) -> jax.Array:
    """[n_layers, B] int32 real tokens held per layer and row."""
    return jnp.stack([c.live_count() for c in caches])


def cache_bytes(caches) -> dict:
    """KV memory of the caches (host ints): ``live`` (bytes of the tokens held; k, v and the forget
    gates or k_int) and ``allocated`` (the same per token times the capacity, all rows)."""
    counts = np.asarray(live_counts(caches))
    per_token = np.asarray([c.token_bytes for c in caches])
    batch = counts.shape[1]
    return {"live": int((counts.sum(axis=1) * per_token).sum()),
            "allocated": int(sum(c.capacity * batch * c.token_bytes for c in caches))}


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, params, tokens, caches):
    """(float32 logits, caches) of one chunk of T ≥ 1 tokens appended to the caches."""
    out = model.apply({"params": params}, tokens, cache=caches)
    return out.logits.astype(jnp.float32), out.cache


def _check_tokens(tokens, name: str) -> jax.Array:
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] < 1 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"{name} must be an int array [B, T] with T ≥ 1, got {tokens.dtype}{tokens.shape}")
    return tokens.astype(jnp.int32)


def prefill(model, params, tokens, *, seq_start=None, capacity: int | None = None,
            packed: bool = False) -> tuple[jax.Array, tuple]:
    """Run the prompt through the model and fill fresh caches (jitted).

    Args:
      model, params: a ``LanguageModel`` or ``GPT2`` and its params.
      tokens: [B, T] int prompt, left-padded.
      seq_start: optional [B] int pads per row (each row needs ≥ 1 real token).
      capacity: cache capacity C ≥ T (default T).
      packed: DCP packed caches (GPT-2 with DCP).

    Returns:
      (logits [B, T, V] float32, caches). Logits at pad positions are meaningless.

    Raises:
      ValueError: bad tokens / seq_start, capacity < T, see ``init_cache``.
    """
    tokens = _check_tokens(tokens, "tokens")
    b, t = tokens.shape
    seq_start = check_seq_start(seq_start, b, t)
    capacity = t if capacity is None else capacity
    if not isinstance(capacity, int) or capacity < t:
        raise ValueError(f"capacity must be an int ≥ the prompt length {t}, got {capacity!r}")
    caches = init_cache(model, b, capacity, seq_start=seq_start, packed=packed)
    return _forward(model, params, tokens, caches)


def _check_positions(model, caches, n_tokens: int) -> None:
    """Learned positions (GPT-2's) end at ``cfg.max_positions`` − 1."""
    limit = _config(model).max_positions
    if limit is not None:
        last = int(caches[0].length) + n_tokens - 1 - int(jnp.min(caches[0].seq_start))
        if last >= limit:
            raise ValueError(f"the model has {limit} positions; decoding would reach position {last}")


def extend(model, params, caches, tokens) -> tuple[jax.Array, tuple]:
    """Append a chunk of T ≥ 1 tokens per row to live caches (jitted; compiled once per T and cache shape).

    Chunked prefill and multi-turn continuation: the chunk attends over everything cached and itself,
    so prefilling a sequence in any split gives the logits of one forward pass over it. Checks on the
    host that the caches have room (one device sync).

    Args:
      model, params: the model and params the caches were filled with.
      caches: the per-layer caches from ``prefill``, ``init_cache`` or a previous call.
      tokens: [B, T] int, the next tokens of each row (left pads only while a row has not reached
        its ``seq_start``).

    Returns:
      (logits [B, T, V] float32, updated caches).

    Raises:
      ValueError: tokens not [B, T] int; a dense cache without T free columns, a packed cache
        whose live count + T exceeds its capacity (resize it first); GPT-2 positions exhausted.
    """
    tokens = _check_tokens(tokens, "tokens")
    b, t = tokens.shape
    if b != caches[0].seq_start.shape[0]:
        raise ValueError(f"tokens must be [B, T] with B = {caches[0].seq_start.shape[0]} (the caches' batch), "
                         f"got {tokens.shape}")
    type(caches[0]).check_room(caches, t)
    _check_positions(model, caches, t)
    return _forward(model, params, tokens, caches)


def decode_step(model, params, caches, tokens) -> tuple[jax.Array, tuple]:
    """Feed one token per row (jitted; compiled once per cache shape, not per step).

    ``extend`` with T = 1. Checks on the host that the caches have room (one device sync); inside
    ``jit``/loops call the model directly (``model.apply(..., tokens[:, None], cache=caches)``) after
    sizing the caches.

    Args:
      model, params: the model and params the caches were filled with.
      caches: the per-layer caches from ``prefill`` or a previous step.
      tokens: [B] int, the next token of each row.

    Returns:
      (logits [B, V] float32, updated caches).

    Raises:
      ValueError: tokens not [B]; the cache is full (dense) or a row has no free slot (packed);
        GPT-2 positions exhausted.
    """
    tokens = jnp.asarray(tokens)
    b = caches[0].seq_start.shape[0]
    if tokens.shape != (b,) or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an int array [B] = ({b},), got {tokens.dtype}{tokens.shape}")
    logits, caches = extend(model, params, caches, tokens[:, None])
    return logits[:, 0], caches


def sample_logits(logits: jax.Array, rng: jax.Array, *, temperature: float = 0.0,
                  top_k: int | None = None) -> jax.Array:
    """Next tokens from logits: greedy (argmax) when temperature == 0, else a categorical sample of
    softmax(logits / temperature), restricted to the top_k largest logits when top_k is set.

    Args:
      logits: [B, V] float.
      rng: PRNG key (unused when greedy).
      temperature: ≥ 0 (static).
      top_k: None or an int in [1, V] (static).

    Returns:
      [B] int32.
    """
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 6, 7, 8))
def _decode_loop(model, params, caches, token, rng, step0, buffer, temperature, top_k, n_steps):
    """Up to ``buffer`` decode steps on device (``n_steps`` ≤ buffer, traced): feed ``token``, sample
    the next one with key fold_in(rng, step0 + i). Returns tokens [B, buffer], live counts
    [buffer, L, B] (entries ≥ n_steps are 0), the caches and the last sampled token."""
    b = token.shape[0]

    def body(i, carry):
        caches, tok, toks, lives = carry
        out = model.apply({"params": params}, tok[:, None], cache=caches)
        caches = out.cache
        nxt = sample_logits(out.logits[:, -1], jax.random.fold_in(rng, step0 + i), temperature=temperature,
                            top_k=top_k)
        return caches, nxt, toks.at[:, i].set(nxt), lives.at[i].set(live_counts(caches))

    init = (caches, token, jnp.zeros((b, buffer), jnp.int32),
            jnp.zeros((buffer, len(caches), b), jnp.int32))
    caches, token, toks, lives = lax.fori_loop(0, n_steps, body, init)
    return toks, lives, caches, token


def _bucket(n: int) -> int:
    """The smallest 64·2^k ≥ n."""
    c = MIN_BUCKET
    while c < n:
        c *= 2
    return c


def generate(model, params, prompt_tokens, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, rng: jax.Array | None = None, cache_capacity: int | None = None,
             seq_start=None, packed: bool | None = None, chunk_size: int = 64) -> Generation:
    """Autoregressive generation with a KV cache; the decode loop runs on device (``lax.fori_loop``).

    Token i is sampled with key ``fold_in(rng, i)``, so the result does not depend on chunking.

    Args:
      model, params: a ``LanguageModel`` (FoX / Transformer, LLaMA or Pro) or a ``GPT2`` and params.
      prompt_tokens: [B, T] int, left-padded.
      max_new_tokens: N ≥ 1 tokens to sample per row.
      temperature: 0 for greedy decoding, else the softmax temperature.
      top_k: restrict sampling to the k most likely tokens (None: all).
      rng: PRNG key, required when temperature > 0.
      cache_capacity: dense: the columns allocated (default and minimum T + N − 1); packed: the most
        slots a layer may use (default T + N − 1, which never limits).
      seq_start: optional [B] int left pads per row.
      packed: use DCP packed caches; default ``cfg.dcp`` (False on a DCP GPT-2 gives the unpruned dense
        baseline with the same weights).
      chunk_size: decode steps per device loop between host-side resizes of a packed cache.

    Returns:
      ``Generation(tokens [B, N] int32, live_counts [N, n_layers, B] int32, caches)``.

    Raises:
      ValueError: bad arguments, a dense capacity below T + N − 1, a packed cache whose live tokens
        reach ``cache_capacity``, positions beyond the model's ``max_positions`` (GPT-2's n_positions).
      TypeError: not a fox_jax model.
      NotImplementedError: a model that cannot decode (a DCP ``LanguageModel``).
    """
    tokens = _check_tokens(prompt_tokens, "prompt_tokens")
    b, t = tokens.shape
    cfg = _config(model)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    temperature = float(temperature)
    if temperature < 0:
        raise ValueError(f"temperature must be ≥ 0, got {temperature}")
    if temperature > 0 and rng is None:
        raise ValueError("rng is required when temperature > 0")
    vocab = cfg.vocab_size
    if top_k is not None and (not isinstance(top_k, int) or not 1 <= top_k <= vocab):
        raise ValueError(f"top_k must be None or an int in [1, {vocab}], got {top_k!r}")
    rng = jax.random.PRNGKey(0) if rng is None else rng
    seq_start = check_seq_start(seq_start, b, t)
    packed = cfg.dcp if packed is None else packed
    needed = t + max_new_tokens - 1  # tokens ever fed: the prompt and all but the last sample
    capacity = needed if cache_capacity is None else cache_capacity
    if not isinstance(capacity, int) or capacity < (t if packed else needed):
        raise ValueError(f"cache_capacity must be an int ≥ {t if packed else needed} "
                         f"(prompt {t} + max_new_tokens {max_new_tokens} − 1 for a dense cache), got {cache_capacity!r}")
    limit = cfg.max_positions
    if limit is not None and needed - int(jnp.min(seq_start)) > limit:
        raise ValueError(f"the model has {limit} positions; prompt {t} (min pads {int(jnp.min(seq_start))}) "
                         f"+ {max_new_tokens} new tokens exceed them")

    logits, caches = prefill(model, params, tokens, seq_start=seq_start,
                             capacity=t if packed else capacity, packed=packed)
    token = sample_logits(logits[:, -1], jax.random.fold_in(rng, 0), temperature=temperature, top_k=top_k)
    out_tokens, out_lives = [token[:, None]], [live_counts(caches)[None]]
    step, remaining = 1, max_new_tokens - 1
    while remaining:
        if packed:
            caches, n = _fit_packed(caches, min(remaining, chunk_size), capacity)
            buffer = chunk_size
        else:
            n = buffer = remaining
        toks, lives, caches, token = _decode_loop(model, params, caches, token, rng, step, buffer,
                                                  temperature, top_k, n)
        out_tokens.append(toks[:, :n])
        out_lives.append(lives[:n])
        step, remaining = step + n, remaining - n
    return Generation(jnp.concatenate(out_tokens, axis=1), jnp.concatenate(out_lives, axis=0), caches)


def _fit_packed(caches: tuple, n_steps: int, limit: int) -> tuple[tuple, int]:
    """Resize packed caches to the bucket of (max live + steps), capped at ``limit``; returns the
    caches and how many steps fit (≤ n_steps). One host sync."""
    live = int(jnp.max(live_counts(caches)))
    n = min(n_steps, limit - live)
    if n < 1:
        raise ValueError(f"the packed KV cache is full: {live} live tokens reach cache_capacity={limit}")
    capacity = min(_bucket(live + n), limit)
    if capacity != caches[0].capacity:
        caches = tuple(resize_packed_cache(c, capacity) for c in caches)
    return caches, n
