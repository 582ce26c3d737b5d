"""The quality table of the pruning methods: rows of ``quality_h200.json``, the perplexity-ratio-vs-sparsity
figure and a markdown table.

Input: a results folder of ``benchmarks/quality.sh``, of one of two plans.

GPT-2, the ``table`` plan (``QUALITY=table``): ``table/dcp_eval.json``
(``fox-jax dcp-eval``: the pretrained model, the DCP fine-tunes, the fine-tuned controls — the dense control
and the fixed patterns, each under its own pattern — and the untuned fixed-pattern baselines at the DCP runs'
sparsities, all on the same validation windows), ``table_passkey/<label>/passkey.json`` (``fox-jax passkey``
under the cache policy equivalent to the model's own mask) and ``env.json``.

FoX, the ``inference`` plan with ``PLAN="fox_train fox_quality"``: its ``summary.json`` (``plot_inference.py``:
``fox-jax eval --cache POLICY`` at each context next to the dense cache on the same tokens, ``fox-jax passkey
--cache POLICY``). One row per (policy, context); ``sparsity`` there is the fraction of the keys each cache saw
that it no longer holds after the window's last token (``policy_evicted_fraction`` of ``eval --cache``, mean over
layers and key/value heads), ``ppl_ratio`` is to the dense cache on the same tokens, ``passkey_acc`` is the
accuracy at that context length, ``provable`` whether the policy's promise holds for the model (``acp`` with
QK-norm) or is a heuristic.

Rows (one per model and method; ``--rows FILE`` merges them into FILE, replacing rows of the same ``key``):

  model          e.g. "gpt2-124M"                method     dense | dense-ft | dcp:g<γ> | window:W | strided:S |
  fine_tuned     False for the pretrained model                         sinks:S+W (the model's own pattern)
                 and the untuned baselines          context    tokens per validation window
  sparsity       fraction of causal (query, key) pairs dropped, within documents, mean over layers
  ppl            validation perplexity under the method; val_loss (nats/token)
  ppl_ratio      ppl / ppl of the reference on the same windows: the dense fine-tuning control (``dense-ft``)
                 when the folder has one, else the pretrained model (``ppl_ratio_to`` names it)
  passkey_acc    exact-match passkey accuracy over the folder's grid (``passkey_grid``), None where no cache
                 policy decodes the pattern (strided) or passkey did not run
  key, stage, device, jax, date, source and the method's details (gamma, steps, pattern, nominal_sparsity)

Usage:
  python benchmarks/plots/plot_quality.py RESULTS_DIR --model gpt2-124M --stage gpt2-dcp \\
      --rows benchmarks/results/quality/quality_h200.json --out-dir DIR
  python benchmarks/plots/plot_quality.py RESULTS_DIR --model fox-pro-125M --stage fox-pro \\
      --rows benchmarks/results/quality/quality_h200.json       (a FoX inference-plan folder: summary.json)
  python benchmarks/plots/plot_quality.py --rows benchmarks/results/quality/quality_h200.json --out-dir DIR
      (plot and table from the rows file alone)
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import date

FAMILIES = {  # method prefix -> (color, marker, legend)
    "dcp": ("#c0392b", "D", "DCP (learned)"),
    "window": ("#2e86c1", "o", "local window"),
    "strided": ("#27ae60", "s", "strided"),
    "sinks": ("#8e44ad", "^", "sinks + window"),
    "acp": ("#e67e22", "P", "ACP (FoX, provable eviction)"),
    "dense-ft": ("black", "*", "dense fine-tuning control"),
    "dense": ("gray", "*", "pretrained (dense)"),
}


def method_of(pattern: str | None) -> str:
    """The table's name of a fixed pattern (``local:W`` is the ``window:W`` of the cache policies)."""
    if pattern is None:
        return "dense"
    return "window:" + pattern.split(":", 1)[1] if pattern.startswith("local:") else pattern


def decode_policy(method: str) -> str | None:
    """The cache policy that decodes a method exactly (passkey), None where there is none (strided)."""
    if method in ("dense", "dense-ft"):
        return "dense"
    if method.startswith("dcp:"):
        return "dcp"
    if method.startswith(("window:", "sinks:")):
        return method
    return None


