"""Throughput accounting (TFLOP/s, MFU), metric writers (console, JSON lines, TensorBoard) and the loss
curve (``plot_loss_curve``)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import jax

# Dense peak FLOP/s per chip by device kind (vendor datasheets, no sparsity). Keys are matched as
# lower-case substrings of ``jax.Device.device_kind``. bf16/fp16 use the tensor-core rate; float32
# matmuls in XLA default to TF32 on Hopper/Ampere.
PEAK_FLOPS = {
    "h200": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},
    "h100": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},
    "a100": {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
    "l40s": {"bfloat16": 362e12, "float16": 362e12, "float32": 181e12},
}


def device_peak_flops(dtype: str, device: jax.Device | None = None) -> float | None:
    """Peak dense FLOP/s of one device for ``dtype``, or None when unknown (e.g. CPUs)."""
    device = device or jax.devices()[0]
    kind = device.device_kind.lower()
    for name, peaks in PEAK_FLOPS.items():
        if name in kind:
            return peaks.get(dtype)
    return None


# HBM bytes/s of one device (the vendors' figures), for memory-bound rooflines such as a decode step's. Keys are
# matched against ``device_kind`` in order, the variants first: "h100 pcie" (HBM2e) and "h100 nvl" before "h100"
# (the SXM card), the 40 GB A100s before the 80 GB ones.
PEAK_HBM_BYTES_PER_S = {"h200": 4.8e12, "h100 pcie": 2.0e12, "h100 nvl": 3.9e12, "h100": 3.35e12,
                        "a100-sxm4-40gb": 1.555e12, "a100-pcie-40gb": 1.555e12, "a100": 2.0e12, "l40s": 0.864e12}


def device_peak_bandwidth(device: jax.Device | None = None) -> float | None:
    """Peak HBM bandwidth of one device in bytes/s, or None when unknown (e.g. CPUs)."""
    kind = (device or jax.devices()[0]).device_kind.lower()
    for name, bandwidth in PEAK_HBM_BYTES_PER_S.items():
        if name in kind:
            return bandwidth
    return None


def _summary_writer_class():
    """tensorboardX's ``SummaryWriter`` (None without tensorboardX), imported without torch: tensorboardX
    imports torch when it can (2 s) only to accept torch tensors, and we write Python floats."""
    import sys

    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # makes tensorboardX's optional ``import torch`` fail fast
    try:
        from tensorboardX import SummaryWriter
    except ImportError:  # pragma: no cover - tensorboardX is a dependency
        SummaryWriter = None
    finally:
        if hide:
            del sys.modules["torch"]  # a later ``import torch`` (HF export) loads it normally
    return SummaryWriter


class MetricWriter:
    """Writes metrics to ``<workdir>/metrics.jsonl`` (one JSON object per line) and TensorBoard.

    Only process 0 writes. TensorBoard is optional: without tensorboardX installed only JSON is written.
    """

    def __init__(self, workdir: str, enabled: bool = True, truncate_after: int | None = None):
        """``truncate_after``: on a resume from step N, drop rows of steps > N written by the run that
        died after its last checkpoint, so the file holds each step once."""
        self.enabled = enabled and jax.process_index() == 0
        self.path = None
        self._jsonl = None
        self._tb = None
        if not self.enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        path = self.path = os.path.join(workdir, "metrics.jsonl")
        if truncate_after is not None and os.path.exists(path):
            with open(path) as f:
                rows = [line for line in f if line.strip() and json.loads(line)["step"] <= truncate_after]
            with open(path, "w") as f:
                f.writelines(rows)
        self._jsonl = open(path, "a", buffering=1)
        SummaryWriter = _summary_writer_class()
        if SummaryWriter is not None:
            self._tb = SummaryWriter(os.path.join(workdir, "tb"))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: _to_float(v) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": int(step), **clean}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def _to_float(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def format_log_line(step: int, total: int, m: dict[str, Any]) -> str:
    """``step 100/300 | loss 2.3456 | lr 3.00e-03 | gnorm 0.81 | 12.3k tok/s | 1.20 TFLOP/s | MFU 34.1%``, with
    the DCP columns (``ce 3.30 | sp_loss 0.110 | sparsity 12.3% | α 2.50 | β̄ 1.98``) after the loss when the
    row has them, ACP's pruned fraction and the validation (``val_loss 2.5 (ppl 12.2[, sparsity 30.1% at
    α=∞])``) at the end; a row of only validation gives ``step 0/300 | val_loss ...``.

    TFLOP/s and MFU appear only with an ``mfu`` (a device of known peak); ``metrics.jsonl`` keeps ``tflops``
    everywhere."""
    parts = [f"step {step}/{total}"]
    if "loss" in m:
        parts.append(f"loss {m['loss']:.4f}")
    if "beta_mean" in m:
        parts += [f"ce {m['ce']:.4f}", f"sp_loss {m['sparsity_loss']:.4f}", f"sparsity {100 * m['sparsity']:.1f}%",
                  f"α {m['alpha']:.3f}", f"β̄ {m['beta_mean']:.3f}"]
    if "lr" in m:
        parts.append(f"lr {m['lr']:.2e}")
    if "grad_norm" in m:
        parts.append(f"gnorm {m['grad_norm']:.3f}")
    if m.get("tokens_per_sec") is not None:
        parts.append(f"{_si(m['tokens_per_sec'])} tok/s")
    if m.get("mfu") is not None:  # only where the device's peak is known (GPUs, TPUs; not CPUs)
        if "tflops" in m:
            parts.append(f"{m['tflops']:.2f} TFLOP/s")
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    if "acp_fraction_skipped" in m:
        parts.append(f"ACP pruned {100 * m['acp_fraction_skipped']:.1f}%")
    if "val_loss" in m:
        sparsity = f", sparsity {100 * m['val_sparsity']:.1f}% at α=∞" if "val_sparsity" in m else ""
        parts.append(f"val_loss {m['val_loss']:.4f} (ppl {m['val_ppl']:.2f}{sparsity})")
    return " | ".join(parts)


def _si(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def read_metrics(path: str) -> list[dict]:
    """The rows of a ``metrics.jsonl`` (one JSON object per line)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss_curve(metrics_path: str, png_path: str, title: str | None = None) -> bool:
    """Training loss and validation loss against step, from ``metrics.jsonl``, as a PNG (matplotlib, Agg).

    Returns False (and writes nothing) when the file holds no loss yet.
    """
    rows = read_metrics(metrics_path) if os.path.exists(metrics_path) else []
    train = [(r["step"], r["loss"]) for r in rows if isinstance(r.get("loss"), float) and math.isfinite(r["loss"])]
    val = [(r["step"], r["val_loss"]) for r in rows if isinstance(r.get("val_loss"), float)]
    if not train and not val:
        return False
    from matplotlib.figure import Figure  # no pyplot: renders with Agg, leaves the global backend alone

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train), lw=1, label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", lw=2, ms=4, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title or os.path.basename(os.path.dirname(os.path.abspath(metrics_path))))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = png_path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, png_path)  # a reader never sees a half-written file
    return True
