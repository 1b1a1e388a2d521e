"""tools/gpu_predictions.py: the predictions in benchmarks/gpu/predictions.json name rows that
`python -m fmha.bench_cuda` really writes, and the verdicts beside measured rows are right."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_predictions as gp  # noqa: E402

from fmha import bench_cuda  # noqa: E402


def _row(case, pass_, ratio, dtype="float16", impl="fmha"):
    return dict(case=case, dtype=dtype, pass_=pass_, impl=impl, median_s=1.0, gflops=1.0,
                ratio_vs_sdpa=ratio)


def test_committed_predictions_name_real_rows():
    predictions = json.loads(gp.DEFAULT_PREDICTIONS.read_text())["predictions"]
    assert predictions
    cases = [c[0] for c in bench_cuda.GRID]
    for pr in predictions:
        assert pr["pass"] in ("fwd", "fwd+bwd"), pr
        assert 0 < pr["low"] < pr["high"], pr
        assert pr.get("metric", "ratio_vs_sdpa") == "ratio_vs_sdpa", pr
        assert any(re.search(pr["cases"], c) for c in cases), f"{pr['id']}: no bench case"
        assert pr["why"], pr


def test_verdicts():
    preds = [dict(id="a", **{"pass": "fwd"}, cases="d128", low=0.7, high=0.9, why="x")]
    rows = [_row("b4h16s4096d128", "fwd", 0.8), _row("b4h16s8192d128", "fwd", 0.85),
            _row("b4h16s4096d64", "fwd", 0.1),                       # another case
            _row("b4h16s4096d128", "fwd+bwd", 0.1),                  # another pass
            _row("b4h16s4096d128", "fwd", None, impl="torch_sdpa_flash")]
    (r,) = gp.verdicts(preds, rows)
    assert (r["n"], r["measured_min"], r["measured_max"], r["verdict"]) == (2, 0.8, 0.85, "inside")
    assert gp.verdicts(preds, [_row("b4h16s4096d128", "fwd", 0.5)])[0]["verdict"] == "below"
    assert gp.verdicts(preds, [_row("b4h16s4096d128", "fwd", 1.2)])[0]["verdict"] == "above"
    both = [_row("b4h16s4096d128", "fwd", 0.5), _row("b4h16s8192d128", "fwd", 0.8)]
    assert gp.verdicts(preds, both)[0]["verdict"] == "spans the range"
    failed = [_row("b4h16s4096d128", "fwd", None)]
    assert gp.verdicts(preds, failed)[0]["verdict"] == "not measured"


def test_main_writes_the_table(tmp_path, capsys):
    # One measured row inside the committed "fwd d128" range, whatever that range is now.
    (pr,) = [x for x in json.loads(gp.DEFAULT_PREDICTIONS.read_text())["predictions"]
             if x["id"] == "fwd d128"]
    mid = round((pr["low"] + pr["high"]) / 2, 2)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(dict(meta={}, rows=[_row("b4h16s4096d128", "fwd", mid)])))
    out = tmp_path / "predictions.md"
    assert gp.main([str(bench), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (f"| fwd d128 | ratio_vs_sdpa | {pr['low']:.2f}–{pr['high']:.2f} | "
            f"{mid:.2f}–{mid:.2f} (1) | inside |") in printed
    assert printed.strip() in out.read_text()
    assert gp.main([str(tmp_path / "missing.json")]) == 2


def test_gpu_check_runs_it():
    script = (ROOT / "tools" / "gpu_check.sh").read_text()
    assert 'tools/gpu_predictions.py' in script and '"$OUT/bench.json"' in script