def _passkey(results: str, label: str) -> dict | None:
    path = os.path.join(results, "table_passkey", label, "passkey.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _provenance(results: str, env: dict, stage: str) -> dict:
    """The fields every row carries: where and when it was measured, and by which stage."""
    return {"stage": stage, "device": env.get("device"), "jax": env.get("jax"), "date": date.today().isoformat(),
            "source": os.path.basename(os.path.normpath(results))}


def collect_rows(results: str, *, model: str, stage: str) -> list[dict]:
    """The rows of one results folder (module docstring)."""
    with open(os.path.join(results, "table", "dcp_eval.json")) as f:
        report = json.load(f)
    env = {}
    if os.path.isfile(os.path.join(results, "env.json")):
        with open(os.path.join(results, "env.json")) as f:
            env = json.load(f)
    context = report["config"]["seq_len"]
    entries = [("dense", False, report["dense"], {"step": report["dense"].get("info", {}).get("step")})]
    for run in report["dcp"]:
        g = run["info"].get("gamma")
        entries.append((f"dcp:g{g:g}" if g is not None else f"dcp:{run['label']}", True, run,
                        {"gamma": g, "steps": run["info"].get("steps")}))
    for run in report.get("controls", ()):
        pattern = run["info"]["pattern"]
        entries.append(("dense-ft" if pattern is None else method_of(pattern), True, run,
                        {"pattern": pattern, "step": run["info"].get("step")}))
    seen = set()
    for run in report["dcp"]:  # the untuned baselines at each DCP run's sparsity
        for kind, m in run["matched"].items():
            if m["pattern"] not in seen:
                seen.add(m["pattern"])
                entries.append((method_of(m["pattern"]), False, m,
                                {"pattern": m["pattern"], "nominal_sparsity": m["nominal_sparsity"],
                                 "matched_to": run["label"]}))
    control = next((r for r in report.get("controls", ()) if r["info"]["pattern"] is None), None)
    ref, ref_name = (control, "dense-ft") if control is not None else (report["dense"], "dense")
    rows = []
    for method, tuned, res, extra in entries:
        label = res.get("label")
        pk = _passkey(results, label) if label and (tuned or method == "dense") else None
        row = {"model": model, "method": method, "fine_tuned": tuned, "context": context,
               "sparsity": round(float(res["sparsity"]), 6), "ppl": round(float(res["ppl"]), 4),
               "val_loss": round(float(res["val_loss"]), 6),
               "ppl_ratio": round(float(res["ppl"]) / float(ref["ppl"]), 5), "ppl_ratio_to": ref_name,
               "passkey_acc": None if pk is None else round(float(pk["mean_accuracy"]), 4),
               "passkey_policy": None if pk is None else pk["policy"],
               "passkey_grid": None if pk is None else {"lengths": pk["lengths"], "depths": pk["depths"],
                                                        "n": pk["n"]},
               **{k: v for k, v in extra.items() if v is not None},
               "label": label, "tokens": report["config"]["tokens"], **_provenance(results, env, stage)}
        row["key"] = f"{model}|{stage}|{method}|{'ft' if tuned else 'untuned'}|{context}"
        rows.append(row)
    return rows


def collect_fox_rows(results: str, *, model: str, stage: str) -> list[dict]:
    """The rows of a FoX inference-plan folder (module docstring), from its ``summary.json``."""
    with open(os.path.join(results, "summary.json")) as f:
        summary = json.load(f)
    env = (summary.get("meta") or {}).get("env") or {}
    quality = [q for q in summary["quality"] if q.get("model") == "fox" and q.get("val_ppl") is not None]
    passkey = {p["policy"]: p for p in summary.get("passkey", []) if p.get("model") == "fox"}
    dense = {q["ctx"]: q for q in quality if q["policy"] == "dense"}
    rows = []
    for q in sorted(quality, key=lambda q: (q["ctx"], q["policy"])):
        ctx, method = int(q["ctx"]), q["policy"]
        ref = dense.get(q["ctx"])
        ratio = q.get("ppl_ratio") if method != "dense" else 1.0
        if ratio is None and ref is not None:
            ratio = q["val_ppl"] / ref["val_ppl"]
        pk = passkey.get(method) or {}
        acc = (pk.get("by_length") or {}).get(str(ctx))
        evicted = 0.0 if method == "dense" else q.get("evicted_fraction")
        row = {"model": model, "method": method, "fine_tuned": False, "context": ctx,
               "sparsity": None if evicted is None else round(float(evicted), 6),
               "sparsity_definition": "fraction of the context's keys evicted after its last token",
               "ppl": round(float(q["val_ppl"]), 4),
               "val_loss": None if q.get("val_loss") is None else round(float(q["val_loss"]), 6),
               "ppl_ratio": None if ratio is None else round(float(ratio), 7), "ppl_ratio_to": "dense",
               "passkey_acc": None if acc is None else round(float(acc), 4),
               "passkey_policy": method if acc is not None else None,
               "live_tokens": None if method == "dense" else q.get("live_tokens"),
               "provable": q.get("provable"), "num_docs": q.get("num_docs"), "tokens": q.get("tokens"),
               **_provenance(results, env, stage)}
        row["key"] = f"{model}|{stage}|{method}|untuned|{ctx}"
        rows.append(row)
    scored = {(r["method"], r["context"]) for r in rows}
    for method, pk in passkey.items():  # passkey lengths without an evaluation at that context: rows of their own
        for length, acc in sorted((pk.get("by_length") or {}).items(), key=lambda kv: int(kv[0])):
            if (method, int(length)) in scored or acc is None:
                continue
            row = {"model": model, "method": method, "fine_tuned": False, "context": int(length), "sparsity": None,
                   "ppl": None, "ppl_ratio": None, "ppl_ratio_to": "dense", "passkey_acc": round(float(acc), 4),
                   "passkey_policy": method, **_provenance(results, env, stage)}
            row["key"] = f"{model}|{stage}|{method}|passkey|{length}"
            rows.append(row)
    return rows


def merge_rows(path: str, rows: list[dict]) -> list[dict]:
    """``rows`` merged into the list in ``path`` (rows of the same ``key`` replaced); written back."""
    old = []
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f)
    keys = {r["key"] for r in rows}
    merged = [r for r in old if r.get("key") not in keys] + rows
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(merged, f, indent=1)
        f.write("\n")
    return merged


