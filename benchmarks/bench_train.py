"""Training-throughput benchmark: tokens/s, TFLOP/s and MFU of full training steps.

For each (arch, size, context, ACP on/off) it jits the real train step (AdamW, clipping, bf16 compute,
float32 master weights) on synthetic tokens, runs ``--warmup`` steps, then times ``--steps`` steps
(median of per-step wall times, synchronised). FLOPs are dense-equivalent, from the spec's formula
(3 × (2N + 2·n_layer·H·D·L) per token), so ACP shows up as higher TFLOP/s at equal work. MFU divides by
the device's dense bf16 peak (``fox_jax.train.metrics.PEAK_FLOPS``; 989 TFLOP/s on H100/H200).

    python benchmarks/bench_train.py --configs fox-pro:125M:2048 transformer-pro:125M:2048 --acp both \
        --batch-tokens 65536 --out results.json
    python benchmarks/bench_train.py --quick      # CPU smoke run

ACP's speed depends on the forget gates: at init they decay little, so ``--params-from RUN_DIR`` starts every
config from a trained run's parameters (``fox-jax train`` of the same arch and size, e.g. a few hundred steps in
the same device call; a config whose parameter shapes differ gets an error row). The tokens stay synthetic.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time

import jax
import numpy as np

from fox_jax.models import preset
from fox_jax.sharding import batch_sharding, make_mesh, select_partitioner, state_shardings, under_mesh
from fox_jax.train import config as config_lib
from fox_jax.train.metrics import device_peak_flops
from fox_jax.train.loop import LMTask, init_state, make_optimizer, make_train_step, train_step_compiler_options
from fox_jax.sharding import kernel_sharding_enabled

from profile_step import parse_variant  # a sibling script: the same KEY=VALUE parser as its --variants


def trained_params(run_dir: str, model_cfg) -> dict:
    """The parameters of the run in ``run_dir`` (its latest checkpoint) restored onto ``model_cfg``'s shapes
    (``fox_jax.train.runs``: the checkpoint's own check of the arrays).

    Raises:
      FileNotFoundError / ValueError / CheckpointError: no run there, or one without a checkpoint
        (``open_run``); ValueError: parameters of other shapes than ``model_cfg``'s.
    """
    from fox_jax.train.checkpoints import CheckpointError, CorruptCheckpointError
    from fox_jax.train.runs import open_run

    run = open_run(run_dir, flag="--params-from")
    try:
        return dataclasses.replace(run, model=model_cfg).load_params()
    except CheckpointError as e:
        if run.step is None or isinstance(e, CorruptCheckpointError):  # no checkpoint, or an unreadable one
            raise
        raise ValueError(f"--params-from {run_dir}: other parameters than this config's (train the same arch and "
                         f"size): {e}") from None


def parse_config(entry: str) -> tuple[str, str, int]:
    """``"arch:size:seq_len"`` -> (arch, size, seq_len). Raises ValueError naming ``--configs``."""
    parts = entry.split(":")
    if len(parts) != 3 or not parts[2].isdigit():
        raise ValueError(f"--configs: expected arch:size:seq_len (e.g. fox-pro:760M:16384), got {entry!r}")
    return parts[0], parts[1], int(parts[2])


GPT2_DCP = "gpt2-dcp"  # the arch name of GPT-2 with DCP's interaction weights, timed as `fox-jax finetune-dcp` trains it


def experiment(arch: str, size: str, seq_len: int, acp: bool, batch: int, overrides: dict):
    """(ExperimentConfig, task) of one row: the LM families of ``preset`` (FoX, Transformer; ``LMTask``), or
    ``gpt2-dcp`` with size ``124M`` (or a GPT-2 name: gpt2-medium, ...): GPT-2 with fresh DCP interaction weights and
    the DCP fine-tune's loss (``DCPTask``: the mask, the sparsity regulariser, α of step 0).

    Raises:
      ValueError: an unknown arch or size, ACP with gpt2-dcp (it has no forget gates), a context past GPT-2's 1024.
    """
    if arch == GPT2_DCP:
        from fox_jax.config import GPT2_SIZES, gpt2_preset
        from fox_jax.train.finetune_dcp import DCPTask

        name = "gpt2" if size == "124M" else size
        if name not in GPT2_SIZES or acp:
            raise ValueError(f"--configs: {GPT2_DCP} takes size 124M or one of {sorted(GPT2_SIZES)} and no ACP, "
                             f"got {size!r}{' with ACP' if acp else ''}")
        model_cfg = gpt2_preset(name, dcp=True, **overrides)
        if seq_len > model_cfg.max_positions:
            raise ValueError(f"--configs: {GPT2_DCP} reads at most {model_cfg.max_positions} tokens, got {seq_len}")
        cfg = config_lib.ExperimentConfig(model=model_cfg, steps=1000, batch_size=batch, dcp=config_lib.DCPConfig(alpha_steps=1000))
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=seq_len))
        return cfg, DCPTask(cfg)
    if size == "tiny":
        overrides = dict(overrides, vocab_size=257)
    model_cfg = preset(size, arch, adaptive_threshold="auto" if acp else None, **overrides)
    cfg = config_lib.ExperimentConfig(model=model_cfg, steps=1000, batch_size=batch)
    return cfg, LMTask(cfg)


def bench_one(arch, size, seq_len, acp, batch_tokens, steps, warmup, remat, mesh_spec, dtype, partitioner="auto",
              model_overrides=None, devices=None, params_from=None, xla_options=None):
    """One row: the train step of ``arch:size`` at ``seq_len`` timed on ``mesh_spec`` over all devices, or over
    ``devices`` (``fox_jax.sharding.make_mesh``), with ``batch_tokens`` tokens per step; from a fresh init, or
    from the parameters of the run ``params_from`` (``trained_params``); ``xla_options``: XLA debug options for
    this step's compile alone (``jax.jit(..., compiler_options=...)``), over those ``train/loop.py`` compiles the
    step with (``train_step_compiler_options``)."""
    overrides = dict(dtype=dtype, **(model_overrides or {}))
    if remat is not None:  # None: the model's default (ModelConfig.remat)
        overrides["remat"] = remat
    mesh = make_mesh(mesh_spec, devices)
    partitioner = select_partitioner(mesh, partitioner)
    n_batch = mesh.shape["data"] * mesh.shape["fsdp"]
    batch = max(n_batch, batch_tokens // seq_len // n_batch * n_batch)
    cfg, task = experiment(arch, size, seq_len, acp, batch, overrides)
    model_cfg, scalars = cfg.model, task.host_scalars(0)
    optimizer = make_optimizer(cfg)
    rng = jax.random.PRNGKey(0)
    params = None if params_from is None else trained_params(params_from, model_cfg)
    abstract = jax.eval_shape(lambda: init_state(cfg, rng, optimizer))
    shard = state_shardings(mesh, abstract)
    t_init = time.perf_counter()
    state = jax.device_put(init_state(cfg, rng, optimizer, params), shard)  # then placed, as train/loop.py does
    jax.block_until_ready(state)
    # progress on stderr as it happens: a call cut by its deadline still shows how far it got
    print(f"# {arch}:{size}:{seq_len} acp={acp}: state initialised in {time.perf_counter() - t_init:.1f} s",
          file=sys.stderr, flush=True)
    train_step = make_train_step(task, model_cfg.build(), optimizer, 1)
    compile_options = {**train_step_compiler_options(), **(xla_options or {})}
    jitted = under_mesh(mesh, jax.jit(train_step, in_shardings=(shard, batch_sharding(mesh), None),
                                      out_shardings=(shard, None), donate_argnums=(0,),
                                      compiler_options=compile_options or None))
    step = lambda s, b: jitted(s, b, scalars)  # noqa: E731  (DCP's α and γ: traced, as the trainer passes them)
    tokens = np.random.default_rng(0).integers(0, model_cfg.vocab_size, (batch, seq_len + 1), dtype=np.int32)
    data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "segment_ids": np.ones((batch, seq_len), np.int32),
            # real batches carry positions; a constant arange would let XLA constant-fold RoPE (minutes)
            "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch, seq_len)).copy()}
    data = jax.device_put(data, batch_sharding(mesh))
    t0 = time.perf_counter()
    state, m = step(state, data)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    print(f"# {arch}:{size}:{seq_len} acp={acp}: compile + first step {compile_s:.1f} s", file=sys.stderr, flush=True)
    for _ in range(warmup):
        state, m = step(state, data)
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, m = step(state, data)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    dt = statistics.median(times)
    tok_s = batch * seq_len / dt
    flops = 3 * model_cfg.flops_per_token(seq_len) * batch * seq_len
    peak = device_peak_flops(dtype)
    n_dev = mesh.size
    row = dict(arch=arch, size=size, seq_len=seq_len, acp=acp, batch=batch, remat=model_cfg.remat,
               scan_layers=model_cfg.scan_layers, mesh=mesh_spec or "",
               partitioner=partitioner, kernels_sharded=kernel_sharding_enabled() and mesh.size > 1, devices=n_dev, step_ms=dt * 1e3, tokens_per_sec=tok_s, tflops_per_device=flops / dt / 1e12 / n_dev,
               mfu=(flops / dt / (peak * n_dev)) if peak else None, compile_s=compile_s,
               loss=float(m["loss"]), params=model_cfg.param_count(), params_from=params_from or "init",
               compile_options=compile_options)
    if acp:
        row["acp_fraction_skipped"] = float(m["acp_fraction_skipped"])
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=["fox-pro:125M:2048", "transformer-pro:125M:2048"],
                   help="arch:size:seq_len entries")
    p.add_argument("--acp", choices=["off", "on", "both"], default="off")
    p.add_argument("--batch-tokens", type=int, default=65536, help="tokens per step (global)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--remat", default=None, choices=("none", "full", "dots"),
                   help="activation rematerialisation (default: the model config's, dots)")
    p.add_argument("--mesh", default=None)
    p.add_argument("--partitioner", choices=("auto", "shardy", "gspmd"), default="auto",
                   help="XLA SPMD partitioner (fox_jax.sharding.select_partitioner)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--overrides", default="", metavar="KEY=VALUE,...",
                   help="ModelConfig overrides for every config, e.g. attention_impl=pallas,loss_impl=chunked")
    p.add_argument("--xla-variants", nargs="+", default=["base"], metavar="NAME[:OPTION=VALUE,...]",
                   help="each config once per variant: its step compiled with the XLA options the training "
                        "loop uses (train/loop.py train_step_compiler_options; on GPU the DUS zero-init "
                        "elimination) plus the variant's OPTION=VALUE pairs (jit's compiler_options; a NAME alone "
                        "adds none); same process, same init and data. Each row records its compile_options")
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="CPU smoke run with the tiny model")
    p.add_argument("--params-from", default=None, metavar="RUN_DIR",
                   help="start from this run's parameters (trained forget gates for ACP; same arch and size)")
    args = p.parse_args(argv)
    if args.quick:
        args.configs, args.batch_tokens, args.steps, args.warmup, args.dtype = (
            ["fox-pro:tiny:128", "transformer-pro:tiny:128"], 1024, 2, 1, "float32")
    acps = {"off": [False], "on": [True], "both": [False, True]}[args.acp]
    model_overrides = parse_variant(f"overrides:{args.overrides}")[1]
    try:
        variants = [parse_variant(v) for v in args.xla_variants]
    except ValueError as e:
        p.error(f"--xla-variants: {e}")
    configs = []
    for entry in args.configs:  # a malformed or unknown entry is refused here, in one line, before anything compiles
        try:
            arch, size, seq = parse_config(entry)
            for acp in acps:
                if not acp or arch.startswith("fox"):
                    experiment(arch, size, seq, acp, 1, dict(dtype=args.dtype, **model_overrides))
        except ValueError as e:
            p.error(str(e) if str(e).startswith("--") else f"--configs {entry}: {e}")
        configs.append((arch, size, seq))
    rows = []
    for arch, size, seq in configs:
        for acp in acps:
            if acp and not arch.startswith("fox"):
                continue
            for variant, xla_options in variants:
                try:
                    row = bench_one(arch, size, seq, acp, args.batch_tokens, args.steps, args.warmup,
                                    args.remat, args.mesh, args.dtype, args.partitioner, model_overrides,
                                    params_from=args.params_from, xla_options=xla_options)
                    row["overrides"] = model_overrides
                except Exception as e:  # OOM or unsupported: record and go on
                    row = dict(arch=arch, size=size, seq_len=seq, acp=acp,
                               error=f"{type(e).__name__}: {str(e)[:200]}")
                if len(variants) > 1 or xla_options:
                    row.update(xla_variant=variant, xla_options=xla_options)
                rows.append(row)
                print(json.dumps(row), flush=True)
    named = any("xla_variant" in r for r in rows)
    print(f"\n| arch | size | ctx | ACP |{' XLA |' if named else ''} batch | step ms | tokens/s | TFLOP/s/dev | MFU | "
          f"pruned |")
    print("|---|---|---|---|" + ("---|" if named else "") + "---|---|---|---|---|---|")
    for r in rows:
        xla = f" {r.get('xla_variant', '')} |" if named else ""
        if "error" in r:
            print(f"| {r['arch']} | {r['size']} | {r['seq_len']} | {'on' if r['acp'] else 'off'} |{xla} – | "
                  f"{r['error'][:120]} | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "–"
        pruned = f"{100 * r['acp_fraction_skipped']:.0f}%" if "acp_fraction_skipped" in r else ""
        print(f"| {r['arch']} | {r['size']} | {r['seq_len']} | {'on' if r['acp'] else 'off'} |{xla} {r['batch']} | "
              f"{r['step_ms']:.1f} | {r['tokens_per_sec']:,.0f} | {r['tflops_per_device']:.1f} | {mfu} | {pruned} |")
    if args.out:
        meta = dict(device=jax.devices()[0].device_kind, n_devices=jax.device_count(), jax=jax.__version__,
                    python=platform.python_version(), peak_flops=device_peak_flops(args.dtype), dtype=args.dtype)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
