"""Attention and training speed tables (attention_<gpu>.json, train_<gpu>.json, speed_<gpu>.md) from benchmark JSON.

The inputs are what bench_attention.py, bench_dcp.py and bench_train.py write (issue 22's deliverable 4).

Attention rows (one per shape, from ``bench_attention.py`` and ``bench_dcp.py`` output of one call):
  B, T, H, D            the shape (bf16, causal, fwd+bwd)
  fox_ms                ours as ``implementation="auto"`` runs it on that GPU (Mosaic on Hopper, else Pallas/Triton)
  fox_impl              which of the two it was
  fox_seg_ms            the same with (all-ones) segment ids, as a training step calls it (None if not timed)
  cudnn_ms              cuDNN's plain causal attention (no gates: the yardstick)
  fox_acp_ms            ours with ``adaptive_threshold="auto"`` (the benchmark's synthetic gates)
  official_ms, official_acp_ms   the official FoX Triton kernel, dense and ACP auto, in the same call
  dcp_ms                {"0.5": ms, "0.9": ms}: ``dcp_attention`` (the Pallas DCP kernels) at that fraction of the
                        causal pairs dropped (``bench_dcp.py``; the achieved sparsity in ``dcp_sparsity``)
  ratios                fox / cuDNN, fox_acp / official_acp, dcp / fox (the issue's targets: ≤ 1.1, ≤ 0.5, ≤ 1);
                        dcp_over_dense_pallas: dcp over dense Pallas (Triton) attention, the kernels the DCP path
                        runs on, timed in bench_dcp.py's process (its ``ratio_vs_dense``)
Train rows (``bench_train.py``): arch, size, seq_len, acp (``adaptive_threshold="auto"``: "auto" in the tables),
mfu, tokens_per_s, step_ms, compile_s, and batch, params_from, acp_fraction_skipped, device, date. Times are
milliseconds; a missing measurement is None, never 0.

    python benchmarks/plots/speed_tables.py --attention OUT/attention.json --dcp OUT/dcp.json \\
        --train OUT/train.json --out-dir benchmarks/results/speed [--merge]

``--merge`` keeps the rows already in the output files that this call did not measure (same shape, or same
arch/size/seq_len/acp/params_from), so that a table can grow over several device calls. Prints both tables in
markdown (README / docs/results.md) and writes them next to the JSON as ``speed_<gpu>.md``; ``<gpu>`` is the
device the inputs name (``h100``, ``h200``): inputs from two devices are refused. Times are milliseconds.
A train input may also be one of this tool's own merged files (rows keep their ``tree``, ``call`` and ``date``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys


def _device_tag(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200', else a lower-case slug."""
    m = re.search(r"\b([A-Z]\d{2,3})\b", name or "")
    return m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "_", (name or "unknown").lower()).strip("_")


def _ms(impls: dict, name: str, mode: str = "fwd_bwd"):
    v = (impls.get(name) or {}).get(mode)
    return None if v is None else float(v)


def _ratio(a, b):
    return None if a is None or not b else a / b


def attention_rows(attention: dict, dcp: dict | None, date: str) -> list[dict]:
    """One row per shape of a ``bench_attention.py`` JSON, with the ``bench_dcp.py`` rows of the same shape."""
    device = attention["versions"].get("device")
    dcp_by_shape: dict[tuple, dict] = {}
    for r in (dcp or {}).get("rows", []):
        s = r["shape"]
        dcp_by_shape.setdefault((s["B"], s["T"], s["H"], s["D"]), {})[f"{r['target_sparsity']:g}"] = r
    rows = []
    for r in attention["results"]:
        s, impls = r["shape"], r["impls"]
        fox_impl = "mosaic" if _ms(impls, "mosaic") is not None else "pallas"
        fox = _ms(impls, fox_impl)
        acp = _ms(impls, f"{fox_impl}-acp")
        official_acp = _ms(impls, "fox-triton-acp")
        cudnn = _ms(impls, "cudnn")
        dcp_rows = dcp_by_shape.get((s["B"], s["T"], s["H"], s["D"]), {})
        dcp_ms = {k: d["ms"].get("pallas|fwd_bwd") for k, d in sorted(dcp_rows.items())}
        rows.append({
            "B": s["B"], "T": s["T"], "H": s["H"], "D": s["D"],
            "fox_ms": fox, "fox_impl": fox_impl, "fox_seg_ms": _ms(impls, f"{fox_impl}-seg"),
            "cudnn_ms": cudnn, "fox_acp_ms": acp,
            "official_ms": _ms(impls, "fox-triton"), "official_acp_ms": official_acp,
            "dcp_ms": dcp_ms or None,
            "dcp_sparsity": {k: d["sparsity"] for k, d in sorted(dcp_rows.items())} or None,
            "fox_over_cudnn": _ratio(fox, cudnn), "acp_over_official_acp": _ratio(acp, official_acp),
            "dcp_over_fox": {k: _ratio(v, fox) for k, v in dcp_ms.items()} or None,
            "dcp_over_dense_pallas": {k: d.get("ratio_vs_dense", {}).get("pallas|fwd_bwd")
                                      for k, d in sorted(dcp_rows.items())} or None,
            "acp_fraction_skipped": r.get("acp_fraction_skipped"),
            "device": device, "jax": attention["versions"].get("jax"), "date": date,
        })
    return rows


