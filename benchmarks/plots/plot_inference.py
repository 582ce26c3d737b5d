"""Quality vs speed and memory of the cache policies: summary JSON, a plot and a markdown table.

Input: the results folder of ``benchmarks/quality.sh`` (``models.txt``, ``jobs.jsonl``, ``quality/*.log``,
``passkey/*/passkey.json``, ``bench/*.json``, ``runs/*/metrics.jsonl``, ``env.json``, ``stages.jsonl``) — it is
collected into ``summary.json`` first — or a ``summary.json`` written earlier.

Outputs (``--out-dir``, default next to the input):
  summary.json     meta (device, versions, settings, stage times), models (training summary), quality (ppl per
                   model / policy / context), passkey (accuracy per model / policy, per length), bench (every
                   bench_decode.py row, with its model), table (the joined rows below)
  summary.md       one row per (model, policy, context): ppl, passkey accuracy, tokens/s at equal batch and under
                   the KV budget (with the batch), decode tokens/s, KV allocated per row, live tokens per layer,
                   ratios vs the dense cache of the family's base model (same mode and prompt length)
  inference.png    per model family: decode tokens/s under the KV budget vs perplexity, and KV allocated per
                   sequence vs perplexity, one point per (model, policy[, context])

Speed of a policy does not depend on the weights except for dcp / acp (their live sets do), so a (model,
policy) without a bench row of its own borrows the row of the family's base model for that policy
(``speed_from`` names it).

Usage:
  python benchmarks/plots/plot_inference.py RESULTS_DIR [--out-dir DIR]
  python benchmarks/plots/plot_inference.py summary.json --out-dir DIR
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re

BASE = {"gpt2": "pre", "fox": "fox"}  # the base (dense-trained) model of each family
MiB = 2 ** 20


# Collecting the results folder ------------------------------------------------------------------------

def _jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    rows = []
    for line in open(path):
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def _json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _last_json_line(text: str, key: str) -> dict | None:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and key in line:
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def parse_eval_log(text: str) -> dict:
    """ppl of a ``fox-jax eval --cache POLICY`` log: its JSON line (``policy_ppl``, ``dense_ppl`` on the same
    tokens, overflow rows), else the plain ``val_loss`` / ``val_ppl`` summary line."""
    row = _last_json_line(text, "ppl")
    if row and row.get("policy_ppl") is not None:
        return {"val_loss": row.get("policy_loss"), "val_ppl": row["policy_ppl"], "dense_loss": row.get("dense_loss"),
                "dense_ppl": row.get("dense_ppl"), "ppl_ratio": row.get("ppl_ratio"), "num_docs": row.get("num_docs"),
                "tokens": row.get("policy_tokens"), "overflow_rows": row.get("policy_overflow_rows"),
                "live_tokens": row.get("policy_live_tokens"), "evicted_fraction": row.get("policy_evicted_fraction"),
                "provable": row.get("provable")}
    if row and row.get("val_ppl") is not None:
        return {"val_loss": row.get("val_loss"), "val_ppl": row["val_ppl"]}
    m_loss = re.findall(r"val_loss\s+([0-9.]+)", text)
    m_ppl = re.findall(r"val_ppl\s+([0-9.]+)", text)
    if m_ppl:
        return {"val_loss": float(m_loss[-1]) if m_loss else None, "val_ppl": float(m_ppl[-1])}
    return {}


def _family(name: str, families: dict) -> str:
    fam = families.get(name, "gpt2" if name != "fox" else "fox")
    return "fox" if fam.startswith("fox") else "gpt2"


def train_summary(run_dir: str) -> dict:
    rows = _jsonl(os.path.join(run_dir, "metrics.jsonl"))
    if not rows:
        return {}
    out = {"last_step": rows[-1].get("step"), "last_loss": rows[-1].get("loss")}
    for r in reversed(rows):
        if "val_ppl" in r:
            out.update(val_ppl=r["val_ppl"], val_loss=r.get("val_loss"), val_step=r.get("step"))
            if "val_sparsity" in r:
                out["val_sparsity"] = r["val_sparsity"]
            break
    for r in reversed(rows):
        if "sparsity" in r:
            out["train_sparsity"] = r["sparsity"]
            break
    rates = [r["tokens_per_sec"] for r in rows if "tokens_per_sec" in r][2:]
    if rates:
        out["median_tokens_per_sec"] = sorted(rates)[len(rates) // 2]
    return out


def collect(results: str) -> dict:
    """summary dict of a quality.sh (QUALITY=inference) results folder."""
    families, models = {}, {}
    if os.path.exists(os.path.join(results, "models.txt")):
        for line in open(os.path.join(results, "models.txt")):
            parts = line.split()
            if len(parts) >= 3:
                families[parts[0]] = parts[2]
    for d in sorted(glob.glob(os.path.join(results, "runs", "*"))):
        name = os.path.basename(d)
        cfg = _json(os.path.join(d, "config.json")) or {}
        models[name] = {"family": _family(name, families), "kind": families.get(name),
                        "model": cfg.get("model"), "train": train_summary(d),
                        "dcp": (cfg.get("dcp") or {}).get("gamma") if isinstance(cfg.get("dcp"), dict) else None}
    jobs = _jsonl(os.path.join(results, "jobs.jsonl"))
    quality, passkey, dense_rows = [], [], {}
    for j in jobs:
        log = os.path.join(results, j.get("log", ""))
        text = open(log, errors="replace").read() if os.path.isfile(log) else ""
        base = dict(model=j["model"], policy=j["policy"], rc=j["rc"], seconds=j.get("seconds"))
        if j["kind"] == "eval":
            parsed = parse_eval_log(text)
            dense_ppl, dense_loss = parsed.pop("dense_ppl", None), parsed.pop("dense_loss", None)
            row = dict(base, ctx=int(j["ctx"]), **parsed)
            row["status"] = "ok" if row.get("val_ppl") is not None else _status(j, text)
            quality.append(row)
            if dense_ppl is not None and row["policy"] != "dense":  # eval --cache scores dense on the same tokens
                dense_rows.setdefault((j["model"], int(j["ctx"])), dict(
                    model=j["model"], policy="dense", ctx=int(j["ctx"]), val_ppl=dense_ppl, val_loss=dense_loss,
                    num_docs=parsed.get("num_docs"), status="ok", companion_of=row["policy"]))
        elif j["kind"] == "passkey":
            summary = _last_json_line(text, '"passkey"') or {}
            report = _json(os.path.join(os.path.splitext(log)[0], "passkey.json")) or {}
            by_length = {}
            if report.get("accuracy") and report.get("lengths"):
                by_length = {str(n): sum(a) / len(a) for n, a in zip(report["lengths"], report["accuracy"]) if a}
            acc = summary.get("accuracy", report.get("mean_accuracy"))
            passkey.append(dict(base, lengths=j["ctx"], accuracy=acc, digit_accuracy=summary.get("digit_accuracy"),
                                by_length=by_length, overflow_rows=summary.get("overflow_rows"),
                                status="ok" if acc is not None else _status(j, text)))
    have = {(q["model"], q["policy"], q["ctx"]) for q in quality if q.get("val_ppl") is not None}
    quality += [d for (m, c), d in dense_rows.items() if (m, "dense", c) not in have]
    bench = []
    for path in sorted(glob.glob(os.path.join(results, "bench", "*.json"))):
        data = _json(path) or {}
        name = os.path.splitext(os.path.basename(path))[0]
        model = name.split("_budget")[0].split("_equal")[0]
        for r in data.get("rows", []):
            bench.append(dict(model=model, file=os.path.basename(path), **r))
        if data.get("meta") and "bench_meta" not in models.get(model, {}):
            models.setdefault(model, {"family": _family(model, families)})["bench_meta"] = {
                k: data["meta"].get(k) for k in ("device", "jax", "flax", "dtype", "new_tokens", "equal_batch",
                                                  "kv_budget_gib", "max_batch", "repeats")}
    meta = {"env": _json(os.path.join(results, "env.json")), "stages": _jsonl(os.path.join(results, "stages.jsonl"))}
    settings = os.path.join(results, "settings.env")
    if os.path.exists(settings):
        meta["settings"] = open(settings).read()
    return {"meta": meta, "models": models, "quality": quality, "passkey": passkey, "bench": bench}


def _status(job: dict, text: str) -> str:
    if job.get("rc") == 124 or job.get("rc") == 137:
        return "timeout"
    if job.get("rc") == 125:
        return "skipped"
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return ("error: " + lines[-1][:200]) if lines else f"rc {job.get('rc')}"


# Joining ------------------------------------------------------------------------------------------

def _bench_row(bench: list[dict], model: str, policy: str, mode: str, ctx: int) -> dict | None:
    """The bench row of (model, policy, mode) at the longest prompt ≤ ctx (else the shortest)."""
    rows = [r for r in bench if r["model"] == model and r.get("policy") == policy and r.get("mode") == mode
            and "error" not in r]
    if not rows:
        return None
    under = [r for r in rows if r["prompt_len"] <= ctx]
    return max(under, key=lambda r: r["prompt_len"]) if under else min(rows, key=lambda r: r["prompt_len"])


def _row_bytes(r: dict | None) -> float | None:
    """Allocated KV bytes of one sequence in a bench row."""
    if not r:
        return None
    if r.get("kv_row_bytes"):
        return r["kv_row_bytes"]
    return r["kv_allocated_bytes"] / r["batch"] if r.get("kv_allocated_bytes") and r.get("batch") else None


def join(summary: dict) -> list[dict]:
    """One row per quality measurement, with passkey accuracy and the matching bench rows."""
    models, bench = summary["models"], summary["bench"]
    pk = {(p["model"], p["policy"]): p for p in summary["passkey"]}
    table, seen = [], set()
    quality = list(summary["quality"])
    dense_ppl = {(q["model"], q.get("ctx")): q["val_ppl"] for q in quality
                 if q["policy"] == "dense" and q.get("val_ppl") is not None}
    for p in summary["passkey"]:  # a (model, policy) with a passkey result but no ppl still gets a row
        if not any(q["model"] == p["model"] and q["policy"] == p["policy"] for q in quality):
            quality.append(dict(model=p["model"], policy=p["policy"], ctx=None, status="no eval"))
    for q in quality:
        key = (q["model"], q["policy"], q.get("ctx"))
        if key in seen:
            continue
        seen.add(key)
        fam = models.get(q["model"], {}).get("family") or ("fox" if q["model"] == "fox" else "gpt2")
        base = BASE[fam]
        ctx = q.get("ctx") or 10 ** 9
        row = dict(model=q["model"], family=fam, policy=q["policy"], ctx=q.get("ctx"), val_ppl=q.get("val_ppl"),
                   quality_status=q.get("status"), ppl_x_dense=q.get("ppl_ratio"))
        if row["ppl_x_dense"] is None and row["val_ppl"] is not None:
            dense = dense_ppl.get((q["model"], q.get("ctx")))
            row["ppl_x_dense"] = row["val_ppl"] / dense if dense else None
        p = pk.get((q["model"], q["policy"]))
        if p:
            row.update(passkey=p.get("accuracy"), passkey_by_length=p.get("by_length"))
        speed_from = q["model"]
        eq = _bench_row(bench, q["model"], q["policy"], "equal-batch", ctx)
        bud = _bench_row(bench, q["model"], q["policy"], "kv-budget", ctx)
        if eq is None and bud is None and q["policy"] not in ("dcp", "acp"):
            eq = _bench_row(bench, base, q["policy"], "equal-batch", ctx)
            bud = _bench_row(bench, base, q["policy"], "kv-budget", ctx)
            speed_from = base
        if eq is None and bud is None:
            speed_from = None
        row["speed_from"] = speed_from
        for tag, r in (("eq", eq), ("budget", bud)):
            if r is None:
                continue
            row.update({f"{tag}_tokens_per_sec": r.get("tokens_per_sec"),
                        f"{tag}_decode_tokens_per_sec": r.get("decode_tokens_per_sec"), f"{tag}_batch": r.get("batch"),
                        f"{tag}_prompt": r.get("prompt_len"), f"{tag}_overflow": r.get("overflow")})
            dense = _bench_row(bench, r["model"], "dense", r["mode"], ctx) or _bench_row(bench, base, "dense", r["mode"], ctx)
            if dense and dense.get("prompt_len") == r.get("prompt_len"):
                row[f"{tag}_x_dense"] = r["tokens_per_sec"] / dense["tokens_per_sec"] if dense.get("tokens_per_sec") else None
                if r.get("decode_tokens_per_sec") and dense.get("decode_tokens_per_sec"):
                    row[f"{tag}_decode_x_dense"] = r["decode_tokens_per_sec"] / dense["decode_tokens_per_sec"]
                if _row_bytes(r) and _row_bytes(dense):
                    row["kv_less_x"] = _row_bytes(dense) / _row_bytes(r)
        r = bud or eq
        if r is not None:
            row.update(kv_row_bytes=_row_bytes(r), live_tokens=r.get("live_tokens_final"),
                       sparsity=r.get("sparsity_final"), kv_allocated_bytes=r.get("kv_allocated_bytes"),
                       kv_live_bytes=r.get("kv_live_bytes"))
        table.append(row)
    table.sort(key=lambda r: (r["family"], r["model"] != BASE[r["family"]], r["model"], r["ctx"] or 0,
                              r["policy"] != "dense", r["policy"]))
    return table


# Output -------------------------------------------------------------------------------------------

def _fmt(x, spec="{:,.0f}"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return spec.format(x)


def markdown(summary: dict) -> str:
    env = (summary.get("meta") or {}).get("env") or {}
    lines = ["# Pruned inference: quality vs speed and memory", "",
             f"device {env.get('device', '?')}, jax {env.get('jax', '?')}, flax {env.get('flax', '?')}", ""]
    stages = (summary.get("meta") or {}).get("stages") or []
    if stages:
        lines.append("stages: " + ", ".join(f"{s['stage']} {s['end_s'] - s['start_s']}s (rc {s['rc']})" for s in stages))
        lines.append("")
    models = summary.get("models") or {}
    if models:
        lines += ["| model | family | last logged step | val ppl (training) | DCP sparsity (training eval) |", "|---|---|---|---|---|"]
        for name, m in models.items():
            t = m.get("train") or {}
            lines.append(f"| {name} | {m.get('family')} | {_fmt(t.get('last_step'))} | {_fmt(t.get('val_ppl'), '{:.2f}')} "
                         f"| {_fmt(t.get('val_sparsity'), '{:.1%}')} |")
        lines.append("")
    lines += ["| model | policy | ctx | ppl | ppl ×dense | passkey | tok/s equal (B) | tok/s budget (B) | decode tok/s budget "
              "| KV/row MiB | live tok/layer | sparsity | ×dense tok/s (budget) | ×less KV/row | overflow | speed from |",
              "|" + "---|" * 16]
    for r in summary["table"]:
        eq = f"{_fmt(r.get('eq_tokens_per_sec'))} ({_fmt(r.get('eq_batch'))})" if r.get("eq_tokens_per_sec") else "–"
        bud = (f"{_fmt(r.get('budget_tokens_per_sec'))} ({_fmt(r.get('budget_batch'))})"
               if r.get("budget_tokens_per_sec") else "–")
        ppl = _fmt(r.get("val_ppl"), "{:.2f}") if r.get("val_ppl") is not None else (r.get("quality_status") or "–")[:40]
        overflow = max(r.get("eq_overflow") or 0, r.get("budget_overflow") or 0) if (
            "eq_overflow" in r or "budget_overflow" in r) else None
        lines.append(f"| {r['model']} | {r['policy']} | {_fmt(r.get('ctx'))} | {ppl} | {_fmt(r.get('ppl_x_dense'), '{:.3f}')} "
                     f"| {_fmt(r.get('passkey'), '{:.0%}')} "
                     f"| {eq} | {bud} | {_fmt(r.get('budget_decode_tokens_per_sec'))} "
                     f"| {_fmt(r['kv_row_bytes'] / MiB if r.get('kv_row_bytes') else None, '{:,.2f}')} "
                     f"| {_fmt(r.get('live_tokens'), '{:,.1f}')} | {_fmt(r.get('sparsity'), '{:.0%}')} "
                     f"| {_fmt(r.get('budget_x_dense'), '{:.2f}')} | {_fmt(r.get('kv_less_x'), '{:.2f}')} "
                     f"| {_fmt(overflow)} | {r.get('speed_from') or '–'} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: str) -> str | None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = [f for f in ("gpt2", "fox") if any(r["family"] == f and r.get("val_ppl") for r in summary["table"])]
    if not families:
        return None
    fig, axes = plt.subplots(len(families), 2, figsize=(12, 4.6 * len(families)), squeeze=False)
    for i, fam in enumerate(families):
        rows = [r for r in summary["table"] if r["family"] == fam and r.get("val_ppl")]
        models = sorted({r["model"] for r in rows})
        colors = {m: plt.cm.tab10(k % 10) for k, m in enumerate(models)}
        for j, (key, label) in enumerate((("speed", "decode tokens/s under the KV budget"),
                                          ("kv", "KV allocated per sequence (MiB)"))):
            ax = axes[i][j]
            for r in rows:
                if key == "speed":
                    y = r.get("budget_decode_tokens_per_sec") or r.get("budget_tokens_per_sec") or r.get("eq_tokens_per_sec")
                else:
                    y = r["kv_row_bytes"] / MiB if r.get("kv_row_bytes") else None
                if not y:
                    continue
                marker = "o" if r.get("speed_from") == r["model"] else "s"
                ax.scatter(r["val_ppl"], y, color=colors[r["model"]], marker=marker, s=40)
                tag = r["policy"] + (f"@{r['ctx']}" if fam == "fox" and r.get("ctx") else "")
                ax.annotate(f"{r['model']}/{tag}", (r["val_ppl"], y), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
            ax.set_xlabel("perplexity under the policy (lower is better)")
            ax.set_ylabel(label)
            ax.set_title(f"{fam}: {label.split(' (')[0]} vs quality")
            if key == "kv":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        handles = [plt.Line2D([], [], color=colors[m], marker="o", ls="", label=m) for m in models]
        axes[i][0].legend(handles=handles, fontsize=8, title="model (■: speed of the base model)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("input", help="results folder of quality.sh, or a summary.json")
    p.add_argument("--out-dir", help="where summary.json / summary.md / inference.png go (default: next to the input)")
    args = p.parse_args(argv)
    if os.path.isdir(args.input):
        summary, out_dir = collect(args.input), args.out_dir or args.input
    else:
        summary, out_dir = _json(args.input), args.out_dir or os.path.dirname(os.path.abspath(args.input))
        if summary is None:
            raise SystemExit(f"{args.input}: not a readable JSON file")
    os.makedirs(out_dir, exist_ok=True)
    summary["table"] = join(summary)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    md = markdown(summary)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(md)
    png = plot(summary, os.path.join(out_dir, "inference.png"))
    print(md)
    print(f"wrote {out_dir}/summary.json, summary.md" + (f", {os.path.basename(png)}" if png else " (no plot: no ppl)"))
    return summary


if __name__ == "__main__":
    main()
