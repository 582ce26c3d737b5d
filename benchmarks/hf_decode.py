"""The Hugging Face ``transformers`` side of the decode benchmark: GPT-2 generating on the same shape, same GPU.

A random-init ``GPT2LMHeadModel`` with GPT-2 124M's shape (or the shape given) in bf16 on CUDA generates greedily with
a static KV cache (``cache_implementation="static"``: preallocated, the fastest cache HF has for GPT-2) or the default
dynamic one; ``min_new_tokens = max_new_tokens`` so that every call decodes exactly N tokens. Timing as
``bench_decode.py``: the median of ``repeats`` calls after a warm-up, the prefill measured as a call with one new token,
decode tokens/s = B·(N − 1) / (t(N) − t(1)). Needs torch with CUDA and transformers (the ``hf`` extra); imported only
when ``bench_decode.py --hf`` asks for it (``--policies ""`` for the HF rows alone, added to a ``--rows-out`` file).
"""

from __future__ import annotations

import statistics
import time


def hf_gpt2_rows(*, batch: int, prompt: int, new_tokens: int, caches=("static", "dynamic"), repeats: int = 3,
                 n_layers: int = 12, d_model: int = 768, n_heads: int = 12, vocab: int = 50257,
                 positions: int = 1024) -> list[dict]:
    """One row per HF cache implementation: tokens/s, decode tokens/s, ms per decode step (keys as bench_decode)."""
    import torch
    import transformers

    if not torch.cuda.is_available():
        raise RuntimeError("--hf needs torch with a CUDA device")
    cfg = transformers.GPT2Config(n_layer=n_layers, n_embd=d_model, n_head=n_heads, vocab_size=vocab,
                                  n_positions=positions)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, vocab, (batch, prompt), device="cuda")
    mask = torch.ones_like(ids)
    rows = []
    for cache in caches:
        def run(n):
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                     cache_implementation=cache, pad_token_id=0)
            torch.cuda.synchronize()
            return out

        def timed(n):
            run(n)  # warm-up (allocations, any compile)
            times = []
            for _ in range(max(repeats, 1)):
                t0 = time.perf_counter()
                run(n)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        try:
            full, first = timed(new_tokens), timed(1)
        except Exception as e:  # noqa: BLE001 - a cache this transformers does not have: say so in the row
            rows.append(dict(model="hf-gpt2", policy=f"hf-{cache}", batch=batch, prompt=prompt, new_tokens=new_tokens,
                             error=f"{type(e).__name__}: {str(e)[:200]}"))
            continue
        decode = batch * (new_tokens - 1) / (full - first) if full > first else None
        rows.append(dict(model="hf-gpt2", policy=f"hf-{cache}", batch=batch, prompt=prompt, new_tokens=new_tokens,
                         tokens_per_s=batch * new_tokens / full, decode_tokens_per_s=decode,
                         ms_per_step=(full - first) / (new_tokens - 1) * 1e3, seconds=full, prefill_seconds=first,
                         torch=torch.__version__, transformers=transformers.__version__))
    return rows

