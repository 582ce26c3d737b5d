"""Plots and a table for a set of training runs trained on the same tokens (issue 4's experiment).

Reads each run's ``metrics.jsonl`` (and, when present, the per-position loss JSON written by
``fox-jax eval``) and writes:

* ``<out>/val_loss.png``: validation loss against training tokens, one curve per run;
* ``<out>/acp.png``: for runs with ACP, the fraction of attention tiles pruned against tokens;
* ``<out>/per_position.png``: per-position validation loss of the runs that have it (log-spaced bins);
* ``<out>/per_position_vs_<REF>.png`` (``--reference REF``): the same minus run REF's curve;
* a markdown table on stdout (last validation loss / perplexity, median tokens/s, ACP pruned).

    python benchmarks/plots/plot_experiment.py benchmarks/results/quality/h200_archs/*/ \
        --out benchmarks/results/quality/h200_archs --reference transformer-pro
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402



def read_run(path: str) -> dict:
    """``{"name", "rows" (step → merged row), "tokens_per_step", "per_position" (or None)}``.

    Raises:
      FileNotFoundError: ``path`` has no metrics.jsonl.
    """
    metrics = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(metrics):
        raise FileNotFoundError(f"{metrics} not found: give run directories of 'fox-jax train'")
    rows: dict[int, dict] = {}
    with open(metrics) as f:
        for line in f:
            r = json.loads(line)
            rows.setdefault(r["step"], {}).update(r)
    tokens_per_step = None
    cfg_path = os.path.join(path, "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)
        tokens_per_step = cfg["batch_size"] * cfg["data"]["seq_len"]
    per_pos = sorted(glob.glob(os.path.join(path, "step_*_len_*.json")) + glob.glob(os.path.join(path, "eval", "*.json")))
    per_position = None
    for p in per_pos:
        with open(p) as f:
            d = json.load(f)
        if "per_position_loss" in d:
            per_position = d
    return dict(name=os.path.basename(os.path.normpath(path)), rows=rows, tokens_per_step=tokens_per_step,
                per_position=per_position)


def _tokens(run, step):
    return step * run["tokens_per_step"] / 1e6 if run["tokens_per_step"] else step


def _figure(curves, path: str, xlabel: str, ylabel: str, *, height: float = 4.0, logx: bool = False,
            **style) -> str:
    """One line plot of ``curves`` = [(label, xs, ys)] written to ``path``."""
    fig, ax = plt.subplots(figsize=(6.5, height))
    for label, xs, ys in curves:
        ax.plot(xs, ys, label=label, **style)
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _series(run: dict, key: str, scale: float = 1.0):
    """(tokens or steps, values) of the rows that have ``key`` (step 0 excluded)."""
    pts = sorted((s, v[key]) for s, v in run["rows"].items() if key in v and s > 0)
    return [_tokens(run, s) for s, _ in pts], [scale * v for _, v in pts]


def binned_per_position(per_position: dict) -> tuple[list[float], list[float]]:
    """Per-position loss of a ``fox-jax eval`` JSON averaged over log-spaced position bins, weighted by
    each position's token count (``fox_jax.train.evaluate.log_binned``, the binning of eval's own plot): a
    validation set of a few documents gives ~16 tokens per position, far too noisy raw. Positions with
    no tokens or a missing (None / non-finite) loss are left out.

    Returns:
      (bin centres as 1-based positions, mean loss per bin in nats).
    """
    from fox_jax.train.evaluate import log_binned

    loss = np.asarray([np.nan if v is None else v for v in per_position["per_position_loss"]], np.float64)
    count = np.asarray(per_position.get("per_position_count") or np.ones(len(loss)), np.float64)
    count = np.where(np.isfinite(loss), count, 0.0)
    centres, values = log_binned(np.nan_to_num(loss), count)
    return centres.tolist(), values.tolist()


def plot(runs: list[dict], out: str, reference: str | None = None) -> list[str]:
    os.makedirs(out, exist_ok=True)
    xlabel = "training tokens (M)" if all(r["tokens_per_step"] for r in runs) else "step"
    written = [_figure([(r["name"], *_series(r, "val_loss")) for r in runs if _series(r, "val_loss")[0]],
                       os.path.join(out, "val_loss.png"), xlabel, "validation loss (nats/token)", marker="o", ms=3)]
    acp = [(r["name"], *_series(r, "acp_fraction_skipped", 100.0)) for r in runs]
    acp = [c for c in acp if c[1]]
    if acp:
        written.append(_figure(acp, os.path.join(out, "acp.png"), xlabel, "attention tiles pruned (%)", height=3.2))
    per_pos = [(r["name"], *binned_per_position(r["per_position"])) for r in runs if r["per_position"]]
    if per_pos:
        written.append(_figure(per_pos, os.path.join(out, "per_position.png"), "token position",
                               "validation loss (nats/token), log-spaced bins", logx=True, marker="o", ms=2))
    ref = next((c for c in per_pos if c[0] == reference), None)
    if ref is not None:  # the documents' own difficulty cancels in the difference
        diff = [(name, xs, [y - r for y, r in zip(ys, ref[2])]) for name, xs, ys in per_pos if name != reference]
        written.append(_figure(diff, os.path.join(out, f"per_position_vs_{reference}.png"), "token position",
                               f"loss − {reference} loss (nats/token)", logx=True, marker="o", ms=2))
    return written


def table(runs: list[dict]) -> str:
    lines = ["| run | last eval step | tokens (M) | val loss | val ppl | median tokens/s | ACP tiles pruned |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        evals = sorted(s for s, v in r["rows"].items() if "val_loss" in v)
        last = evals[-1] if evals else 0
        vl = r["rows"][last]["val_loss"] if evals else float("nan")
        rates = [v["tokens_per_sec"] for s, v in r["rows"].items() if s > 1 and v.get("tokens_per_sec")]
        pruned = [v["acp_fraction_skipped"] for v in r["rows"].values() if "acp_fraction_skipped" in v]
        rate = f"{statistics.median(rates):,.0f}" if rates else "–"
        tokens = f"{_tokens(r, last):.1f}" if rates else "–"
        lines.append(f"| {r['name']} | {last} | {tokens} | {vl:.4f} | {math.exp(min(vl, 50)):.1f} | {rate} | "
                     f"{f'{100 * pruned[-1]:.1f}%' if pruned else '–'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="run directories (metrics.jsonl, config.json, optional eval JSON)")
    p.add_argument("--out", required=True, help="directory for the PNGs")
    p.add_argument("--reference", default=None, metavar="RUN_NAME",
                   help="also plot every run's binned per-position loss minus this run's")
    args = p.parse_args(argv)
    runs = [read_run(r) for r in args.runs if os.path.isdir(r)]
    for path in plot(runs, args.out, args.reference):
        print("wrote", path)
    print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