TRAIN_KEYS = ("arch", "size", "seq_len", "acp", "mfu", "tokens_per_s", "step_ms", "compile_s", "batch",
              "params_from", "acp_fraction_skipped", "scan_layers", "remat", "tree", "call")


def train_rows(train: dict, date: str) -> list[dict]:
    """The issue's keys of a ``bench_train.py`` JSON's rows (rows with an error are left out)."""
    device = train["meta"].get("device")
    rows = []
    for r in train["rows"]:
        if r.get("step_ms") is None:
            continue
        row = {k: r.get(k) for k in TRAIN_KEYS if k not in ("tree", "call") or k in r}  # tree, call: merged files
        row["tokens_per_s"] = r.get("tokens_per_sec", r.get("tokens_per_s"))  # bench_train.py's name, or ours
        rows.append({**row, "device": r.get("device", device), "jax": train["meta"].get("jax"),
                     "date": r.get("date", date)})
    return rows


_EXPECTED = {"--attention": ("versions", "results", "bench_attention.py"),
             "--dcp": ("versions", "rows", "bench_dcp.py"),
             "--train": ("meta", "rows", "bench_train.py")}


def _load(path: str, expected) -> tuple[dict | None, str | None]:
    """(document, None) or (None, a one-line reason): a JSON object with the keys its benchmark writes."""
    head, body, script = expected
    if not os.path.exists(path):
        return None, "no such file"
    if not os.path.isfile(path):
        return None, "not a file"
    try:
        with open(path) as f:
            doc = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, f"not a JSON document ({e.__class__.__name__}: {str(e).splitlines()[0]})"
    if not isinstance(doc, dict) or head not in doc or body not in doc:
        return None, f"not {script} output (expected a JSON object with {head!r} and {body!r})"
    return doc, None


def _merge(path: str, new: list[dict], key) -> list[dict]:
    if not os.path.exists(path):
        return new
    with open(path) as f:
        old = json.load(f)
    fresh = {key(r) for r in new}
    return [r for r in old if key(r) not in fresh] + new


def _shape_key(r):
    return (r["B"], r["T"], r["H"], r["D"])


def _train_key(r):
    return (r["arch"], r["size"], r["seq_len"], bool(r["acp"]), r.get("params_from") not in (None, "init"),
            r.get("tree"), r.get("call"))


def _f(x, spec=".3f"):
    return "–" if x is None else format(x, spec)


def _provenance(rows: list[dict]) -> str:
    """The device, jax version and date of a table's rows ("device; jax v; date", each distinct value once)."""
    def values(key):
        return ", ".join(sorted({str(r.get(key)) for r in rows if r.get(key)})) or "–"
    return f"{values('device')}; jax {values('jax')}; {values('date')}"


