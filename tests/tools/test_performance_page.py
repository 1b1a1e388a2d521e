"""tools/performance_page.py: docs/performance.md, its plots and README.md's summary block are
what benchmarks/results/*.json give (the check CI runs), and the generator, on a small
synthetic results folder, writes what the results say, rewrites nothing when nothing changed,
and --check fails as soon as a result changes."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import performance_page as pp  # noqa: E402


def test_repository_page_is_current():
    """The committed page, plots and README block match the committed results files (a
    results file changed without regenerating the page fails here)."""
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "performance_page.py"), "--check"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr


def _suite_rows():
    rows = []
    for case, sdpa_ratio, frac in (("b1h8s2048d64", 1.5, 0.6), ("b1h8s2048d64-causal", 1.25, 0.7),
                                   ("decode-gqa-b8h32kv8-sk4096d128", 9.0, 0.05)):
        for dtype in ("float32", "bfloat16"):
            for pass_ in ("fwd", "fwd+bwd"):
                g = 100.0 if dtype == "float32" else 200.0
                rows.append(dict(case=case, dtype=dtype, pass_=pass_, impl="fmha", median_s=0.1,
                                 gflops=g, ratio_vs_sdpa=sdpa_ratio, fraction_of_peak=frac,
                                 ratio_vs_flex=3.0 if pass_ == "fwd" else None))
                rows.append(dict(case=case, dtype=dtype, pass_=pass_, impl="torch_sdpa",
                                 median_s=0.15, gflops=g / sdpa_ratio, ratio_vs_sdpa=None))
                if pass_ == "fwd":
                    rows.append(dict(case=case, dtype=dtype, pass_=pass_, impl="flex",
                                     median_s=0.3, gflops=g / 3, ratio_vs_sdpa=0.5))
    return rows


def _results(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    meta = dict(command="python -m fmha.bench --full --save", commit="abc1234",
                date="2026-01-02 03:04:05", fmha="0.1.0", torch="2.13.0+cpu", threads=2,
                cpu="AuthenticAMD family 26 model 2 (Zen 5) | AMD EPYC | 2596 MHz | flags x",
                cpu_model="AMD EPYC", cpu_isa="avx512bf16", fp32_fma_peak_gflops=450.0,
                bf16_dot_peak_gflops=900.0, peak_of_dtype=dict(float32="fp32_fma",
                                                               bfloat16="bf16_dot"))
    decode = [dict(case="b8-hq32-hkv8-sk4096", dtype="bfloat16", seqlen_q=1, entry=e, ms=1.0,
                   gb_per_s=50.0, read_bandwidth_gb_per_s=100.0, fraction_of_bandwidth=f,
                   ratio_vs_sdpa=r) for e, f, r in (("kvcache", 0.55, 30.0),
                                                    ("torch_sdpa", 0.02, 1.0))]
    cpu = dict(host_class="zen5", host=dict(cpu=meta["cpu"], cpu_model="AMD EPYC",
                                            cpu_isa="avx512bf16"),
               suites=dict(suite=dict(meta=meta, rows=_suite_rows()),
                           decode=dict(meta=dict(meta, command="python -m fmha.bench --decode "
                                                 "--save"), rows=decode)))
    gpu_meta = dict(command="python -m fmha.bench --cuda --save", commit="abc1234",
                    date="2026-01-02 05:00:00", fmha="0.1.0", torch="2.13.0+cu130",
                    gpu="NVIDIA H200", capability="9.0", sms=132)
    gpu = dict(host_class="h200", host=dict(gpu="NVIDIA H200", capability="9.0", sms=132),
               suites=dict(cuda=dict(meta=gpu_meta, rows=[
                   dict(case="b4h16s4096d128", dtype="bfloat16", pass_="fwd", impl="fmha",
                        median_s=1e-3, gflops=4.0e5, ratio_vs_sdpa=0.8, max_abs_diff=1e-3),
                   dict(case="b4h16s4096d128", dtype="bfloat16", pass_="fwd",
                        impl="torch_sdpa_flash", median_s=8e-4, gflops=5.0e5,
                        ratio_vs_sdpa=None)])))
    for data in (cpu, gpu):
        (results / f"{data['host_class']}.json").write_text(json.dumps(data, indent=1))
    readme = tmp_path / "README.md"
    readme.write_text(f"# fmha\n\nintro\n\n{pp.BEGIN}\nold table\n{pp.END}\n\nrest\n")
    return results, tmp_path / "docs", readme


def _args(results, docs, readme):
    return ["--results", str(results), "--docs", str(docs), "--readme", str(readme)]


def _files(docs, readme):
    return {p: p.read_bytes() for p in [readme, *sorted(docs.rglob("*")) ] if p.is_file()}


def test_generated_page_plots_and_readme(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    results, docs, readme = _results(tmp_path)
    args = _args(results, docs, readme)
    assert pp.main(args + ["--check"]) == 1  # nothing generated yet
    assert pp.main(args) == 0
    page = (docs / "performance.md").read_text()
    # the numbers of the results, in the page
    assert "## zen5" in page and "## h200" in page
    assert "| b1h8s2048d64 | float32 | fwd | 100.0 | 66.7 | 33.3 | 1.50× | 3.00× | 60% |" in page
    assert "| b4h16s4096d128 | bfloat16 | fwd | 400.0 | 500.0 | 0.80× | 1.0e-03 |" in page
    assert "| b8-hq32-hkv8-sk4096 | bfloat16 | 1 | 100.0 | 55% | 2% | 30.00× |" in page
    assert "`python -m fmha.bench --full --save` | abc1234 | 2026-01-02 03:04:05" in page
    # the README block: one row per host with a suite; the decode case left out of the ranges
    text = readme.read_text()
    assert "old table" not in text and text.startswith("# fmha\n\nintro\n\n") and \
        text.endswith(f"{pp.END}\n\nrest\n")
    assert "| [zen5](docs/performance.md#zen5) | AMD EPYC, Zen 5 | 2 | 1.25×–1.50× | " \
           "1.25×–1.50× | 60%–70% | 60%–70% |" in text
    assert "h200](docs" not in text
    # every plot the page shows exists and carries the digest of its data
    plots = sorted(p.name for p in (docs / "img").glob("*.png"))
    assert plots == ["perf_decode_bandwidth.png", "perf_fraction_of_peak.png",
                     "perf_suite_zen5.png"]
    for name in plots:
        assert f"(img/{name})" in page
        assert len(pp.png_text(docs / "img" / name)[pp.DIGEST_KEY]) == 64
    assert pp.main(args + ["--check"]) == 0

    # Regenerating from the same results rewrites nothing.
    before = _files(docs, readme)
    capsys.readouterr()
    assert pp.main(args) == 0
    assert capsys.readouterr().out == "" and _files(docs, readme) == before

    # One edited result: the page, the plot showing it and the README block are stale.
    zen5 = json.loads((results / "zen5.json").read_text())
    edited = copy.deepcopy(zen5)
    edited["suites"]["suite"]["rows"][0]["ratio_vs_sdpa"] = 1.75
    edited["suites"]["suite"]["rows"][0]["fraction_of_peak"] = 0.65
    (results / "zen5.json").write_text(json.dumps(edited))
    capsys.readouterr()
    assert pp.main(args + ["--check"]) == 1
    err = capsys.readouterr().err
    assert "performance.md differs" in err and "perf_fraction_of_peak.png plots other data" in err
    assert "performance summary differs" in err
    assert "perf_suite_zen5.png" not in err  # its GFLOP/s did not change
    assert pp.main(args) == 0 and pp.main(args + ["--check"]) == 0
    assert "| 1.25×–1.75× |" in readme.read_text()

    # A plot no longer generated is stale, and writing removes it.
    (results / "zen5.json").write_text(json.dumps(dict(edited, suites=dict(
        suite=edited["suites"]["suite"]))))
    assert pp.main(args + ["--check"]) == 1
    assert "perf_decode_bandwidth.png is no longer generated" in capsys.readouterr().err
    assert pp.main(args) == 0 and not (docs / "img" / "perf_decode_bandwidth.png").exists()
    assert pp.main(args + ["--check"]) == 0


def test_plots_are_byte_deterministic(tmp_path):
    """The same data drawn twice gives the same bytes (no date or version in the PNG)."""
    pytest.importorskip("matplotlib")
    results, _, _ = _results(tmp_path)
    _, plots, _ = pp.build(pp.load(results))
    name, spec = sorted(plots.items())[0]
    pp.draw(tmp_path / "a.png", name, spec)
    pp.draw(tmp_path / "b.png", name, spec)
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()
    assert b"Software" not in (tmp_path / "a.png").read_bytes()


def test_readme_without_markers_is_left_alone(tmp_path):
    results, docs, readme = _results(tmp_path)
    readme.write_text("# fmha\n\nno summary here\n")
    page, plots, block = pp.build(pp.load(results))
    assert pp.with_block(readme.read_text(), block) is None
    docs.mkdir()
    (docs / "performance.md").write_text(page)
    problems = pp.stale(results, docs, readme)
    # only the (undrawn) plots are missing: the README is not checked without its markers
    assert problems and all("is missing" in p for p in problems)
    assert len(problems) == len(plots)


def test_not_a_results_file(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps(dict(meta={}, rows=[])))
    with pytest.raises(ValueError, match="not a results file"):
        pp.load(tmp_path)
