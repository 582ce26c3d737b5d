"""Continuous batching under a fixed KV budget: many prompts through a pool of B rows that stays full.

``serve(model, params, prompts, max_new_tokens=N, policy=..., kv_budget=bytes)`` generates every prompt of a
list that is longer than one batch: B rows decode together, and whenever a row finishes (a stop token or N
tokens) the next waiting prompt is prefilled and takes its place, so the memory a pruning policy frees becomes
batch (JetStream's prefill → insert → generate, on the column-indexed caches of ``fox_jax.cache.slots``):

* **plan** (``plan_serving``, on the host, before anything runs): the pool per row and layer is what the
  policy can need — dense: the longest request's prompt + N − 1 tokens; window / sinks: W / S + W; acp / dcp:
  ``slots=`` or, with ``calibrate=k``, the peak live counts of generating the first k requests with a full pool
  (left-padded to the serving width, with serving's N; ``calibrate_slots``, × 1.1: a calibration, not a bound),
  else the longest context (never overflows; memory as dense). The batch is
  floor(``kv_budget`` / one row's allocated KV bytes) (the caches' own accounting, ``cache_bytes``), at most
  the number of requests. A request that cannot be served is refused before any request is decoded with one
  line naming it (``RequestRefused``): its own pool (sized for it alone) does not fit the budget, a
  fixed-budget pool (``slots=``) is too small for it, or its prompt + N − 1 tokens exceed the model's
  positions. A given or calibrated pool (the same for every request) larger than the budget is a
  ``ValueError`` naming the budget.
* **insert** (jitted, compiled once per padded prompt length): the request is prefilled alone in a fresh
  one-row cache by the prefill of ``generate`` (left-padded to a multiple of ``prefill_chunk``: one compile per
  bucket), its first token sampled, and the row copied into the batch with ``SlotKVCache.insert_row`` (its
  columns moved so that its last prompt token sits in the batch's last column; the rows share one column
  counter, which starts at the longest padded prompt of the whole list, so every shift is ≥ 0).
* **decode block** (jitted once: a fixed trip count of K = min(``steps_per_check``, N − 1) steps): each row
  samples its own request's next token; a finished row keeps stepping on garbage (its outputs are masked) until
  the host refills it, so a row wastes fewer than K steps per request. One device → host transfer per block:
  which rows finished, and their tokens.
* **host loop**: admit the first B requests; then decode blocks, and after each one record every finished
  row's request and insert the next waiting request into that row. A tqdm bar over requests on stderr
  (``progress=True``).

Sampling is keyed by request: token i of request q uses ``fold_in(fold_in(rng, q), i)``, so a request's tokens
do not depend on its row, its batch or when it was admitted. **Each request's output equals generating it
alone**: ``generate(model, params, prompt[None], max_new_tokens=N, policy=..., slots=plan.slots,
rng=fold_in(rng, q), max_context=plan.max_context, stop_tokens=...)`` gives the same tokens (the same keys
when sampling). The logits are equal up to float rounding, not bit for bit: the prompt is prefilled with
other left pads and a ring holds the row's keys in other slots, so sums run in another order (~1e-6 of
float32 logits; only a near-tie within that could pick another token). ``max_context`` is acp's N (δ = −(2U + log N) + log ε): every request uses the longest context of the
list, a larger N than its own, which only makes the threshold more conservative (the ε bound holds). Other
policies ignore it. Overflow (acp / dcp beyond a calibrated pool) is counted per request: that request's
tokens are then not exactly the policy's.

Every request id is admitted once and completed once (checked: ``RuntimeError`` otherwise).
"""

from __future__ import annotations

import collections
import functools
import sys
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from tqdm.auto import tqdm

from fox_jax.cache.policies import CachePolicy, parse_policy, round_up
from fox_jax.decoding.generation import (_check_decoding, _config, _scan_chunks, cache_bytes, calibrate_slots,
                                         cast_plan, decode_variables, generate, init_cache, live_counts, min_slots,
                                         sample_logits)

GiB = 2 ** 30


