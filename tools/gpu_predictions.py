#!/usr/bin/env python3
"""Predicted vs measured: the CUDA kernels' expected speed, written down before any GPU ran
them (benchmarks/gpu/predictions.json, reasoned in docs/cuda_kernels.md, "Open predictions
for the first GPU run"), beside what `python -m fmha.bench --cuda` measured: its --out JSON,
or a results file that --save wrote (benchmarks/results/<gpu>.json: its "cuda" section, and
its "decode" section unless --decode names a file).

    python tools/gpu_predictions.py OUT/bench.json [--decode OUT/decode.json]
                                    [--predictions FILE] [--out OUT/predictions.md]
    python tools/gpu_predictions.py benchmarks/results/h200.json

Each prediction names the rows it covers and a range for one field of them. Attention rows
(bench.json): pass, dtypes, a regex on the case name, the implementation (impl: fmha, the
kernel fmha chooses -- on an H100/H200 the sm_90 forward; fmha_sm80, the sm_80 kernel forced,
from --peers sm80), and a field of its rows (ratio_vs_sdpa: SDPA flash's time over fmha's;
ratio_vs_cudnn: SDPA cuDNN's, from --peers cudnn). Decode rows (`"bench": "decode"`, from
`python -m fmha.bench --cuda --decode`'s JSON): entry (kvcache, kvcache-paged16,
kvcache-int8, ...), seqlen_q, dtypes, a regex on the case name, and a field
(fraction_of_bandwidth, speedup_vs_16bit_cache). The table gives the measured minimum and
maximum over those rows and a verdict: inside the range, below it, above it, or not measured
(no row, or every row failed). tools/gpu_check.sh runs it last.
Exit status 0 whatever the verdicts (a missed prediction is a finding, not a failure); 2 when
a file cannot be read.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PREDICTIONS = ROOT / "benchmarks" / "gpu" / "predictions.json"


def _covers(pr: dict, r: dict) -> bool:
    """Whether row r (an attention row, or a decode row for `"bench": "decode"`) is one of
    prediction pr's."""
    if r.get("dtype") not in pr.get("dtypes", ["float16", "bfloat16"]):
        return False
    if not re.search(pr.get("cases", ".*"), r.get("case", "")):
        return False
    if pr.get("bench", "attention") == "decode":
        return r.get("entry") == pr["entry"] and r.get("seqlen_q") == pr.get("seqlen_q", 1)
    return r.get("impl") == pr.get("impl", "fmha") and r.get("pass_") == pr["pass"]


def with_peer_ratios(rows: list[dict]) -> list[dict]:
    """Attention rows, each fmha row (any kernel) also given ratio_vs_cudnn: the time of SDPA's
    cuDNN backend (python -m fmha.bench --cuda --peers cudnn) over its own, on the same case,
    dtype and pass."""
    cudnn = {(r.get("case"), r.get("dtype"), r.get("pass_")): r.get("median_s")
             for r in rows if r.get("impl") == "torch_sdpa_cudnn"}
    out = []
    for r in rows:
        t = cudnn.get((r.get("case"), r.get("dtype"), r.get("pass_")))
        if str(r.get("impl", "")).startswith("fmha") and t and r.get("median_s"):
            r = dict(r, ratio_vs_cudnn=t / r["median_s"])
        out.append(r)
    return out


def verdicts(predictions: list[dict], rows: list[dict], decode_rows: list[dict] = ()
             ) -> list[dict]:
    """One result per prediction: its rows' measured range and where it falls."""
    out = []
    rows = with_peer_ratios(list(rows))
    for pr in predictions:
        field = pr.get("metric", "ratio_vs_sdpa")
        source = decode_rows if pr.get("bench", "attention") == "decode" else rows
        values = [r[field] for r in source if _covers(pr, r) and r.get(field) is not None]
        lo, hi = pr["low"], pr["high"]
        if not values:
            verdict = "not measured"
        elif max(values) < lo:
            verdict = "below"
        elif min(values) > hi:
            verdict = "above"
        elif lo <= min(values) and max(values) <= hi:
            verdict = "inside"
        else:
            verdict = "spans the range"
        out.append(dict(id=pr["id"], field=field, low=lo, high=hi, n=len(values),
                        measured_min=min(values) if values else None,
                        measured_max=max(values) if values else None, verdict=verdict,
                        why=pr.get("why", "")))
    return out


def table(results: list[dict]) -> str:
    lines = ["| prediction | field | predicted | measured (rows) | verdict |",
             "|---|---|---|---|---|"]
    for r in results:
        measured = ("—" if r["n"] == 0 else
                    f"{r['measured_min']:.2f}–{r['measured_max']:.2f} ({r['n']})")
        lines.append(f"| {r['id']} | {r['field']} | {r['low']:.2f}–{r['high']:.2f} | "
                     f"{measured} | {r['verdict']} |")
    return "\n".join(lines)


def _section(data: dict, mode: str) -> dict:
    """A mode's result: the file itself (an --out JSON), or its section of a results file."""
    return data["suites"][mode] if "suites" in data else data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", type=Path,
                    help="python -m fmha.bench --cuda's --out JSON, or a results file")
    ap.add_argument("--decode", type=Path, default=None,
                    help="python -m fmha.bench --cuda --decode's --out JSON (decode predictions "
                         "read as not measured without it)")
    ap.add_argument("--predictions", type=Path, default=DEFAULT_PREDICTIONS)
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    a = ap.parse_args(argv)
    try:
        predictions = json.loads(a.predictions.read_text())["predictions"]
        bench = json.loads(a.bench.read_text())
        rows = _section(bench, "cuda")["rows"]
        if a.decode:
            decode_rows = _section(json.loads(a.decode.read_text()), "decode")["rows"]
        else:
            decode_rows = bench.get("suites", {}).get("decode", {}).get("rows", [])
    except (OSError, ValueError, KeyError) as e:
        print(f"gpu_predictions: {e}", file=sys.stderr)
        return 2
    text = table(verdicts(predictions, rows, decode_rows))
    print(text)
    if a.out:
        measured = f"`{a.bench}`" + (f" and `{a.decode}`" if a.decode else "")
        a.out.write_text(f"Predicted (`{a.predictions.name}`) vs measured ({measured})\n\n"
                         f"{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
