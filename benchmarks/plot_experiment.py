"""Plots and a table for a set of training runs trained on the same tokens (issue 4's experiment).

Reads each run's ``metrics.jsonl`` (and, when present, the per-position loss JSON written by
``fox-jax eval``) and writes:

* ``<out>/val_loss.png``: validation loss against training tokens, one curve per run;
* ``<out>/acp.png``: for runs with ACP, the fraction of attention tiles pruned against tokens;
* ``<out>/per_position.png``: per-position validation loss of the runs that have it;
* a markdown table on stdout (last validation loss / perplexity, median tokens/s, ACP pruned).

    python benchmarks/plot_experiment.py benchmarks/results/experiment_small/* --out benchmarks/results/experiment_small
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics

import matplotlib

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


def plot(runs: list[dict], out: str) -> list[str]:
    os.makedirs(out, exist_ok=True)
    written = []
    xlabel = "training tokens (M)" if all(r["tokens_per_step"] for r in runs) else "step"

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in runs:
        pts = sorted((s, v["val_loss"]) for s, v in r["rows"].items() if "val_loss" in v and s > 0)
        if pts:
            ax.plot([_tokens(r, s) for s, _ in pts], [v for _, v in pts], marker="o", ms=3, label=r["name"])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    written.append(os.path.join(out, "val_loss.png"))
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    acp_runs = [r for r in runs if any("acp_fraction_skipped" in v for v in r["rows"].values())]
    if acp_runs:
        fig, ax = plt.subplots(figsize=(6.5, 3.2))
        for r in acp_runs:
            pts = sorted((s, v["acp_fraction_skipped"]) for s, v in r["rows"].items() if "acp_fraction_skipped" in v)
            ax.plot([_tokens(r, s) for s, _ in pts], [100 * v for _, v in pts], label=r["name"])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("attention tiles pruned (%)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        written.append(os.path.join(out, "acp.png"))
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

    pp_runs = [r for r in runs if r["per_position"]]
    if pp_runs:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for r in pp_runs:
            loss = r["per_position"]["per_position_loss"]
            xs = [i + 1 for i, v in enumerate(loss) if v is not None and math.isfinite(v)]
            ys = [v for v in loss if v is not None and math.isfinite(v)]
            ax.plot(xs, ys, lw=0.8, label=r["name"])
        ax.set_xscale("log")
        ax.set_xlabel("token position")
        ax.set_ylabel("validation loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        written.append(os.path.join(out, "per_position.png"))
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def table(runs: list[dict]) -> str:
    lines = ["| run | last eval step | tokens (M) | val loss | val ppl | median tokens/s | ACP tiles pruned |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        evals = sorted(s for s, v in r["rows"].items() if "val_loss" in v)
        last = evals[-1] if evals else None
        rates = [v["tokens_per_sec"] for s, v in r["rows"].items() if s > 1 and v.get("tokens_per_sec")]
        pruned = [v["acp_fraction_skipped"] for v in r["rows"].values() if "acp_fraction_skipped" in v]
        vl = r["rows"][last]["val_loss"] if last is not None else float("nan")
        lines.append(f"| {r['name']} | {last} | {_tokens(r, last or 0):.1f} | {vl:.4f} | {math.exp(min(vl, 50)):.1f} | "
                     f"{statistics.median(rates):,.0f} | "
                     f"{(f'{100 * pruned[-1]:.1f}%' if pruned else '–')} |" if rates else
                     f"| {r['name']} | {last} | – | {vl:.4f} | {math.exp(min(vl, 50)):.1f} | – | – |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="run directories (metrics.jsonl, config.json, optional eval JSON)")
    p.add_argument("--out", required=True, help="directory for the PNGs")
    args = p.parse_args(argv)
    runs = [read_run(r) for r in args.runs if os.path.isdir(r)]
    for path in plot(runs, args.out):
        print("wrote", path)
    print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
