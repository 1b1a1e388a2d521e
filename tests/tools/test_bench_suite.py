"""`python -m fmha.bench` (the standard suite's runner) on a tiny case with a tiny timing
budget: every column is timed, the Flex column for the forward only (its backward's absence
recorded), each row carries its fraction of the peak measured in the same run, and the JSON
and CSV hold it all. Flex runs eagerly here (compiling it costs ~15 s per case; the compiled
path is exercised by tests/tools/test_bench_sparse.py). Times are only checked to be positive:
speed is never asserted by tests."""

import csv
import json
import statistics

import pytest

torch = pytest.importorskip("torch")

from fmha.bench import suite  # noqa: E402

CASES = [("tiny-gqa-causal", 1, 4, 2, 64, 64, 16, True), ("tiny", 1, 2, 2, 32, 48, 16, False)]


@pytest.fixture
def fast_and_eager(monkeypatch):
    """Two rounds of one timed call per cell, and FlexAttention uncompiled."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    monkeypatch.setattr(suite, "ROUNDS", 2)
    monkeypatch.setattr(suite, "ROUND_SECONDS", 0.0)
    monkeypatch.setattr(suite, "compiled_flex", lambda torch: (flex_attention,
                                                               create_block_mask, ""))


def test_suite_rows_peaks_and_flex_column(tmp_path, capsys, fast_and_eager):
    out = tmp_path / "suite.json"
    rows = suite.run(CASES[:1], ["float32", "bfloat16"], ["fwd", "fwd+bwd"], str(out), 2)
    printed = capsys.readouterr().out
    assert "measured peaks: fp32 FMA" in printed and "| fmha / Flex |" in printed

    result = json.loads(out.read_text())
    meta = result["meta"]
    assert meta["fp32_fma_peak_gflops"] > 0
    bf16 = meta["bf16_dot_peak_gflops"]
    assert (bf16 is None) == (meta["cpu_isa"] != "avx512bf16")  # the active level probes
    assert meta["peak_gflops_of_dtype"]["float32"] == meta["fp32_fma_peak_gflops"]
    assert meta["peak_gflops_of_dtype"]["bfloat16"] == (bf16 or meta["fp32_fma_peak_gflops"])
    # The backward has no Flex row, and says why.
    assert any("no CPU backward" in why for why in meta["flex"]["errors"].values())

    cells = {(r["case"], r["dtype"], r["pass_"], r["impl"]): r for r in result["rows"]}
    assert len(cells) == len(rows) == len(result["rows"])
    for name, *_ in CASES[:1]:
        for dtype in ("float32", "bfloat16"):
            fwd = {i for (c, d, p, i) in cells if (c, d, p) == (name, dtype, "fwd")}
            bwd = {i for (c, d, p, i) in cells if (c, d, p) == (name, dtype, "fwd+bwd")}
            assert fwd == {"fmha", "torch_sdpa", "flex", "naive", "fmha+keypad"}, fwd
            assert bwd == {"fmha", "torch_sdpa", "naive"}, bwd
            # Every ratio and fraction is the median of its per-round values: each round's
            # time against the same round's peak probe, or the other implementation's time.
            for (c, d, p, i), r in cells.items():
                if (c, d) != (name, dtype):
                    continue
                assert r["median_s"] > 0 and r["gflops"] > 0
                assert len(r["round_s"]) == len(r["round_peak_gflops"]) == 2
                assert r["median_s"] == pytest.approx(statistics.median(r["round_s"]))
                if i != "fmha+keypad":
                    flop = r["gflops"] * r["median_s"]
                    assert r["fraction_of_peak"] == pytest.approx(statistics.median(
                        flop / t / pk for t, pk in zip(r["round_s"], r["round_peak_gflops"])))
                if i != "torch_sdpa":
                    base = cells[(c, d, p, "fmha" if i == "fmha+keypad" else "torch_sdpa")]
                    assert r["ratio_vs_sdpa"] == pytest.approx(statistics.median(
                        x / y for x, y in zip(base["round_s"], r["round_s"])))
            f = cells[(name, dtype, "fwd", "fmha")]
            flex = cells[(name, dtype, "fwd", "flex")]
            assert f["ratio_vs_flex"] == pytest.approx(statistics.median(
                x / y for x, y in zip(flex["round_s"], f["round_s"])))
            assert cells[(name, dtype, "fwd+bwd", "fmha")]["ratio_vs_flex"] is None

    with open(out.with_suffix(".csv")) as fh:
        table = list(csv.reader(fh))
    assert table[0][-2:] == ["fraction_of_peak", "ratio_vs_flex"]
    assert len(table) == 1 + len(rows)


def test_no_flex_leaves_the_column_out(tmp_path, fast_and_eager):
    rows = suite.run(CASES[1:], ["float32"], ["fwd"], str(tmp_path / "s.json"), 1, flex=False)
    assert {r.impl for r in rows} == {"fmha", "torch_sdpa", "naive", "fmha+keypad"}
    meta = json.loads((tmp_path / "s.json").read_text())["meta"]
    assert meta["flex"]["errors"] == {"tiny": "not requested"}


def test_rounds_rotate_and_record_a_flex_failure():
    """timed_rounds (both benchmark modes' timer): each round opens with the probes and
    starts one call further along the order; a call allowed to fail (flex) that raises in a
    later round is dropped with its error, the others keep one time per round; any other
    call's error propagates."""
    from fmha.bench._host import timed_rounds
    log, calls = [], {"flex": 0}

    def flex():
        calls["flex"] += 1
        if calls["flex"] == 3:  # the warm-up and round 0 pass; round 1 fails
            raise RuntimeError("compiled kernel failed")
        log.append("flex")

    def timer(fn):
        fn()
        return 1e-3

    steps = {"a": lambda: log.append("a"), "flex": flex, "b": lambda: log.append("b")}
    times, errors, measured = timed_rounds(
        steps, timer, {"peak": lambda: log.append("probe") or 1.0}, 3, may_fail=("flex",))
    assert set(times) == {"a", "b"} and times["a"] == times["b"] == [1e-3] * 3
    assert measured == {"peak": [1.0] * 3} and list(errors) == ["flex"]
    # warm-up a, flex, b; round 0 from a; round 1 from flex (which fails), then b, a;
    # round 2 over what is left (a, b), from position 2 % 2 = 0
    assert log == ["a", "flex", "b", "probe", "a", "flex", "b", "probe", "b", "a",
                   "probe", "a", "b"]
    with pytest.raises(ZeroDivisionError):
        timed_rounds({"fmha": lambda: 1 / 0, "flex": lambda: None}, timer, {}, 1,
                     may_fail=("flex",))


def test_a_flex_failure_mid_run_is_recorded(tmp_path, monkeypatch, fast_and_eager):
    """Flex failing after its warm-up: the suite goes on, the case has no Flex row, and the
    error is in the JSON's meta."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("flaky flex")
        return flex_attention(*args, **kwargs)

    monkeypatch.setattr(suite, "compiled_flex", lambda torch: (flaky, create_block_mask, ""))
    rows = suite.run(CASES[1:], ["float32"], ["fwd"], str(tmp_path / "s.json"), 1)
    assert {r.impl for r in rows} == {"fmha", "torch_sdpa", "naive", "fmha+keypad"}
    errors = json.loads((tmp_path / "s.json").read_text())["meta"]["flex"]["errors"]
    assert errors == {"tiny float32 fwd": "RuntimeError: flaky flex"}
