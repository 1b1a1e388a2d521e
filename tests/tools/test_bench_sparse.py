"""`python -m fmha.bench --sparse` on a tiny shape (bench_sparse.TINY) with a tiny timing
budget: the run completes, prints its table, writes the JSON and the .txt beside it with every
case and column, and its own checks hold (fmha's BlockMask output and gradients bitwise equal
to the dense mask's, SDPA within tolerance). Times are only checked to be positive numbers:
speed is never asserted by tests. FlexAttention is compiled only in the last test (one small
case, one dtype)."""

import json

import pytest

torch = pytest.importorskip("torch")

import fmha  # noqa: E402
from fmha import bench  # noqa: E402
from fmha.bench import sparse as bench_sparse  # noqa: E402


def _run(tmp_path, **kw):
    out = tmp_path / "sparse.json"
    args = dict(dtypes=("float32", "bfloat16"), passes=("fwd", "fwd+bwd"), out_path=str(out),
                threads=2, config=bench_sparse.TINY, min_seconds=0.0, flex=False)
    args.update(kw)
    returned = bench_sparse.run(**args)
    return out, returned


def test_sparse_tiny_json(tmp_path, capsys):
    out, returned = _run(tmp_path)
    printed = capsys.readouterr().out
    assert "| case | dtype | pass | fmha block ms | fmha dense ms |" in printed

    result = json.loads(out.read_text())
    assert result == json.loads(json.dumps(returned))
    txt = out.with_suffix(".txt").read_text()
    assert "| case | dtype | pass | fmha block ms |" in txt and "targets:" in txt

    meta = result["meta"]
    for key in ("command", "fmha", "torch", "cpu_isa", "cpu_model", "threads", "fmha_threads",
                "fp32_fma_peak_gflops", "date"):
        assert key in meta, key
    assert meta["fmha_threads"] == 2 and meta["fp32_fma_peak_gflops"] > 0

    cases = {c["name"]: c for c in result["cases"]}
    assert list(cases) == list(bench_sparse.CASE_NAMES)
    for c in cases.values():
        assert c["mask_mod_matches_builder"] is True, c["name"]
        n = c["counts"]
        assert n["empty"] + n["full"] + n["partial"] == n["total"] > 0
        assert 0 < c["nonempty_block_fraction"] <= 1 and 0 < c["allowed_fraction"] <= 1
        assert c["allowed_pairs"] <= c["nonempty_block_pairs"]
    # 4 equal documents of 64 tokens in blocks of 32: 2x2 blocks each of 8x8, all full.
    assert cases["document"]["counts"] == dict(empty=48, full=16, partial=0, total=64)

    rows = result["rows"]
    for name in bench_sparse.CASE_NAMES:
        for dtype in ("float32", "bfloat16"):
            for pass_ in ("fwd", "fwd+bwd"):
                by = {r["impl"]: r for r in rows
                      if (r["case"], r["dtype"], r["pass"]) == (name, dtype, pass_)}
                want = {"fmha_block", "fmha_dense", "sdpa_dense", "flex"}
                if name == "causal":
                    want |= {"fmha_causal", "sdpa_causal"}
                assert set(by) == want, (name, dtype, pass_)
                for impl, r in by.items():
                    if impl == "flex":  # not run: recorded as skipped, with the reason
                        assert r["median_s"] is None and "flex=False" in r["skipped"]
                        continue
                    assert r["error"] is None and r["skipped"] is None, r
                    assert r["median_s"] > 0 and r["reps"] >= 3 and r["gflops_useful"] > 0
                assert by["fmha_block"]["bitwise_equal_to_fmha_dense"] is True
                for impl in ("sdpa_dense",) + (("sdpa_causal",) if name == "causal" else ()):
                    assert by[impl]["within_tolerance"] is True, (name, dtype, pass_, impl)
                if name == "causal":
                    assert by["fmha_causal"]["bitwise_equal_to_fmha_dense"] is True
    ratios = result["ratios"]
    assert len(ratios) == len(bench_sparse.CASE_NAMES) * 2 * 2
    for r in ratios:
        assert r["checks_ok"] is True
        assert r["dense_over_block"] > 0 and r["sdpa_over_block"] > 0
        assert r["flex_over_block"] is None
        assert ("block_over_causal" in r) == (r["case"] == "causal")
    whats = {(t["case"], t["what"]) for t in result["targets"]}
    assert ("document", "dense/block") in whats and ("causal", "block/causal") in whats
    assert all(t["met"] is None for t in result["targets"] if t["what"] == "flex/block")