class RequestRefused(ValueError):
    """A request that cannot be served (``plan_serving``): the message is one line naming it; ``index`` is
    its position in the request list."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


class ServingPlan(NamedTuple):
    """What ``serve`` will allocate and run, decided on the host before anything runs.

    Attributes:
      slots: the pool per row and layer (``init_cache``'s ``slots``: an int, or per layer, per head for acp).
      batch: B, the rows decoding together. row_bytes: allocated KV bytes of one row (every layer).
      max_context: acp's N for every request (the longest prompt + N − 1 of the list).
      width: the column counter at the first admission (the longest padded prompt).
      prefill_chunk: the bucket: prompts are left-padded to a multiple of it.
      slots_rule: how the pool was chosen (for reports). kv_budget: the budget in bytes, or None.
    """

    slots: int | tuple
    batch: int
    row_bytes: int
    max_context: int
    width: int
    prefill_chunk: int
    slots_rule: str
    kv_budget: float | None = None

    def padded(self, policy: CachePolicy, prompt_len: int, max_positions: int | None) -> tuple[int, int]:
        """(P_pad, chunk) of a prompt of ``prompt_len`` tokens: left-padded to a multiple of the bucket, one
        chunk for a policy whose fresh cache prefills with the flash op (dense, window; at most the model's
        positions: a chunk is a sequence for GPT-2), else chunks of ``prefill_chunk`` (≤ the positions)."""
        return _padded(policy, prompt_len, self.prefill_chunk, max_positions)


def _padded(policy: CachePolicy, p: int, bucket: int, limit: int | None) -> tuple[int, int]:
    if policy.flash_prefill() is not None:
        width = round_up(p, bucket)
        if limit is not None and width > limit:
            width = max(p, limit)
        return width, width
    chunk = bucket if limit is None else min(bucket, limit)
    return round_up(p, chunk), chunk


class Completion(NamedTuple):
    """One request's result.

    Attributes:
      index: the request's position in the list. tokens: [n] int32 generated tokens (a stop token included).
      overflow: entries the pool had no slot for while generating it (max over layers; 0: exactly the policy's).
      live_tokens_mean, live_tokens_peak: live tokens per layer (mean over layers and key/value heads) of the
        caches that produced its tokens, mean and peak over its tokens.
    """

    index: int
    tokens: np.ndarray
    overflow: int
    live_tokens_mean: float
    live_tokens_peak: float


class Served(NamedTuple):
    """Output of ``serve``: ``completions`` in request order, and a JSON-able ``summary`` (keys in ``serve``)."""

    completions: list
    summary: dict


def _check_prompts(prompts) -> list[np.ndarray]:
    out = []
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        if a.ndim != 1 or a.shape[0] < 1 or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"prompts[{i}] must be a non-empty 1-D int sequence, got {a.dtype}{a.shape}")
        out.append(a.astype(np.int32))
    if not out:
        raise ValueError("prompts must hold at least one prompt")
    return out


def _row_caches(model, slots, policy, max_context):
    """The one-row caches' shapes (nothing allocated; ``allocated_bytes`` reads only shapes)."""
    return jax.eval_shape(lambda: init_cache(model, 1, slots, policy=policy, max_context=max_context))


def _calibrated_slots(model, params, prompts, k, max_new_tokens, policy, stop_tokens, prefill_chunk, full,
                      max_context, limit):
    """acp / dcp pool from generating the first k requests (one batch, left-padded to serving's prefill width)
    with a full pool and serving's ``max_context`` (acp's N, so the same thresholds as serving):
    ``calibrate_slots`` of the caches, each count capped at ``full``."""
    first = prompts[:k]
    width = max(_padded(policy, len(p), prefill_chunk, limit)[0] for p in first)
    tokens = np.zeros((len(first), width), np.int32)
    for i, p in enumerate(first):
        tokens[i, width - len(p):] = p
    out = generate(model, params, tokens, max_new_tokens=max_new_tokens, policy=policy, slots=full,
                   seq_start=np.asarray([width - len(p) for p in first], np.int32), stop_tokens=stop_tokens,
                   prefill_chunk=prefill_chunk, max_context=max_context)
    cap = lambda x: tuple(cap(y) for y in x) if isinstance(x, tuple) else min(int(x), full)  # noqa: E731
    return cap(calibrate_slots(out.caches))


def plan_serving(model, params, prompts: Sequence, *, max_new_tokens: int, policy="dense",
                 kv_budget: float | None = None, batch_size: int | None = None, slots=None, calibrate: int = 0,
                 prefill_chunk: int = 512, stop_tokens=(), names: Sequence[str] | None = None,
                 budget_name: str = "kv_budget") -> ServingPlan:
    """The pool per row, the batch and the refusals of ``serve`` (module docstring), on the host.

    Args:
      prompts: a sequence of 1-D int token sequences (lengths may differ).
      max_new_tokens: N. policy: the cache policy.
      kv_budget: bytes of allocated KV for the whole batch (every row and layer), or None.
      batch_size: with no ``kv_budget``, the rows (default: every request at once); with one, a cap.
      slots: the pool per row and layer (as ``generate``), or None: the policy's need (module docstring).
      calibrate: for acp / dcp without ``slots``: k > 0 sizes the pool from generating the first k requests.
      prefill_chunk: the padding bucket and prefill chunk (as ``generate``).
      stop_tokens: as ``generate`` (used by the calibration).
      names: how errors name each request (default "request i"); budget_name: how they name the budget.

    Returns:
      ``ServingPlan``.

    Raises:
      RequestRefused: a request that cannot be served (one line naming it, see the module docstring).
      ValueError: bad arguments.
    """
    prompts = _check_prompts(prompts)
    cfg = _config(model)
    policy = parse_policy(policy)
    _check_decoding(cfg, max_new_tokens, prefill_chunk, 0.0, None, None, stop_tokens, None)
    names = [f"request {i}" for i in range(len(prompts))] if names is None else list(names)
    if len(names) != len(prompts):
        raise ValueError(f"names must name every prompt ({len(prompts)}), got {len(names)}")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be None or a positive int, got {batch_size!r}")
    if kv_budget is not None and not kv_budget > 0:
        raise ValueError(f"kv_budget must be a positive number of bytes, got {kv_budget!r}")
    if not isinstance(calibrate, int) or calibrate < 0:
        raise ValueError(f"calibrate must be an int ≥ 0, got {calibrate!r}")
    lengths = [len(p) for p in prompts]
    contexts = [p + max_new_tokens - 1 for p in lengths]          # tokens fed: the prompt and N − 1 samples
    what = lambda i: f"{names[i]}: {lengths[i]} + {max_new_tokens} tokens"  # noqa: E731
    limit = cfg.max_positions
    for i, c in enumerate(contexts):
        if limit is not None and c > limit:
            raise RequestRefused(i, f"{what(i)} need {c} positions; the model has {limit}")
    max_context = max(contexts)
    full = min_slots(policy, max_context)
    sized_by_longest = slots is None and (policy.fixed_budget or not calibrate)  # else one pool for every request
    if slots is not None:
        rule = "given"
    elif policy.fixed_budget:
        slots, rule = full, "the policy's need for the longest request (min_slots)"
    elif calibrate:
        k = min(calibrate, len(prompts))
        slots = _calibrated_slots(model, params, prompts, k, max_new_tokens, policy, tuple(stop_tokens),
                                  prefill_chunk, full, max_context, limit)
        rule = f"calibrated: peak live counts of the first {k} requests × 1.1 (calibrate_slots)"
    else:
        slots, rule = full, "the longest request's context (min_slots: never overflows)"
    row = _row_caches(model, slots, policy, max_context)
    row_bytes = int(sum(c.allocated_bytes() for c in row))
    capacity = min(g.slots for c in row for g in c.groups)
    budget = None if kv_budget is None else float(kv_budget)
    for i, c in enumerate(contexts):
        need = policy.max_live(c)
        if policy.fixed_budget and need > capacity:
            raise RequestRefused(i, f"{what(i)} need {need} KV slots per row and layer under {policy.spec}; the pool "
                                    f"holds {capacity}")
        if budget is not None and sized_by_longest:  # its own pool: one group, bytes ∝ capacity
            own = row_bytes * policy.capacity(need) // capacity
            if own > budget:
                raise RequestRefused(i, f"{what(i)} need {own / GiB:.3g} GiB of KV per row under {policy.spec}; "
                                        f"{budget_name} {budget / GiB:.3g} GiB holds none")
    if budget is not None and row_bytes > budget:  # a given or calibrated pool: the same for every request
        raise ValueError(f"{budget_name} {budget / GiB:.3g} GiB holds no row: one row's pool ({rule}) takes "
                         f"{row_bytes / GiB:.3g} GiB of KV under {policy.spec}")
    n = len(prompts)
    batch = n if batch_size is None else min(batch_size, n)
    if budget is not None:
        batch = min(batch, int(budget // row_bytes))
    width = max(_padded(policy, p, prefill_chunk, limit)[0] for p in lengths)
    return ServingPlan(slots, batch, row_bytes, max_context, width, prefill_chunk, rule, budget)


class _State(NamedTuple):
    """The device state of the batch: caches and, per row, the last token, tokens generated so far, whether it
    finished, its tokens [B, N], overflow and live-count statistics; ``live_bytes`` / ``tokens``: sums over the
    current block's active rows and steps."""

    caches: tuple
    tok: jax.Array
    count: jax.Array
    done: jax.Array
    out: jax.Array
    overflow: jax.Array
    live_sum: jax.Array
    live_peak: jax.Array
    live_bytes: jax.Array
    tokens: jax.Array


def _overflow(caches) -> jax.Array:
    return jnp.max(jnp.stack([c.overflow for c in caches]), axis=0)


def _sample_rows(logits, rng, req, index, sampling) -> jax.Array:
    """[B] next tokens, row b with key fold_in(fold_in(rng, req[b]), index[b]) (greedy: argmax)."""
    temperature, top_k, top_p = sampling
    if temperature == 0.0:
        return sample_logits(logits, rng)
    keys = jax.vmap(lambda q, i: jax.random.fold_in(jax.random.fold_in(rng, q), i))(req, index)
    one = lambda lg, key: sample_logits(lg[None], key, temperature=temperature, top_k=top_k, top_p=top_p)[0]  # noqa: E731
    return jax.vmap(one)(logits, keys)


@functools.partial(jax.jit, static_argnames=("model", "slots", "policy", "max_context", "chunk", "n_new", "sampling",
                                             "stops"), donate_argnames=("state",))
def _admit(model, params, state: _State, tokens, pad, row, req, rng, *, slots, policy, max_context, chunk, n_new,
           sampling, stops) -> _State:
    """Prefill request ``req`` ([1, P_pad] tokens, ``pad`` [1] left pads) alone, sample its first token and put it
    in row ``row`` of the batch."""
    one = init_cache(model, 1, slots, policy=policy, seq_start=pad, max_context=max_context)
    one, logits, _ = _scan_chunks(model, params, tokens, one, chunk)
    first = _sample_rows(logits, rng, req[None], jnp.zeros((1,), jnp.int32), sampling)[0]
    caches = tuple(c.insert_row(row, o) for c, o in zip(state.caches, one))
    live = jnp.mean(live_counts(one)[:, 0])
    done = jnp.isin(first, jnp.asarray(stops or (-1,), jnp.int32)) | (n_new == 1)
    out = jnp.full((n_new,), -1, jnp.int32).at[0].set(first)
    return state._replace(caches=caches, tok=state.tok.at[row].set(first), count=state.count.at[row].set(1),
                          done=state.done.at[row].set(done), out=state.out.at[row].set(out),
                          overflow=state.overflow.at[row].set(_overflow(one)[0]),
                          live_sum=state.live_sum.at[row].set(live), live_peak=state.live_peak.at[row].set(live))


@functools.partial(jax.jit, static_argnames=("model", "steps", "n_new", "sampling", "stops"),
                   donate_argnames=("state",))
def _decode_block(model, variables, state: _State, req, rng, *, steps, n_new, sampling, stops) -> _State:
    """``steps`` decode steps of every row (a fixed trip count); finished rows step on, masked. ``variables``:
    ``generation.decode_variables``."""
    stop_ids = jnp.asarray(stops or (-1,), jnp.int32)
    rows = jnp.arange(state.tok.shape[0])

    def body(j, st: _State) -> _State:
        # one column counter for every layer (the block's first plus j), as in generation._generate: one add per step
        length = st.caches[0].length + j
        out = model.apply(variables, st.tok[:, None], cache=tuple(c.replace(length=length) for c in st.caches))
        nxt = _sample_rows(out.logits[:, -1].astype(jnp.float32), rng, req, st.count, sampling)
        active = ~st.done
        count = st.count + active
        live = jnp.mean(live_counts(out.cache), axis=0)                                          # [B]
        held = sum(c.live_bytes() for c in out.cache)                                           # [B]
        return _State(tuple(c.replace(length=old.length) for c, old in zip(out.cache, st.caches)),
                      jnp.where(active, nxt, st.tok), count,
                      st.done | (active & (jnp.isin(nxt, stop_ids) | (count >= n_new))),
                      st.out.at[rows, jnp.where(active, st.count, n_new)].set(nxt, mode="drop"),
                      jnp.where(active, _overflow(out.cache), st.overflow),
                      st.live_sum + jnp.where(active, live, 0.0),
                      jnp.where(active, jnp.maximum(st.live_peak, live), st.live_peak),
                      st.live_bytes + jnp.sum(jnp.where(active, held, 0.0)),
                      st.tokens + jnp.sum(active, dtype=jnp.int32))

    state = state._replace(live_bytes=jnp.zeros((), jnp.float32), tokens=jnp.zeros((), jnp.int32))
    state = lax.fori_loop(0, steps, body, state)
    return state._replace(caches=tuple(c.replace(length=c.length + steps) for c in state.caches))


def serve(model, params, prompts: Sequence, *, max_new_tokens: int, policy="dense", kv_budget: float | None = None,
          batch_size: int | None = None, slots=None, calibrate: int = 0, temperature: float = 0.0,
          top_k: int | None = None, top_p: float | None = None, stop_tokens=(), rng: jax.Array | None = None,
          prefill_chunk: int = 512, steps_per_check: int = 8, names: Sequence[str] | None = None,
          progress: bool = False, plan: ServingPlan | None = None) -> Served:
    """Generate every prompt of a list with continuous batching under a KV budget (module docstring).

    Args:
      model, params: a fox_jax model (any family) and its params.
      prompts: a sequence of 1-D int token sequences, any lengths (no padding: each is one request).
      max_new_tokens: N ≥ 1 tokens per request (fewer at a stop token).
      policy, slots, calibrate, kv_budget (bytes), batch_size, prefill_chunk, names: as ``plan_serving`` (or
        give its ``plan``).
      temperature, top_k, top_p, stop_tokens, rng: as ``generate``; token i of request q is sampled with key
        ``fold_in(fold_in(rng, q), i)``.
      steps_per_check: K, the decode steps between two host checks for finished rows (at most N − 1): larger K
        syncs less often, smaller K refills a finished row sooner.
      progress: a tqdm bar over requests on stderr.

    Returns:
      ``Served(completions, summary)``: one ``Completion`` per request in request order; ``summary``: requests,
      batch, policy, provable, slots (capacity: entries per row and head, the largest group), slots_rule,
      max_context, steps_per_check, seconds (wall, compilation included), prefill_seconds (admissions, synced),
      decode_seconds (decode blocks), decode_steps, ms_per_step (decode_seconds / decode_steps),
      generated_tokens, requests_per_s, tokens_per_s (generated / wall), decode_tokens_per_s (tokens of the
      decode blocks / their time), kv_bytes_allocated (the batch's pool), kv_bytes_row, kv_bytes_live_mean
      (live bytes of the active rows, mean over decode steps), kv_budget_bytes, overflow (per request),
      prefill_widths (the padded prompt lengths: one compile each). Times in seconds, bytes as ints / floats.
      Wall times include compilation: call ``serve`` twice (the second reuses the compiled programs while the
      model, shapes and plan are the same) for a steady-state rate.

    Raises:
      RequestRefused: a request that cannot be served (before anything runs). ValueError: bad arguments.
    """
    prompts = _check_prompts(prompts)
    cfg = _config(model)
    policy = parse_policy(policy)
    sampling, stops, rng = _check_decoding(cfg, max_new_tokens, prefill_chunk, temperature, top_k, top_p,
                                           stop_tokens, rng)
    if not isinstance(steps_per_check, int) or steps_per_check < 1:
        raise ValueError(f"steps_per_check must be a positive int, got {steps_per_check!r}")
    start = time.perf_counter()
    if plan is None:
        plan = plan_serving(model, params, prompts, max_new_tokens=max_new_tokens, policy=policy, kv_budget=kv_budget,
                            batch_size=batch_size, slots=slots, calibrate=calibrate, prefill_chunk=prefill_chunk,
                            stop_tokens=stops, names=names)
    n, b, n_new = len(prompts), plan.batch, max_new_tokens
    slots = plan.slots if isinstance(plan.slots, int) else tuple(
        tuple(s) if isinstance(s, (list, tuple)) else s for s in plan.slots)   # hashable: a static argument
    caches = init_cache(model, b, slots, policy=policy, max_context=plan.max_context)
    caches = tuple(c.replace(length=jnp.asarray(plan.width, jnp.int32), fresh=False) for c in caches)
    variables = decode_variables(params, cast_plan(model, params, caches))  # per-step converts and layouts, once
    params = variables["params"]
    f32 = lambda: jnp.zeros((b,), jnp.float32)  # noqa: E731
    state = _State(caches, jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool),
                   jnp.full((b, n_new), -1, jnp.int32), jnp.zeros((b,), jnp.int32), f32(), f32(),
                   jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
    kv_allocated, capacity = cache_bytes(caches)["allocated"], max(c.capacity for c in caches)
    provable = all(c.provable for c in caches)  # read now: the caches are donated to the first admission
    limit = cfg.max_positions
    admit_kw = dict(slots=slots, policy=policy, max_context=plan.max_context, n_new=n_new, sampling=sampling,
                    stops=stops)
    block_kw = dict(n_new=n_new, sampling=sampling, stops=stops)
    buckets = set()
    req = np.full((b,), -1, np.int32)          # the request each row serves (−1: none); host side
    admitted, completions = np.zeros((n,), np.int64), [None] * n
    pending = collections.deque(range(n))
    timing = dict(prefill=0.0, decode=0.0, steps=0, tokens=0, live_bytes=0.0)

    def admit(row: int) -> None:
        nonlocal state
        q = pending.popleft()
        p = prompts[q]
        width, chunk = plan.padded(policy, len(p), limit)
        tokens = np.zeros((1, width), np.int32)
        tokens[0, width - len(p):] = p
        buckets.add(width)
        state = _admit(model, params, state, jnp.asarray(tokens), jnp.asarray([width - len(p)], jnp.int32),
                       jnp.int32(row), jnp.int32(q), rng, chunk=chunk, **admit_kw)
        req[row] = q
        admitted[q] += 1

    bar = tqdm(total=n, desc=f"serve {policy.spec} B={b}", unit="req", file=sys.stderr, disable=not progress)
    t0 = time.perf_counter()
    for row in range(b):
        admit(row)
    jax.block_until_ready(state.tok)
    timing["prefill"] += time.perf_counter() - t0
    steps = max(1, min(steps_per_check, n_new - 1))  # one block length: one compile
    while (req >= 0).any():
        t0 = time.perf_counter()
        state = _decode_block(model, variables, state, jnp.asarray(req), rng, steps=steps, **block_kw)
        done, cnt, out, ovf, live_sum, live_peak, live_bytes, made = jax.device_get(
            (state.done, state.count, state.out, state.overflow, state.live_sum, state.live_peak, state.live_bytes,
             state.tokens))
        timing["decode"] += time.perf_counter() - t0
        timing["steps"] += steps
        timing["tokens"] += int(made)
        timing["live_bytes"] += float(live_bytes)
        t0, refilled = time.perf_counter(), False
        for row in np.flatnonzero(done & (req >= 0)):
            q = int(req[row])
            assert completions[q] is None, f"request {q} completed twice"
            completions[q] = Completion(q, out[row, :cnt[row]].copy(), int(ovf[row]),
                                        float(live_sum[row] / cnt[row]), float(live_peak[row]))
            req[row] = -1
            bar.update(1)
            if pending:
                admit(row)
                refilled = True
        if refilled:
            jax.block_until_ready(state.tok)
            timing["prefill"] += time.perf_counter() - t0
    bar.close()
    seconds = time.perf_counter() - start
    if pending or any(c is None for c in completions) or not (admitted == 1).all():
        raise RuntimeError(f"serve lost track of requests: admitted {admitted.tolist()}, pending {list(pending)}")
    generated = sum(len(c.tokens) for c in completions)
    summary = dict(
        requests=n, batch=b, policy=policy.spec, provable=provable, slots=capacity,
        slots_rule=plan.slots_rule, max_context=plan.max_context, steps_per_check=steps_per_check,
        seconds=seconds, prefill_seconds=timing["prefill"], decode_seconds=timing["decode"],
        decode_steps=timing["steps"], ms_per_step=1e3 * timing["decode"] / max(timing["steps"], 1),
        generated_tokens=generated, requests_per_s=n / seconds,
        tokens_per_s=generated / seconds,
        decode_tokens_per_s=timing["tokens"] / timing["decode"] if timing["decode"] > 0 else None,
        kv_bytes_allocated=kv_allocated, kv_bytes_row=plan.row_bytes,
        kv_bytes_live_mean=timing["live_bytes"] / timing["steps"] if timing["steps"] else 0.0,
        kv_budget_bytes=plan.kv_budget,
        overflow=[c.overflow for c in completions],
        prefill_widths=sorted(buckets))
    return Served(completions, summary)


__all__ = ["Completion", "RequestRefused", "Served", "ServingPlan", "plan_serving", "serve"]
