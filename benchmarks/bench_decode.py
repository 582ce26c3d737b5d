"""Decoding speed and KV memory of every cache policy, at equal batch and under a fixed KV budget.

One model — a run directory (``--run``, read with ``fox_jax.train.runs.open_run``: ``fox-jax train``,
``finetune-dcp``, Hugging Face GPT-2 / official FoX) or a random init (``--model gpt2`` GPT-2 124M,
``--model fox-pro:125M``, any ``ARCH:SIZE`` of ``fox_jax.config.preset``, ``--set key=value`` to reshape it)
— is decoded greedily with ``fox_jax.decoding.generate(model, params, prompts, max_new_tokens=N,
policy=POLICY, slots=S)`` for each policy of ``--policies`` (``dense,dcp,acp,window:256,sinks:4+252``; see
``fox_jax.cache.policies.POLICY_FORMS``) and each prompt length.

Modes (both may be given; neither = ``--equal-batch 8``):
  --equal-batch B   every policy at batch B.
  --kv-budget GiB   per policy the largest batch whose *allocated* KV fits the budget:
                      pool per row = the policy's need: ``min_slots(policy, T + N − 1)`` for a policy with a
                        fixed budget (dense / window / sinks); for the others (dcp / acp, data-dependent) the peak
                        live counts of a calibration generate at
                        batch ``--calib-batch`` with a full pool (``calibrate_slots``: × ``--safety`` 1.1, rounded
                        up to a multiple of ``RING_BLOCK`` = 64 (``--slot-multiple``), at most ``min_slots``): one
                        count for every layer
                        (``--pool uniform``, default), one per layer (``layer``) or, for acp, one per layer and
                        key/value head (``head``);
                      batch = floor(budget / allocated bytes of one row with that pool), at most ``--max-batch``
                        (the bytes come from the caches' own accounting, ``cache_bytes(init_cache(...))``).
                    A run whose pool overflowed (``Generation.overflow`` > 0: the policy wanted more slots)
                    is repeated once with 1.25 × the pool; one that runs out of device memory with half the batch.
  In equal-batch mode the pool is the same need (``--slots full`` gives every policy ``min_slots``).

Measured per (mode, policy, prompt length), median of ``--repeats`` after one warm-up call that compiles:
  tokens/s          B·N / wall time of the whole generate (prefill + decode loop: one jitted program)
  prefill s         wall time of the same program stopped after the first sample (``generate(steps=1)``: no second
                    compile; timed interleaved with the whole generate; ``--prefill all|budget|none``)
  decode tok/s      B·(N−1) / (generate − prefill)
  capacity          entries per row and key/value head the caches allocated (mean over layers and heads: the
                    slots asked for, rounded up to a multiple of ``RING_BLOCK``)
  KV allocated/live ``cache_bytes(Generation.caches)`` at the end (and per row); live mean ≈ live × mean/final
  live tokens       mean over layers and rows of ``Generation.live_counts`` (final, mean over steps, peak)
  overflow          max over rows of ``Generation.overflow``
  provable          ``Generation.provable``: whether the policy's promise holds for the model (acp without
                    QK-norm: False, a heuristic)
Ratios vs the dense row of the same mode and prompt length: tokens/s, decode tok/s, batch, KV saving (total
and per row).

Rows in the issue's format (``--rows-out FILE``, a JSON list; rows of earlier calls with other keys are kept, so
several models of one run land in one file): model, mode, policy, provable, batch, prompt, new_tokens,
tokens_per_s, decode_tokens_per_s, ms_per_step (decode: (generate − prefill) / (N − 1)); with ``--device-times``
device_ms_per_step (equal-batch rows: the kernels' time per decode step from two ``jax.profiler`` traces, the
same difference without host gaps or the prefill's wall-time variance), bound_tokens_per_s
(B / the seconds to read, once per step, the weights in the compute dtype (all but an untied input embedding,
which a step only gathers) and the mean live KV bytes, at ``--bandwidth`` TB/s, by default the device's HBM peak, in
bandwidth_tb_s), kv_bytes_allocated,
kv_bytes_live, capacity, overflow, sparsity, plus the device and versions. ``--hf`` adds Hugging Face
``transformers`` GPT-2 rows (static and dynamic cache, ``hf_decode.py``) on the same shape at ``--equal-batch``
(with ``--policies ""`` only those, their bound from the dense row already in the ``--rows-out`` file).

``python benchmarks/bench_decode.py --table FILE`` prints the docs' markdown table of such a file.

Prompts: random tokens, or windows of real text (``--prompt-text FILE|DIR``, tokenized with the run's
tokenizer or ``--tokenizer``): pruning of a trained model depends on the text. Random DCP weights
(``--model gpt2`` with the dcp policy): q_int/k_int ~ N(0, 1/d), β = ``--beta``; speed only.

Usage:
  python benchmarks/bench_decode.py --quick                                    # CPU smoke run
  python benchmarks/bench_decode.py --model gpt2 --policies dense,dcp,window:256 --prompt-lengths 896 \\
      --new-tokens 128 --equal-batch 32 --kv-budget 2 --out decode_gpt2.json
  python benchmarks/bench_decode.py --run runs/fox-pro --policies dense,acp,window:256,sinks:4+252 \\
      --prompt-lengths 2048 8192 16384 --prompt-text data/long --kv-budget 2 --max-batch 64
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import fox_jax.models  # noqa: F401  (registers the model families with fox_jax.config)
from fox_jax.cache.policies import RING_BLOCK, HeuristicEvictionWarning, parse_policy
from fox_jax.config import ARCHS, SIZES, gpt2_preset, preset
from fox_jax.decoding import cache_bytes, calibrate_slots, generate, init_cache, min_slots
from fox_jax.decoding.generation import STEPS_PER_CHECK

GiB = 2 ** 30
SLOT_MULTIPLE = RING_BLOCK
QUICK_SHAPE = dict(n_layers=2, d_model=128, n_heads=4)


# The model -----------------------------------------------------------------------------------------

def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def model_config(spec: str, overrides: list[str]):
    """``gpt2`` / ``gpt2-medium`` / ... or ``ARCH:SIZE`` (``fox-pro:125M``) plus ``key=value`` overrides."""
    kw = {}
    for o in overrides:
        if "=" not in o:
            raise ValueError(f"--set takes key=value, got {o!r}")
        k, v = o.split("=", 1)
        kw[k] = _value(v)
    if spec.startswith("gpt2"):
        return gpt2_preset(spec, **kw)
    arch, _, size = spec.partition(":")
    if arch not in ARCHS or size not in SIZES:
        raise ValueError(f"--model {spec!r}: expected gpt2[-medium|-large|-xl] or ARCH:SIZE with ARCH in "
                         f"{', '.join(ARCHS)} and SIZE in {', '.join(SIZES)} (e.g. fox-pro:125M)")
    return preset(size, arch, **kw)


def random_dcp(cfg, params, beta: float, rng):
    """DCP interaction weights for a random-init model: q_int/k_int ~ N(0, 1/d), β = ``beta`` per layer."""
    cfg, params = cfg.add_dcp_params(params, jax.random.PRNGKey(1))
    gen = np.random.default_rng(rng)

    def fill(path, x):
        names = [getattr(p, "key", None) for p in path]
        if "q_int" in names or "k_int" in names:
            return jnp.asarray(gen.standard_normal(x.shape) / math.sqrt(cfg.d_model), jnp.float32)
        if names[-1] == "beta":
            return jnp.full(x.shape, beta, jnp.float32)
        return x
    return cfg, jax.tree_util.tree_map_with_path(fill, params)


def load_model(args):
    """(model, params, info): the run's model or a random init, with ``--dtype`` as compute dtype."""
    if args.run:
        from fox_jax.train.runs import open_run

        run = open_run(args.run, step=args.step, flag="--run")
        cfg, params = run.model, run.load_params()
        info = dict(source="run", run=run.path, kind=run.kind, step=run.step, tokenizer=run.tokenizer)
    else:
        cfg = model_config(args.model, args.set)
        params = cfg.init_params(jax.random.PRNGKey(0))
        info = dict(source="random-init", spec=args.model, overrides=args.set, tokenizer=None)
        if any("interaction_dim" in parse_policy(p).needs for p in args.policies) and not cfg.dcp:
            cfg, params = random_dcp(cfg, params, args.beta, 0)
            info.update(random_dcp_beta=args.beta)
    cfg = cfg.replace(dtype=args.dtype)
    return cfg.build(), params, info