def markdown(att: list[dict], train: list[dict]) -> str:
    lines = []
    if att:
        lines += [f"Attention fwd+bwd, ms (bf16, causal; {_provenance(att)}). fox_jax: `implementation=\"auto\"`; "
                  "ACP: `adaptive_threshold=\"auto\"`; DCP: the Pallas DCP kernels at 50 / 90% of causal pairs dropped.",
                  "",
                  "| B T H D | cuDNN | fox_jax | / cuDNN | fox_jax + seg ids | fox_jax ACP | official | official ACP "
                  "| ACP / official ACP | DCP 50% | DCP 90% |", "|---" * 11 + "|"]
        for r in sorted(att, key=_shape_key):
            d = r.get("dcp_ms") or {}
            lines.append(f"| B{r['B']} T{r['T']} H{r['H']} D{r['D']} | {_f(r['cudnn_ms'])} | {_f(r['fox_ms'])} "
                         f"| {_f(r['fox_over_cudnn'], '.2f')} | {_f(r['fox_seg_ms'])} | {_f(r['fox_acp_ms'])} "
                         f"| {_f(r['official_ms'])} | {_f(r['official_acp_ms'])} "
                         f"| {_f(r['acp_over_official_acp'], '.2f')} | {_f(d.get('0.5'))} | {_f(d.get('0.9'))} |")
        lines.append("")
    if train:
        trees = any(r.get("tree") or r.get("call") for r in train)
        lines += [f"Training step (`bench_train.py`, synthetic tokens; {_provenance(train)}); MFU of the dense-equivalent "
                  "FLOPs; gates: fresh (init) or a trained run's (`--params-from`).", "",
                  "| arch | size | ctx | ACP | gates | step ms | tokens/s | MFU | compile s |"
                  + (" tree | call |" if trees else ""), "|---" * (11 if trees else 9) + "|"]
        for r in sorted(train, key=lambda r: (r["arch"], r["size"], r["seq_len"], bool(r["acp"]), str(r.get("call")))):
            gates = "init" if r.get("params_from") in (None, "init") else "trained"
            extra = f" {r.get('tree') or '–'} | {r.get('call') or '–'} |" if trees else ""
            lines.append(f"| {r['arch']} | {r['size']} | {r['seq_len']} | {'auto' if r['acp'] else 'off'} | {gates} "
                         f"| {_f(r['step_ms'], '.1f')} | {_f(r['tokens_per_s'], ',.0f')} "
                         f"| {_f(None if r['mfu'] is None else 100 * r['mfu'], '.1f')}% | {_f(r['compile_s'], '.1f')} |"
                         + extra)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attention", help="bench_attention.py JSON")
    ap.add_argument("--dcp", help="bench_dcp.py JSON of the same call (the dcp_ms columns)")
    ap.add_argument("--train", nargs="+", default=[], help="bench_train.py JSON files (one or more)")
    ap.add_argument("--out-dir", required=True,
                    help="folder of attention_<gpu>.json, train_<gpu>.json and speed_<gpu>.md (made if missing)")
    ap.add_argument("--merge", action="store_true", help="keep the rows of the output files this call did not measure")
    ap.add_argument("--date", default=datetime.date.today().isoformat(),
                    help="the measurement date written into rows that carry none (default: today)")
    args = ap.parse_args(argv)
    loaded = {}
    for flag, path in [("--attention", args.attention), ("--dcp", args.dcp)] + [("--train", p) for p in args.train]:
        if path is None:
            continue
        doc, problem = _load(path, _EXPECTED[flag])
        if problem:
            print(f"{flag}: {path}: {problem}", file=sys.stderr)
            return 2
        loaded.setdefault(flag, []).append(doc)
    if not loaded.get("--attention") and not loaded.get("--train"):
        print("--attention or --train: give at least one benchmark JSON", file=sys.stderr)
        return 2
    if loaded.get("--dcp") and not loaded.get("--attention"):
        print("--dcp: its rows join the --attention rows of the same call; give --attention too", file=sys.stderr)
        return 2
    devices = {d["versions"].get("device") for k in ("--attention", "--dcp") for d in loaded.get(k, [])}
    devices |= {r.get("device", d["meta"].get("device")) for d in loaded.get("--train", []) for r in d["rows"]}
    if len({_device_tag(x) for x in devices}) > 1:
        names = ", ".join(sorted(map(str, devices)))
        print(f"--attention/--dcp/--train: the inputs come from different devices ({names}); make one table per device",
              file=sys.stderr)
        return 2
    att = attention_rows(loaded["--attention"][0], (loaded.get("--dcp") or [None])[0], args.date) \
        if loaded.get("--attention") else []
    train = [r for t in loaded.get("--train", []) for r in train_rows(t, args.date)]
    os.makedirs(args.out_dir, exist_ok=True)
    device = (att or train)[0]["device"]
    tag = _device_tag(device)
    tables = {}
    for name, rows, key in (("attention", att, _shape_key), ("train", train, _train_key)):
        path = os.path.join(args.out_dir, f"{name}_{tag}.json")
        if args.merge:
            rows = _merge(path, rows, key)
        tables[name] = rows
        if rows and (att if name == "attention" else train):
            with open(path, "w") as f:
                json.dump(rows, f, indent=1)
            print(f"wrote {path} ({len(rows)} rows)")
    table = markdown(tables["attention"], tables["train"])
    with open(os.path.join(args.out_dir, f"speed_{tag}.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