def _family(method: str) -> str:
    return method if method in ("dense", "dense-ft") else method.split(":")[0]


def _recency(rows: list[dict], field: str) -> dict:
    """Each value of ``field`` -> the index of its last row: ``merge_rows`` appends a stage's rows at the end, so a
    larger index is a stage (or model) merged more recently."""
    return {r[field]: i for i, r in enumerate(rows)}


LABEL_OFFSET = {"strided": (4, -9)}  # points; strided below the others: it often shares a window's sparsity and ratio


def _panels(rows: list[dict]) -> list[tuple]:
    """The figure's panels, (model, context, stage) in plotting order (``plot``); only rows with a perplexity
    ratio make one (passkey-only rows, a run of their own with no evaluation, are in the table and heatmaps)."""
    model_rank, stage_rank = _recency(rows, "model"), _recency(rows, "stage")
    return sorted({(r["model"], r["context"], r["stage"]) for r in rows if r.get("ppl_ratio") is not None},
                  key=lambda p: (-model_rank[p[0]], p[0], -stage_rank[p[2]], p[2], p[1]))


def plot(rows: list[dict], path: str) -> None:
    """Perplexity ratio against sparsity, one panel per (model, context, stage): every method; fine-tuned filled
    (the fixed patterns fine-tuned with their own pattern: filled, dashed line, "(fine-tuned)" in the legend),
    untuned (dense weights with the pattern) hollow. A stage is one experiment (its own pretrained model and
    fine-tuning budget), so points of two stages never share a panel or a line; rows without a perplexity
    (passkey only) get no panel. Panels: the most recently merged
    model first, then its stages newest first, then by context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(rows)
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.0 * ncols, 4.4 * nrows), squeeze=False, layout="constrained")
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (model, ctx, stage) in zip(axes.flat, panels):
        sel = [r for r in rows if (r["model"], r["context"], r["stage"]) == (model, ctx, stage)]
        any_tuned = any(r["fine_tuned"] for r in sel)
        for fam, (color, marker, legend) in FAMILIES.items():
            fixed = fam in ("window", "strided", "sinks")
            for tuned in (True, False):
                pts = sorted((100 * r["sparsity"], r["ppl_ratio"], r["method"]) for r in sel
                             if _family(r["method"]) == fam and r["fine_tuned"] == tuned
                             and r["sparsity"] is not None and r["ppl_ratio"] is not None)
                if not pts:
                    continue
                suffix = (" (fine-tuned)" if tuned and fixed else
                          " (not fine-tuned)" if any_tuned and not tuned and fam != "dense" else "")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, ms=9 if tuned else 7,
                        mfc=color if tuned else "none",
                        ls="-" if (tuned and fam == "dcp") else "--" if (tuned and fixed) else "none",
                        lw=1.2, label=legend + suffix)
                for x, y, m in pts:
                    if fam not in ("dense", "dense-ft"):
                        ax.annotate(m + (" ft" if tuned and fixed else ""), (x, y), textcoords="offset points",
                                    xytext=LABEL_OFFSET.get(fam, (4, 4)), fontsize=6,
                                    fontweight="bold" if tuned and fixed else "normal")
        ax.axhline(1.0, color="gray", ls=":", lw=1)
        pairs = any(r.get("sparsity_definition") is None for r in sel)  # GPT-2 rows: pair sparsity
        ax.set_xlabel("sparsity: % of causal (query, key) pairs dropped" if pairs
                      else "% of the context's keys evicted (at its last token)")
        ax.set_ylabel("perplexity / " + ("dense control" if any(r["ppl_ratio_to"] == "dense-ft" for r in sel)
                                         else "dense model" if any_tuned or pairs else "dense cache, same tokens"))
        ax.ticklabel_format(axis="y", useOffset=False)
        ax.set_xlim(-2, 102)
        ax.grid(alpha=0.3)
        ax.set_title(f"{model}, context {ctx} (stage {stage})", fontsize=10)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.savefig(path, dpi=120)


def table(rows: list[dict]) -> str:
    """Markdown: one line per row, grouped by model, context and stage (the most recently merged first, as the
    figure's panels), fine-tuned first, by sparsity. The "fine-tuned" column says "yes (own pattern)" for a fixed
    pattern fine-tuned with that pattern, "no" for the pretrained weights under it."""
    model_rank, stage_rank = _recency(rows, "model"), _recency(rows, "stage")
    out = ["| model | context | method | fine-tuned | sparsity % | ppl | ppl ratio | passkey % | stage |",
           "|---|---:|---|---|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (-model_rank[r["model"]], r["model"], r["context"], -stage_rank[r["stage"]],
                                         r["stage"], not r["fine_tuned"], r["sparsity"] or 0.0, r["method"])):
        pk = "–" if r["passkey_acc"] is None else f"{100 * r['passkey_acc']:.0f}"
        sp = "–" if r["sparsity"] is None else f"{100 * r['sparsity']:.1f}"
        ratio = "–" if r["ppl_ratio"] is None else (f"{r['ppl_ratio']:.3f}" if r["fine_tuned"] or r["model"].startswith(
            "gpt2") else f"{r['ppl_ratio']:.5f}")
        method = r["method"] + (" (heuristic)" if r.get("provable") is False else "")
        tuned = ("yes (own pattern)" if _family(r["method"]) in ("window", "strided", "sinks") else "yes") \
            if r["fine_tuned"] else "no"
        out.append(f"| {r['model']} | {r['context']} | {method} | {tuned} | "
                   f"{sp} | {'–' if r['ppl'] is None else format(r['ppl'], '.2f')} | {ratio} (to {r['ppl_ratio_to']}) | "
                   f"{pk} | {r['stage']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="?", help="a results folder of quality.sh: the table plan (table/dcp_eval.json) or "
                                               "a FoX inference plan (summary.json)")
    ap.add_argument("--model", default="gpt2-124M", help="the model name of the rows (default gpt2-124M)")
    ap.add_argument("--stage", default="table", help="the stage name of the rows (default table)")
    ap.add_argument("--rows", help="a rows file (JSON list) to merge into; without RESULTS, plot it")
    ap.add_argument("--out-dir", help="where quality.png and quality.md go (default: next to --rows or RESULTS)")
    args = ap.parse_args(argv)
    if not args.results and not args.rows:
        ap.error("give RESULTS, --rows, or both")
    rows = []
    if args.results and os.path.isfile(os.path.join(args.results, "table", "dcp_eval.json")):
        rows = collect_rows(args.results, model=args.model, stage=args.stage)
    elif args.results and os.path.isfile(os.path.join(args.results, "summary.json")):
        rows = collect_fox_rows(args.results, model=args.model, stage=args.stage)
    elif args.results:
        ap.error(f"RESULTS {args.results}: neither table/dcp_eval.json (the table plan) nor summary.json (the "
                 "inference plan, plot_inference.py)")
    if args.rows:
        rows = merge_rows(args.rows, rows) if rows or not os.path.isfile(args.rows) else json.load(open(args.rows))
    out_dir = args.out_dir or (os.path.dirname(os.path.abspath(args.rows)) if args.rows else args.results)
    os.makedirs(out_dir, exist_ok=True)
    plot(rows, os.path.join(out_dir, "quality.png"))
    md = table(rows)
    with open(os.path.join(out_dir, "quality.md"), "w") as f:
        f.write("# Quality of the pruning methods\n\n" + md + "\n")
    print(md)
    print(f"wrote {os.path.join(out_dir, 'quality.png')} and quality.md ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