# Prompts -------------------------------------------------------------------------------------------

class Prompts:
    """[B, T] int32 prompts: windows of a token stream (real text) or random tokens."""

    def __init__(self, vocab: int, stream: np.ndarray | None = None):
        self.vocab, self.stream = vocab, stream

    @classmethod
    def from_text(cls, path: str, tokenizer_spec: str, vocab: int, max_tokens: int):
        from fox_jax.train.tokenizers import load_tokenizer

        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".txt")) \
            if os.path.isdir(path) else [path]
        tok = load_tokenizer(tokenizer_spec)
        chunks, n = [], 0
        for f in files:  # ~4 characters per token; read only what is needed
            with open(f, encoding="utf-8", errors="replace") as fh:
                text = fh.read(max(4 * (max_tokens - n), 1 << 16) + 1024)
            ids = tok.encode_batch([text])[0]
            chunks.append(ids)
            n += len(ids)
            if n >= max_tokens:
                break
        stream = np.concatenate(chunks).astype(np.int64)
        if stream.max(initial=0) >= vocab:
            raise ValueError(f"--prompt-text: token id {int(stream.max())} ≥ the model's vocabulary {vocab}")
        return cls(vocab, stream)

    def get(self, batch: int, length: int, seed: int = 0) -> jax.Array:
        if self.stream is None or len(self.stream) <= length:
            return jax.random.randint(jax.random.PRNGKey(seed + length), (batch, length), 0, self.vocab, jnp.int32)
        span = len(self.stream) - length
        stride = max(span // max(batch, 1), 1)
        starts = (np.arange(batch) * stride + seed) % span  # disjoint windows while the text lasts
        return jnp.asarray(np.stack([self.stream[s:s + length] for s in starts]), jnp.int32)


# Measurement ---------------------------------------------------------------------------------------

def _ready(out):
    jax.block_until_ready(out.tokens)
    return out


def timed(fn, repeats: int, prefill: bool = True) -> tuple[float | None, float | None, list[float], object]:
    """(median wall seconds of ``fn(None)`` (the whole generate), of ``fn(1)`` (the prefill and first sample: the
    same compiled program, ``generate(steps=1)``), the full times, the last full output) over ``repeats`` calls
    each, interleaved so that drift hits both alike, after one warm-up call that compiles. ``repeats`` 0: only the
    warm-up (fills the persistent compilation cache for a later timed run); ``prefill`` False: no ``fn(1)``."""
    out = _ready(fn(None))
    full, first = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = _ready(fn(None))
        full.append(time.perf_counter() - t0)
        if prefill:
            t0 = time.perf_counter()
            _ready(fn(1))
            first.append(time.perf_counter() - t0)
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return med(full), med(first), full, out


def device_ms_per_step(fn, n: int) -> tuple[float | None, str]:
    """(Kernel milliseconds per decode step, where from) of the program ``fn(steps)`` runs: the kernels' summed time
    in a ``jax.profiler`` trace of the whole generate minus that of ``fn(1)`` (the prefill and first sample), over
    the n − 1 steps between. Unlike the wall times' difference of two medians, host gaps and the prefill's variance
    do not enter (at an 8k prompt the prefill is ~40% of a generate, and the two wall readings of the same H100 step
    differed by 16–25%; benchmarks/NOTES.md, 2026-12-07). (None, the reason) when no trace could be read."""
    from profile_step import TraceError, trace_calls  # a sibling script

    totals, source = {}, ""
    for steps in (1, n):
        try:
            events, _, source = trace_calls(lambda: fn(steps).tokens, 1)
        except TraceError as e:
            return None, f"no trace: {e}"
        totals[steps] = sum(e.dur_us for e in events)
    return (totals[n] - totals[1]) / (n - 1) / 1e3, source


def round_up(n: float, multiple: int = SLOT_MULTIPLE) -> int:
    return max(multiple, int(math.ceil(n / multiple) * multiple))


def _spec_stats(slots) -> tuple[float, list]:
    """(mean slots per layer and key/value head, the spec as JSON) of an int / per-layer / per-head pool."""
    if isinstance(slots, int):
        return float(slots), slots
    per_layer = [float(np.mean(s)) if isinstance(s, (list, tuple)) else float(s) for s in slots]
    return float(np.mean(per_layer)), [list(s) if isinstance(s, (list, tuple)) else s for s in slots]


class Bench:
    """One model's measurements. ``mesh``: the timed generates run sharded on it (``generate(mesh=...)``: rows over
    data × fsdp); the calibration generate runs on one device (its pool is per row, whatever the batch)."""

    def __init__(self, model, params, prompts: Prompts, args, mesh=None):
        self.model, self.params, self.prompts, self.args, self.mesh = model, params, prompts, args, mesh
        self.need: dict[tuple, dict] = {}          # (policy, T) -> {"slots": spec, ...calibration}

    def generate(self, prompts, n: int, policy: str, slots, steps: int | None = None, mesh=None):
        return generate(self.model, self.params, prompts, max_new_tokens=n, policy=policy, slots=slots, steps=steps,
                        steps_per_check=self.args.steps_per_check, mesh=mesh)

    def context(self, t: int) -> int:
        return t + self.args.new_tokens - 1        # tokens fed: the prompt and all but the last sample

    def full_slots(self, policy: str, t: int) -> int:
        return int(min_slots(policy, self.context(t)))

    def row_bytes(self, policy: str, t: int, slots) -> int:
        """Allocated KV bytes of one row with this pool (the caches' own accounting, nothing run)."""
        caches = init_cache(self.model, 1, slots, policy=policy, max_context=self.context(t))
        return cache_bytes(caches)["allocated"]

    def needed_slots(self, policy: str, t: int) -> dict:
        """The pool a policy needs per row: ``min_slots`` for a fixed budget, else the calibrated peak live count."""
        key = (policy, t)
        if key in self.need:
            return self.need[key]
        a, full = self.args, self.full_slots(policy, t)
        if parse_policy(policy).fixed_budget:
            self.need[key] = dict(slots=full, slots_rule="min_slots")
            return self.need[key]
        b = a.calib_batch
        out = _ready(self.generate(self.prompts.get(b, t, seed=1), a.new_tokens, policy, full))
        peaks = calibrate_slots(out.caches, margin=a.safety, multiple=a.slot_multiple)  # per layer (per head: acp)
        cap = lambda x: min(int(x), full)  # noqa: E731
        per_layer = [max(p) if isinstance(p, (list, tuple)) else p for p in peaks]
        if a.pool == "uniform":
            slots = cap(max(per_layer))
        elif a.pool == "layer" or not parse_policy(policy).per_head:
            slots = tuple(cap(p) for p in per_layer)
        else:
            slots = tuple(tuple(cap(h) for h in p) if isinstance(p, (list, tuple)) else cap(p) for p in peaks)
        live = np.asarray(out.live_counts)                      # [N, L, B]
        self.need[key] = dict(slots=slots, slots_rule=f"calibrated ({a.pool}): peak live at batch {b} × {a.safety}, "
                              f"rounded up to {a.slot_multiple}", calib_batch=b, calib_peak_live_mean=float(live.max()),
                              calib_peaks=_spec_stats(peaks)[1], calib_overflow=int(np.asarray(out.overflow).max()))
        return self.need[key]

    def measure(self, policy: str, t: int, batch: int, slots, mode: str) -> dict:
        a = self.args
        n = a.new_tokens
        prompts = self.prompts.get(batch, t)
        want_prefill = a.prefill == "all" or (a.prefill == "budget" and mode == "kv-budget")
        run = lambda steps: self.generate(prompts, n, policy, slots, steps, self.mesh)  # noqa: E731
        seconds, prefill, times, out = timed(run, a.repeats, prefill=want_prefill and n > 1)
        device_ms, device_source = (device_ms_per_step(run, n) if a.device_times and mode == "equal-batch" and n > 1
                                    else (None, None))
        mem = cache_bytes(out.caches)
        live = np.asarray(out.live_counts, np.float64)          # [N, L, B]
        overflow = np.asarray(out.overflow)
        mean_slots, spec = _spec_stats(slots)
        context = self.context(t)
        decode = (batch * (n - 1) / (seconds - prefill)) if (seconds and prefill is not None and seconds > prefill
                                                              and n > 1) else None
        final = live[-1].mean()
        return dict(
            policy=parse_policy(policy).spec, provable=out.provable, prompt_len=t, new_tokens=n, batch=batch,
            devices=1 if self.mesh is None else self.mesh.size, mesh=a.mesh,
            steps_per_check=self.args.steps_per_check,
            slots=mean_slots, capacity=float(np.mean([g.slots for c in out.caches for g in c.groups for _ in g.heads])),
            slots_spec=spec, seconds=seconds, times=times, prefill_seconds=prefill,
            tokens_per_sec=batch * n / seconds if seconds else None, decode_tokens_per_sec=decode,
            device_ms_per_step=device_ms, device_time_source=device_source,
            kv_allocated_bytes=mem["allocated"], kv_live_bytes=mem["live"], kv_row_bytes=mem["allocated"] / batch,
            kv_live_bytes_mean=float(mem["live"] * live.mean() / final) if final > 0 else None,
            live_tokens_final=float(final), live_tokens_mean=float(live.mean()),
            live_tokens_peak=float(live.max()), live_tokens_per_layer_final=live[-1].mean(axis=1).tolist(),
            sparsity_final=1.0 - float(final) / context,
            overflow=int(overflow.max()), overflow_rows=int((overflow > 0).sum()))


def is_oom(e: Exception) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def bench_equal(bench: Bench, policy: str, t: int) -> dict:
    a = bench.args
    need = bench.needed_slots(policy, t) if a.slots == "need" else dict(slots=bench.full_slots(policy, t),
                                                                         slots_rule="min_slots")
    row = bench.measure(policy, t, a.equal_batch, need["slots"], "equal-batch")
    return dict(mode="equal-batch", **row, **{k: v for k, v in need.items() if k != "slots"})


def _grow(slots, full: int, multiple: int, factor: float = 1.25):
    if isinstance(slots, int):
        return min(round_up(slots * factor, multiple), full)
    return tuple(_grow(s, full, multiple, factor) for s in slots)


def bench_budget(bench: Bench, policy: str, t: int) -> dict:
    a = bench.args
    budget = int(a.kv_budget * GiB)
    need = bench.needed_slots(policy, t)
    full = bench.full_slots(policy, t)
    slots, max_batch, notes = need["slots"], a.max_batch, []
    overflow_retried, halvings = False, 0
    while True:
        per_row = bench.row_bytes(policy, t, slots)
        batch = min(int(budget // per_row), max_batch)
        if batch < 1:
            return dict(mode="kv-budget", policy=parse_policy(policy).spec, prompt_len=t, slots=_spec_stats(slots)[0],
                        batch=0, budget_bytes=budget, error=f"one row needs {per_row / GiB:.4f} GiB > the budget")
        try:
            row = bench.measure(policy, t, batch, slots, "kv-budget")
        except Exception as e:  # noqa: BLE001 - out of device memory: retry with half the batch
            if not is_oom(e) or batch == 1 or halvings >= 2:
                raise
            notes.append(f"out of memory at batch {batch}; retried with {batch // 2}")
            max_batch, halvings = batch // 2, halvings + 1
            continue
        if row["overflow"] > 0 and not overflow_retried and not parse_policy(policy).fixed_budget:
            new = _grow(slots, full, a.slot_multiple)
            if new != slots:
                notes.append(f"overflow {row['overflow']} at {_spec_stats(slots)[0]:.0f} slots; retried with 1.25×")
                slots, overflow_retried = new, True
                continue
        break
    return dict(mode="kv-budget", **row, budget_bytes=budget, fits_budget=row["kv_allocated_bytes"] <= budget,
                max_batch=a.max_batch, notes=notes, **{k: v for k, v in need.items() if k != "slots"})


def add_ratios(rows: list[dict]) -> None:
    """Ratios vs the dense row of the same mode and prompt length (None without one)."""
    dense = {(r["mode"], r["prompt_len"]): r for r in rows if r.get("policy") == "dense" and "error" not in r}
    for r in rows:
        d = dense.get((r["mode"], r["prompt_len"]))
        if d is None or "error" in r:
            continue
        ratio = lambda k: (r[k] / d[k]) if r.get(k) and d.get(k) else None  # noqa: E731
        r["vs_dense"] = dict(tokens_per_sec=ratio("tokens_per_sec"), decode_tokens_per_sec=ratio("decode_tokens_per_sec"),
                             batch=ratio("batch"),
                             kv_allocated_saving=(d["kv_allocated_bytes"] / r["kv_allocated_bytes"]
                                                  if r.get("kv_allocated_bytes") else None),
                             kv_row_saving=(d["kv_row_bytes"] / r["kv_row_bytes"] if r.get("kv_row_bytes") else None))


def weight_bytes_read(cfg, params, dtype: str) -> int:
    """Bytes of weights one decode step reads: every parameter once in the compute dtype (the decode loop casts
    them once, before it), except an untied input embedding table, of which a step gathers B rows only."""
    itemsize = jnp.dtype(dtype).itemsize
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        names = [str(getattr(k, "key", k)) for k in path]
        if names[:1] == ["embed"] and not getattr(cfg, "tie_embeddings", True):
            continue
        total += x.size * (itemsize if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype.itemsize)
    return int(total)


def issue_row(r: dict, model: str, weight_bytes: int, bandwidth_tb_s: float, device: dict) -> dict:
    """One bench row in the keys of issue 20 (see the module docstring)."""
    if "error" in r:
        return dict(model=model, mode=r.get("mode"), policy=r.get("policy"), prompt=r.get("prompt_len", r.get("prompt")),
                    batch=r.get("batch"), error=r["error"], **device)
    n, b = r["new_tokens"], r["batch"]
    step_s = ((r["seconds"] - r["prefill_seconds"]) / (n - 1)) if (r.get("prefill_seconds") is not None and n > 1
                                                                   and r["seconds"] > r["prefill_seconds"]) else None
    live = r.get("kv_live_bytes_mean") or r.get("kv_live_bytes") or 0
    bound_s = (weight_bytes + live) / (bandwidth_tb_s * 1e12)
    return dict(model=model, mode=r["mode"], policy=r["policy"], provable=r.get("provable"), batch=b,
                prompt=r["prompt_len"], new_tokens=n, steps_per_check=r.get("steps_per_check"),
                **({"mesh": r["mesh"], "devices": r["devices"]} if r.get("mesh") else {}),
                tokens_per_s=r.get("tokens_per_sec"),
                decode_tokens_per_s=r.get("decode_tokens_per_sec"),
                ms_per_step=None if step_s is None else step_s * 1e3,
                device_ms_per_step=r.get("device_ms_per_step"), device_time_source=r.get("device_time_source"),
                bound_tokens_per_s=b / bound_s, bound_ms_per_step=bound_s * 1e3,
                fraction_of_bound=None if step_s is None else bound_s / step_s,
                kv_bytes_allocated=r.get("kv_allocated_bytes"), kv_bytes_live=r.get("kv_live_bytes"),
                kv_bytes_live_mean=r.get("kv_live_bytes_mean"), weight_bytes=weight_bytes,
                capacity=r.get("capacity"), live_tokens_mean=r.get("live_tokens_mean"), sparsity=r.get("sparsity_final"),
                overflow=r.get("overflow"), prefill_s=r.get("prefill_seconds"), seconds=r.get("seconds"),
                budget_bytes=r.get("budget_bytes"), **device)


def vs_dense(rows: list[dict]) -> None:
    """Ratios of each row to the dense row of the same model, mode and prompt (in place; None without one):
    decode tokens/s, tokens/s, batch, ms per step, allocated KV."""
    dense = {(r.get("model"), r.get("mode"), r.get("prompt")): r for r in rows
             if r.get("policy") == "dense" and "error" not in r}
    for r in rows:
        d = dense.get((r.get("model"), r.get("mode"), r.get("prompt")))
        ratio = lambda k: (r[k] / d[k]) if d and r.get(k) and d.get(k) else None  # noqa: E731
        r.update(decode_vs_dense=ratio("decode_tokens_per_s"), tokens_vs_dense=ratio("tokens_per_s"),
                 batch_vs_dense=ratio("batch"), step_vs_dense=ratio("ms_per_step"),
                 device_step_vs_dense=ratio("device_ms_per_step"), kv_allocated_vs_dense=ratio("kv_bytes_allocated"))


def dense_live_bytes(rows: list[dict], rows_out: str | None, model: str, prompt: int, batch: int | None) -> float:
    """Mean live KV bytes of our dense equal-batch row of this shape (this call's, else the ``--rows-out``
    file's; 0 without one): HF's rows get the same bound (the same weights and KV bytes)."""
    for r in rows:
        if r.get("mode") == "equal-batch" and r.get("policy") == "dense" and r.get("prompt_len") == prompt \
                and "error" not in r:
            return r.get("kv_live_bytes_mean") or 0
    if rows_out:
        for r in read_rows(rows_out):
            if (r.get("model"), r.get("mode"), r.get("policy"), r.get("prompt"), r.get("batch")) == \
                    (model, "equal-batch", "dense", prompt, batch) and "error" not in r:
                return r.get("kv_bytes_live_mean") or 0
    return 0


def read_rows(path: str) -> list[dict]:
    """The rows of a ``--rows-out`` file: [] when it does not exist or is empty (``DECODE_ROWS=/dev/null`` copies
    an empty file); SystemExit naming the flag when it is not a JSON list."""
    if not os.path.exists(path) or not os.path.getsize(path):
        return []
    with open(path) as f:
        try:
            rows = json.load(f)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--rows-out {path}: not a JSON list of rows ({e})") from None
    if not isinstance(rows, list):
        raise SystemExit(f"--rows-out {path}: expected a JSON list of rows, found a {type(rows).__name__}")
    return rows


def write_rows(path: str, new: list[dict]) -> None:
    """Merge ``new`` into the JSON list at ``path`` (a row with the same model, mode, policy and prompt is
    replaced), with the ratios to dense recomputed over the whole file (rows of several calls side by side)."""
    key = lambda r: (r.get("model"), r.get("mode"), r.get("policy"), r.get("prompt"))  # noqa: E731
    old = read_rows(path)
    keys = {key(r) for r in new}
    rows = [r for r in old if key(r) not in keys] + new
    vs_dense(rows)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rows, f, indent=1)
    os.replace(tmp, path)


def markdown_rows(path: str) -> str:
    """The docs' table (README, docs/inference.md) from a ``--rows-out`` file: one line per row, grouped by
    model, prompt and mode; the last column is when the row was measured (month-day hour:minute of its date: rows
    of one command share it, and the ratios compare rows of different commands where they differ)."""
    rows = json.load(open(path))
    num = lambda x, f="{:,.0f}": "–" if x is None else f.format(x)  # noqa: E731
    when = lambda r: (r.get("date") or "")[5:16].replace("T", " ") or "–"  # noqa: E731
    lines = ["| model | prompt + new | mode | policy | batch | decode tok/s | ms/step | device ms/step | bound tok/s "
             "(% of it) | KV allocated | KV live | ×dense decode | ×dense step | ×dense device step | ×dense batch "
             "| measured |", "|" + "---|" * 16]
    order = {"equal-batch": 0, "kv-budget": 1}
    for r in sorted(rows, key=lambda r: (r["model"].split(" ")[0], r.get("prompt") or 0, order.get(r.get("mode"), 2),
                                         " " in r["model"], r.get("policy") != "dense")):
        if "error" in r:
            lines.append(f"| {r['model']} | {r.get('prompt')} | {r.get('mode')} | {r.get('policy')} | | error: "
                         f"{r['error'][:60]} | | | | | | | | | | {when(r)} |")
            continue
        mib = lambda x: "–" if x is None else f"{x / 2**20:,.0f} MiB"  # noqa: E731
        frac = r.get("fraction_of_bound")
        mode = r["mode"] if r["mode"] != "kv-budget" else f"{(r.get('budget_bytes') or 0) / 2**30:g} GiB budget"
        lines.append(
            f"| {r['model']} | {r['prompt']} + {r['new_tokens']} | {mode} | {r['policy']} | {r['batch']} | "
            f"{num(r.get('decode_tokens_per_s'))} | {num(r.get('ms_per_step'), '{:.3f}')} | "
            f"{num(r.get('device_ms_per_step'), '{:.3f}')} | "
            f"{num(r.get('bound_tokens_per_s'))} ({num(None if frac is None else 100 * frac, '{:.0f}')}%) | "
            f"{mib(r.get('kv_bytes_allocated'))} | {mib(r.get('kv_bytes_live'))} | "
            f"{num(r.get('decode_vs_dense'), '{:.2f}')} | {num(r.get('step_vs_dense'), '{:.2f}')} | "
            f"{num(r.get('device_step_vs_dense'), '{:.2f}')} | {num(r.get('batch_vs_dense'), '{:.1f}')} | {when(r)} |")
    return "\n".join(lines)


def print_table(rows: list[dict]) -> None:
    mib = lambda x: "–" if x is None else f"{x / 2**20:,.1f}"  # noqa: E731
    num = lambda x, f="{:,.0f}": "–" if x is None else f.format(x)  # noqa: E731
    print("\n| mode | policy | provable | prompt | B | slots | tokens/s | decode tok/s | prefill s | KV alloc MiB "
          "| KV live MiB | live tok/layer | sparsity | overflow | ×dense tok/s | ×less KV/row |")
    print("|" + "---|" * 16)
    for r in rows:
        if "error" in r:
            print(f"| {r.get('mode')} | {r.get('policy')} | – | {r.get('prompt_len')} | – | – | error: {r['error'][:80]} "
                  "| | | | | | | | | |")
            continue
        v = r.get("vs_dense", {})
        print(f"| {r['mode']} | {r['policy']} | {r['provable']} | {r['prompt_len']} | {r['batch']} | {r['slots']} | "
              f"{num(r['tokens_per_sec'])} | {num(r['decode_tokens_per_sec'])} | {num(r['prefill_seconds'], '{:.4f}')} | "
              f"{mib(r['kv_allocated_bytes'])} | {mib(r['kv_live_bytes'])} | {r['live_tokens_final']:.1f} | "
              f"{100 * r['sparsity_final']:.0f}% | {r['overflow']} | {num(v.get('tokens_per_sec'), '{:.2f}')} | "
              f"{num(v.get('kv_row_saving'), '{:.2f}')} |")


def meta(args, model, info) -> dict:
    import flax

    dev = jax.devices()[0]
    return dict(device=dev.device_kind, backend=jax.default_backend(), device_count=jax.device_count(),
                jax=jax.__version__, jaxlib=getattr(jax.lib, "__version__", None) or _jaxlib_version(),
                flax=flax.__version__, python=platform.python_version(), dtype=args.dtype, model=info,
                config=model.cfg.to_dict(), policies=args.policies, prompt_lengths=args.prompt_lengths,
                new_tokens=args.new_tokens, equal_batch=args.equal_batch, kv_budget_gib=args.kv_budget,
                max_batch=args.max_batch, calib_batch=args.calib_batch, safety=args.safety, slots=args.slots, pool=args.pool,
                slot_multiple=args.slot_multiple, steps_per_check=args.steps_per_check,
                repeats=args.repeats, prefill=args.prefill, prompt_text=args.prompt_text, beta=args.beta, mesh=args.mesh,
                time=time.strftime("%Y-%m-%dT%H:%M:%S"))


def _jaxlib_version():
    try:
        import jaxlib
        return jaxlib.__version__
    except Exception:  # noqa: BLE001
        return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--run", help="a run directory (fox-jax train / finetune-dcp, HF GPT-2, official FoX)")
    src.add_argument("--model", default="gpt2", help="random init: gpt2[-medium|-large|-xl] or ARCH:SIZE "
                     "(fox-pro:125M, transformer-llama:tiny, ...); default gpt2")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="model config overrides for --model "
                   "(n_layers=4 d_model=256 ...)")
    p.add_argument("--step", type=int, help="checkpoint step of --run (default: latest)")
    p.add_argument("--policies", default="dense,dcp", type=lambda s: [x for x in s.split(",") if x],
                   help="comma-separated cache policies (default dense,dcp)")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[896])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--equal-batch", type=int, help="mode 1: every policy at this batch")
    p.add_argument("--kv-budget", type=float, help="mode 2: GiB of allocated KV; per policy the largest batch")
    p.add_argument("--max-batch", type=int, default=256, help="cap of the batch in --kv-budget mode (default 256)")
    p.add_argument("--calib-batch", type=int, default=4, help="batch of the dcp/acp calibration generate (default 4)")
    p.add_argument("--safety", type=float, default=1.1, help="factor on the calibrated peak live count (default 1.1)")
    p.add_argument("--pool", choices=("uniform", "layer", "head"), default="uniform",
                   help="calibrated dcp/acp pool: one slot count for every layer (default), one per layer, or for acp "
                        "one per layer and key/value head (memory follows the per-head live windows)")
    p.add_argument("--slot-multiple", type=int, default=SLOT_MULTIPLE,
                   help=f"calibrated pools are rounded up to a multiple of this (default {SLOT_MULTIPLE})")
    p.add_argument("--slots", choices=("need", "full"), default="need",
                   help="equal-batch pool: the policy's need (default) or min_slots (full context for dcp/acp)")
    p.add_argument("--prompt-text", help="text file or directory of .txt: prompts are windows of it (default random)")
    p.add_argument("--tokenizer", help="tokenizer for --prompt-text (default: the run's)")
    p.add_argument("--beta", type=float, default=1.5, help="β of random DCP weights (default 1.5)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls after the warm-up (default 5; 0: warm-up "
                   "only, nothing timed: fills the persistent compilation cache for a later timed run)")
    p.add_argument("--device-times", action="store_true",
                   help="also trace each equal-batch row's generate and its prefill (jax.profiler) for the kernels' "
                        "time per decode step (device_ms_per_step): free of host gaps and of the prefill's variance")
    p.add_argument("--prefill", choices=("all", "budget", "none"), default="all",
                   help="time the prefill (generate with max_new_tokens=1) in every mode (default), only in "
                        "--kv-budget mode, or never")
    p.add_argument("--no-prefill", dest="prefill", action="store_const", const="none", help="= --prefill none")
    p.add_argument("--steps-per-check", type=int, default=STEPS_PER_CHECK, metavar="K",
                   help=f"decode steps between two checks for the loop's end (generate's steps_per_check; default "
                        f"{STEPS_PER_CHECK}; 1: a check every step)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--mesh", help="decode sharded on this mesh over all devices (data=4, ...: rows over data x fsdp; "
                   "--equal-batch is then the global batch, a multiple of data x fsdp); default one device")
    p.add_argument("--out", default="bench_decode.json", help="the full result (meta + every measured field)")
    p.add_argument("--rows-out", help="also merge the rows, in the issue's keys, into this JSON list (e.g. "
                   "benchmarks/results/decode/decode_h200.json)")
    p.add_argument("--model-name", help="the rows' model name (default --model, or the run directory's name)")
    p.add_argument("--bandwidth", type=float, help="TB/s of the bound (default the device's HBM peak: H200 4.8, "
                   "H100 SXM 3.35; 4.8 where the device is unknown, e.g. a CPU)")
    p.add_argument("--hf", action="store_true", help="add Hugging Face transformers GPT-2 rows (static and dynamic "
                   "cache) on the same shape at --equal-batch (needs torch with CUDA; GPT-2 shapes only)")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: short prompts, tiny budget; with --model "
                   "gpt2 a 2-layer d128 GPT-2 (use e.g. --model fox-pro:tiny for FoX)")
    args = p.parse_args(argv)
    if args.quick:
        if not args.run and args.model.startswith("gpt2"):
            args.set = [f"{k}={v}" for k, v in QUICK_SHAPE.items()] + ["n_positions=256"] + args.set
        args.prompt_lengths, args.new_tokens, args.dtype = [64], 8, "float32"
        args.repeats = min(args.repeats, 1)
        args.equal_batch = args.equal_batch or 2
        args.kv_budget = args.kv_budget or (None if args.mesh else 0.002)
        args.max_batch, args.calib_batch = min(args.max_batch, 8), 2
    if args.equal_batch is None and args.kv_budget is None:
        args.equal_batch = 8
    if args.bandwidth is not None and not args.bandwidth > 0:
        raise SystemExit(f"--bandwidth: expected TB/s > 0, got {args.bandwidth}")
    if args.steps_per_check < 1:
        raise SystemExit(f"--steps-per-check: expected an int ≥ 1, got {args.steps_per_check}")
    if args.mesh:
        from fox_jax.sharding import parse_mesh

        try:
            sizes = parse_mesh(args.mesh)  # a bad spec fails here, before any compile
        except ValueError as e:
            raise SystemExit(str(e)) from None
        if args.kv_budget:
            raise SystemExit("--kv-budget: not with --mesh (the KV budget mode is measured on one device; use "
                             "--equal-batch)")
        if args.equal_batch % (sizes["data"] * sizes["fsdp"]):
            raise SystemExit(f"--equal-batch: {args.equal_batch} rows do not split over the --mesh's data x fsdp = "
                             f"{sizes['data'] * sizes['fsdp']} devices")
    for spec in args.policies:
        parse_policy(spec)  # a bad spec fails here, before any compile
    if args.rows_out:
        read_rows(args.rows_out)  # so does a rows file that is not a JSON list (nothing measured is lost)
    return args


