"""`python -m fmha.bench --latency` on one shape with a tiny timing budget: the run completes,
prints its tables and writes a JSON file with every entry, both thread counts and the
breakdown. Times are only checked to be positive numbers: speed is never asserted by tests."""

import json

import pytest

torch = pytest.importorskip("torch")

from fmha import bench  # noqa: E402
from fmha.bench import latency as bench_latency  # noqa: E402

TINY = ["--latency", "--cases", "decode-sk16", "--min-seconds", "0", "--min-calls", "1",
        "--batches", "5", "--threads", "2"]


def test_latency_json(tmp_path, capsys):
    out = tmp_path / "latency.json"
    bench.main(TINY + ["--out", str(out)])
    printed = capsys.readouterr().out
    assert "| case | dtype | fmha |" in printed and "| part | µs | how | what |" in printed

    result = json.loads(out.read_text())
    assert {"meta", "rows", "breakdown", "budget"} <= result.keys()
    meta = result["meta"]
    for key in ("command", "fmha", "torch", "cpu_isa", "cpu_model", "threads", "fmha_threads",
                "date"):
        assert key in meta, key
    assert meta["fmha_threads"] == 2

    rows = result["rows"]
    row_keys = {"case", "dtype", "entry", "threads", "us_per_call", "calls", "batches",
                "ratio_vs_sdpa"}
    assert all(set(r) == row_keys for r in rows)
    assert {r["case"] for r in rows} == {"decode-sk16"}
    assert {r["dtype"] for r in rows} == {"float32"}
    got = {(r["entry"], r["threads"]) for r in rows}
    fmha_entries = [e for e in bench_latency.ENTRIES if e.startswith("fmha")]
    want = {(e, n) for e in fmha_entries for n in (2, 1)}
    want |= {("torch_sdpa", 2), ("torch_sdpa+grad", 2)}
    assert got == want
    for r in rows:
        assert r["us_per_call"] > 0 and r["batches"] >= 5 and r["calls"] >= r["batches"]
        assert (r["ratio_vs_sdpa"] is None) == r["entry"].startswith("torch_sdpa")

    bd = result["breakdown"]
    assert bd["case"] == "decode-sk16" and bd["dtype"] == "float32"
    parts = {p["part"]: p for p in bd["parts"]}
    for part in ("total", "_validate.prepare", "custom-op dispatch", "_C.forward, 2 threads",
                 "_C.forward, 1 thread", "thread-pool wake", "to_dlpack x4",
                 "plain call (_torch.plain_forward)",
                 "C++ floor, 1 thread"):
        assert part in parts, part
    assert all(p["how"] in ("measured", "difference", "sum") for p in parts.values())
    assert all(p["us"] > 0 for p in parts.values() if p["how"] == "measured")


def test_latency_unknown_case():
    with pytest.raises(SystemExit):
        bench.main(["--latency", "--cases", "no-such-case"])


def test_e2e_small(tmp_path):
    """python -m fmha.bench --e2e end to end on two-layer stand-ins: both implementations
    timed, the same greedy tokens, the JSON written (the real models only differ in size)."""
    pytest.importorskip("transformers")
    from fmha.bench import e2e as bench_e2e

    out = tmp_path / "e2e.json"
    result = bench_e2e.run(str(out), None, reps=1, small=True)
    assert json.loads(out.read_text())["decode"]["same_tokens"] is True
    assert set(result["vit"]["seconds"]) == {"fmha", "sdpa"}
    for key in ("first_token_seconds", "per_token_seconds"):
        assert all(t > 0 for t in result["decode"][key].values())
