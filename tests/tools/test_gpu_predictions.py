"""tools/gpu_predictions.py: the predictions in benchmarks/gpu/predictions.json name rows that
`python -m fmha.bench --cuda` really writes, and the verdicts beside measured rows are right."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_predictions as gp  # noqa: E402

from fmha.bench import cuda as bench_cuda  # noqa: E402
from fmha.bench import decode as bench_decode  # noqa: E402


def _row(case, pass_, ratio, dtype="float16", impl="fmha"):
    return dict(case=case, dtype=dtype, pass_=pass_, impl=impl, median_s=1.0, gflops=1.0,
                ratio_vs_sdpa=ratio)


def _decode_row(case, entry, value, metric="fraction_of_bandwidth", seqlen_q=1,
                dtype="float16"):
    return dict(case=case, dtype=dtype, entry=entry, seqlen_q=seqlen_q, ms=1.0,
                **{metric: value})


def test_committed_predictions_name_real_rows():
    predictions = json.loads(gp.DEFAULT_PREDICTIONS.read_text())["predictions"]
    assert predictions
    cases = [c[0] for c in bench_cuda.GRID]
    decode_cases = [c[0] for c in bench_decode.DECODE_CASES]
    decode_entries = {*bench_decode.ENTRIES, *bench_decode.KV8_ENTRIES.values()}
    assert any(pr.get("bench") == "decode" for pr in predictions)
    for pr in predictions:
        assert 0 < pr["low"] < pr["high"], pr
        assert pr["why"], pr
        if pr.get("bench", "attention") == "decode":
            assert pr["entry"] in decode_entries, pr
            assert pr["seqlen_q"] in bench_decode.SEQLEN_Q, pr
            assert pr["metric"] in ("fraction_of_bandwidth", "speedup_vs_16bit_cache"), pr
            assert (pr["metric"] == "speedup_vs_16bit_cache") == (
                pr["entry"] in bench_decode.KV8_ENTRIES.values()), pr
            assert any(re.search(pr["cases"], c) for c in decode_cases), f"{pr['id']}: no case"
            continue
        assert pr["pass"] in ("fwd", "fwd+bwd"), pr
        assert pr.get("metric", "ratio_vs_sdpa") in ("ratio_vs_sdpa", "ratio_vs_cudnn"), pr
        assert pr.get("impl", "fmha") in ("fmha", *("fmha_" + p for p in bench_cuda.PEERS)), pr
        assert any(re.search(pr["cases"], c) for c in cases), f"{pr['id']}: no bench case"


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


def test_impl_and_cudnn_ratio():
    # a prediction covers its implementation's rows only; ratio_vs_cudnn comes from the cuDNN
    # row of the same case, dtype and pass (SDPA cuDNN's time over fmha's)
    preds = [dict(id="a", impl="fmha", **{"pass": "fwd"}, cases="d128", metric="ratio_vs_cudnn",
                  low=0.7, high=0.9, why="x"),
             dict(id="b", impl="fmha_sm80", **{"pass": "fwd"}, cases="d128", low=0.7, high=0.9,
                  why="x")]
    rows = [dict(_row("b4h16s4096d128", "fwd", 1.5), median_s=1.0),
            dict(_row("b4h16s4096d128", "fwd", 0.8, impl="fmha_sm80"), median_s=2.0),
            dict(_row("b4h16s4096d128", "fwd", None, impl="torch_sdpa_cudnn"), median_s=0.8)]
    a, b = gp.verdicts(preds, rows)
    assert (a["n"], a["measured_min"], a["verdict"]) == (1, 0.8, "inside")
    assert (b["n"], b["measured_min"], b["verdict"]) == (1, 0.8, "inside")


def test_decode_verdicts():
    preds = [dict(id="d", bench="decode", entry="kvcache", seqlen_q=1, cases="hkv8",
                  metric="fraction_of_bandwidth", low=0.6, high=0.9, why="x")]
    rows = [_decode_row("b8-hq32-hkv8-sk4096", "kvcache", 0.7),
            _decode_row("b32-hq32-hkv8-sk1024", "kvcache", 0.8),
            _decode_row("b8-hq32-hkv8-sk4096", "kvcache-paged16", 0.1),   # another entry
            _decode_row("b8-hq32-hkv8-sk4096", "kvcache", 0.1, seqlen_q=4),  # another seqlen_q
            _decode_row("b1-hq8-hkv1-sk65536", "kvcache", 0.1)]          # another case
    (r,) = gp.verdicts(preds, [], rows)
    assert (r["n"], r["measured_min"], r["measured_max"], r["verdict"]) == (2, 0.7, 0.8, "inside")
    # attention rows never stand for decode ones, nor decode rows for attention predictions
    assert gp.verdicts(preds, rows)[0]["verdict"] == "not measured"
    attn = [dict(id="a", **{"pass": "fwd"}, cases=".*", low=0.7, high=0.9, why="x")]
    assert gp.verdicts(attn, [], rows)[0]["verdict"] == "not measured"


def test_main_writes_the_table(tmp_path, capsys):
    # One measured row inside the committed "fwd d128" range, whatever that range is now.
    (pr,) = [x for x in json.loads(gp.DEFAULT_PREDICTIONS.read_text())["predictions"]
             if x["id"] == "fwd d128"]
    mid = round((pr["low"] + pr["high"]) / 2, 2)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(dict(meta={}, rows=[_row("b4h16s4096d128", "fwd", mid,
                                                         impl=pr.get("impl", "fmha"))])))
    out = tmp_path / "predictions.md"
    assert gp.main([str(bench), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (f"| fwd d128 | ratio_vs_sdpa | {pr['low']:.2f}–{pr['high']:.2f} | "
            f"{mid:.2f}–{mid:.2f} (1) | inside |") in printed
    assert printed.strip() in out.read_text()
    assert gp.main([str(tmp_path / "missing.json")]) == 2
    # with the decode rows: a committed decode prediction is measured too
    (dp,) = [x for x in json.loads(gp.DEFAULT_PREDICTIONS.read_text())["predictions"]
             if x["id"] == "decode group 4"]
    dmid = round((dp["low"] + dp["high"]) / 2, 2)
    decode = tmp_path / "decode.json"
    decode.write_text(json.dumps(dict(meta={}, rows=[
        _decode_row("b8-hq32-hkv8-sk4096", dp["entry"], dmid)])))
    assert gp.main([str(bench), "--decode", str(decode), "--out", str(out)]) == 0
    assert (f"| decode group 4 | fraction_of_bandwidth | {dp['low']:.2f}–{dp['high']:.2f} | "
            f"{dmid:.2f}–{dmid:.2f} (1) | inside |") in capsys.readouterr().out


def test_main_reads_a_results_file(tmp_path, capsys):
    """A results file (python -m fmha.bench --cuda --save): the rows of its "cuda" section, and
    of its "decode" section where --decode names no file."""
    preds = json.loads(gp.DEFAULT_PREDICTIONS.read_text())["predictions"]
    (pr,) = [x for x in preds if x["id"] == "fwd d128"]
    (dp,) = [x for x in preds if x["id"] == "decode group 4"]
    mid = round((pr["low"] + pr["high"]) / 2, 2)
    dmid = round((dp["low"] + dp["high"]) / 2, 2)
    results = tmp_path / "h200.json"
    results.write_text(json.dumps(dict(host_class="h200", host={}, suites=dict(
        cuda=dict(meta={}, rows=[_row("b4h16s4096d128", "fwd", mid, impl=pr.get("impl", "fmha"))]),
        decode=dict(meta={}, rows=[_decode_row("b8-hq32-hkv8-sk4096", dp["entry"], dmid)])))))
    assert gp.main([str(results)]) == 0
    printed = capsys.readouterr().out
    assert f"| fwd d128 | ratio_vs_sdpa | {pr['low']:.2f}–{pr['high']:.2f} | " \
           f"{mid:.2f}–{mid:.2f} (1) | inside |" in printed
    assert f"{dmid:.2f}–{dmid:.2f} (1) | inside |" in printed.split("| decode group 4 |")[1]


def test_gpu_check_runs_it():
    script = (ROOT / "tools" / "gpu_check.sh").read_text()
    assert 'tools/gpu_predictions.py' in script and '"$OUT/bench.json"' in script
    # after the decode phase, with its rows
    assert script.index('run_phase decode') < script.index('run_phase predictions')
    assert '--decode "$OUT/decode.json"' in script
    # both benchmark phases run through python -m fmha.bench and update the results file
    assert script.count("-m fmha.bench --cuda") == 2 and script.count('.json" --save') == 2


def test_design_page_table_matches_the_predictions():
    """docs/cuda_kernels.md's "Open predictions" table quotes predictions.json: each of its rows
    is one prediction with its range, and every prediction has a row: the page cannot drift from
    the file."""
    predictions = {pr["id"]: pr for pr in
                   json.loads(gp.DEFAULT_PREDICTIONS.read_text())["predictions"]}
    page = (ROOT / "docs" / "cuda_kernels.md").read_text()
    section = page.split("## Open predictions", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([^|]+?) \| [^|]+ \| ([0-9.]+)–([0-9.]+) \|$", section, re.M)
    assert sorted(pid for pid, _, _ in rows) == sorted(predictions), section
    for pid, low, high in rows:
        assert (float(low), float(high)) == (predictions[pid]["low"], predictions[pid]["high"]), pid