def bound_bandwidth(given: float | None) -> float:
    """The bound's TB/s: ``--bandwidth``, else the device's HBM peak, else the H200's 4.8."""
    from fox_jax.train.metrics import device_peak_bandwidth

    peak = device_peak_bandwidth()
    return given if given is not None else (peak / 1e12 if peak else 4.8)


def main(argv=None) -> dict:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--table"]:  # python bench_decode.py --table ROWS.json: the docs' markdown table
        if len(argv) != 2:
            raise SystemExit("--table takes one file: a --rows-out JSON list")
        print(markdown_rows(argv[1]))
        return {}
    args = parse_args(argv)
    # the heuristic-acp warning once per run (the rows' "provable" says it for each), not once per call site
    warnings.simplefilter("once", HeuristicEvictionWarning)
    model, params, info = load_model(args)
    cfg = model.cfg
    prompts = Prompts(cfg.vocab_size)
    if args.prompt_text:
        spec = args.tokenizer or info.get("tokenizer")
        if not spec:
            raise ValueError("--prompt-text needs --tokenizer (the model names none)")
        batches = max(args.equal_batch or 0, args.max_batch if args.kv_budget else 0, args.calib_batch)
        prompts = Prompts.from_text(args.prompt_text, spec, cfg.vocab_size, batches * max(args.prompt_lengths))
        info.update(prompt_tokens=int(len(prompts.stream)))
    mesh = None
    if args.mesh:
        from fox_jax.sharding import make_mesh, select_partitioner

        mesh = make_mesh(args.mesh)
        select_partitioner(mesh)  # GSPMD on GPUs: the decode kernel per shard (as fox-jax generate --mesh)
    bench = Bench(model, params, prompts, args, mesh)
    result = {"meta": meta(args, model, info), "rows": []}
    rows = result["rows"]
    name = args.model_name or (os.path.basename(os.path.normpath(args.run)) if args.run else args.model)
    m = result["meta"]
    args.bandwidth = bound_bandwidth(args.bandwidth)
    device = dict(device=m["device"], jax=m["jax"], dtype=args.dtype, date=m["time"], bandwidth_tb_s=args.bandwidth)
    weights = weight_bytes_read(cfg, params, args.dtype)
    extra: list[dict] = []   # rows measured elsewhere (HF), already in the issue's keys

    def save():
        add_ratios(rows)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dict(result, issue_rows=extra), f, indent=1)
        os.replace(tmp, args.out)
        if args.rows_out:
            write_rows(args.rows_out, [issue_row(r, name, weights, args.bandwidth, device) for r in rows] + extra)

    modes = [m for m, on in (("equal-batch", args.equal_batch), ("kv-budget", args.kv_budget)) if on]
    for t in args.prompt_lengths:
        for policy in args.policies:
            for mode in modes:
                t0 = time.perf_counter()
                try:
                    row = bench_equal(bench, policy, t) if mode == "equal-batch" else bench_budget(bench, policy, t)
                except Exception as e:  # noqa: BLE001 - one policy failing must not lose the others
                    row = dict(mode=mode, policy=policy, prompt_len=t, error=f"{type(e).__name__}: {e}".split("\n")[0])
                row["wall_seconds"] = time.perf_counter() - t0
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k not in ("times", "live_tokens_per_layer_final")}),
                      flush=True)
                save()
    if args.hf:
        from hf_decode import hf_gpt2_rows

        for t in args.prompt_lengths:
            for r in hf_gpt2_rows(batch=args.equal_batch or 8, prompt=t, new_tokens=args.new_tokens,
                                  repeats=max(args.repeats, 1), n_layers=cfg.n_layers, d_model=cfg.d_model,
                                  n_heads=cfg.n_heads, vocab=cfg.vocab_size, positions=cfg.max_positions or 1024):
                if "error" not in r:
                    live = dense_live_bytes(rows, args.rows_out, name, t, args.equal_batch)
                    bound_s = (weights + live) / (args.bandwidth * 1e12)
                    r.update(bound_tokens_per_s=r["batch"] / bound_s, bound_ms_per_step=bound_s * 1e3,
                             fraction_of_bound=bound_s / (r["ms_per_step"] / 1e3), kv_bytes_live_mean=live or None)
                r.update(mode="equal-batch", model=f"{name} (hf transformers)", **device)
                print(json.dumps(r), flush=True)
                extra.append(r)
                save()
    save()
    print_table(rows)
    print(f"\nwrote {args.out}" + (f" and {args.rows_out}" if args.rows_out else ""))
    return result


if __name__ == "__main__":
    main()