def test_tiny_block_mask_equals_dense_mask():
    """Independently of the benchmark's own check: for every tiny case the BlockMask call
    gives bitwise the dense-mask call's output and gradients."""
    cfg = bench_sparse.TINY
    g = torch.Generator().manual_seed(1)
    shape = (cfg.batch, cfg.seqlen, cfg.heads, cfg.head_dim)
    for case in bench_sparse.build_cases(cfg, bench_sparse.CASE_NAMES):
        dense = torch.from_numpy(case.block_mask.to_dense())
        base = [torch.randn(shape, generator=g) for _ in range(4)]
        got = []
        for kw in (dict(block_mask=case.block_mask), dict(mask=dense)):
            q, k, v = (x.clone().requires_grad_() for x in base[:3])
            o = fmha.attention(q, k, v, **kw)
            o.backward(base[3])
            got.append([o.detach(), q.grad, k.grad, v.grad])
        for x, y in zip(*got):
            assert torch.equal(x, y), case.name


def test_unknown_case_and_pass():
    with pytest.raises(ValueError, match="unknown"):
        bench_sparse.build_cases(bench_sparse.TINY, ["no-such-case"])
    with pytest.raises(ValueError, match="passes"):
        bench_sparse.run(passes=("bwd",), config=bench_sparse.TINY, flex=False)


def test_bench_main_dispatches_sparse(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(bench_sparse, "run", lambda *a, **kw: seen.update(args=a, kw=kw))
    out = str(tmp_path / "s.json")
    bench.main(["--sparse", "--quick", "--dtypes", "float32", "--passes", "fwd", "--out", out,
                "--threads", "2", "--cases", "document,causal"])
    assert seen["args"] == (["float32"], ["fwd"], out, 2)
    assert seen["kw"] == dict(quick=True, cases=["document", "causal"], min_seconds=None,
                            save=None)
    bench.main(["--sparse"])
    assert seen["args"] == (["float32", "bfloat16"], ["fwd", "fwd+bwd"], None, None)
    assert seen["kw"]["quick"] is False and seen["kw"]["cases"] is None


def test_sparse_flex_tiny(tmp_path):
    """FlexAttention compiled on one tiny case: its forward is timed and agrees with fmha; its
    forward+backward (no CPU backward in torch 2.13) is timed or records an error, and an
    error there does not leave the next Flex cell running the eager fallback."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    cfg = bench_sparse.Config(1, 1, 256, 32, 128, 2, 128, 128, 4, 1)
    _, result = _run(tmp_path, config=cfg, dtypes=("float32",), passes=("fwd+bwd", "fwd"),
                     cases=["document"], flex=True)
    by = {r["pass"]: r for r in result["rows"] if r["impl"] == "flex"}
    bwd, fwd = by["fwd+bwd"], by["fwd"]
    assert bwd["error"] or bwd["median_s"] > 0
    if bwd["error"]:
        assert bwd["error_detail"].strip() and len(bwd["error"].splitlines()) == 1
    # fullgraph=True: no error means the compiled kernel was timed, not the eager fallback.
    assert fwd["error"] is None and fwd["median_s"] > 0, fwd
    assert fwd["within_tolerance"] is True
    assert fwd["compile_s"] > 0
