"""python -m fmha.bench tells the truth about its host: every mode records the load average
and the CPU time other processes took during the run (meta.host_load) and warns when that was
more than BUSY_FRACTION of the host's CPU time; rows whose per-round probes moved by more than
PROBE_SPREAD_LIMIT are flagged. The busy host is made here by starting busy processes, the
ones python -m fmha.bench --contention uses; times are never asserted."""

import json
import os
import time

import pytest

torch = pytest.importorskip("torch")

from fmha.bench import _host, cli, contention, suite  # noqa: E402


def test_host_load_counts_other_processes():
    """Busy processes that run for a second show up as other processes' CPU time (they are
    not reaped children, whose time would be this process's)."""
    cpus = os.cpu_count()
    with contention.Competitors(cpus, 0):
        start = _host._cpu_counters()
        time.sleep(1.0)
        load = _host.host_load(start)
    assert load["other_cpu_s"] > 0.5 * cpus * load["wall_s"] * 0.5, load
    assert load["busy"] is True and load["other_fraction"] > _host.BUSY_FRACTION
    assert len(load["loadavg"]) == 3
    assert "WARNING: the host was busy" in _host.host_load_line(load)


def test_a_quiet_reading_is_not_flagged(monkeypatch):
    """The flag follows the others' share: counters where only this process ran."""
    start = dict(wall=0.0, busy=100.0, steal=0.0, own=10.0)
    now = dict(wall=2.0, busy=103.9, steal=0.0, own=13.8)  # others: 0.1 CPU s in 2 s
    monkeypatch.setattr(_host, "_cpu_counters", lambda: now)
    load = _host.host_load(start)
    assert load["other_cpu_s"] == pytest.approx(0.1) and load["busy"] is False
    assert "WARNING" not in _host.host_load_line(load)


def test_bench_warns_on_a_busy_host(tmp_path, capsys):
    """A whole run of python -m fmha.bench (a short latency run) with busy processes beside
    it: the warning at its end and meta.host_load in its JSON."""
    out = tmp_path / "latency.json"
    with contention.Competitors(os.cpu_count(), 0):
        cli.main(["--latency", "--cases", "decode-sk16", "--min-seconds", "0.05",
                  "--min-calls", "5", "--batches", "5", "--threads", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "WARNING: the host was busy during this run" in printed
    load = json.loads(out.read_text())["meta"]["host_load"]
    assert load["busy"] is True and load["other_cpu_s"] > 0


def test_moving_probes_flag_the_row(tmp_path, capsys, monkeypatch):
    """A peak probe that moves by more than PROBE_SPREAD_LIMIT between rounds flags its rows
    (printed and in the JSON); a steady one does not."""
    monkeypatch.setattr(suite, "ROUNDS", 2)
    monkeypatch.setattr(suite, "ROUND_SECONDS", 0.0)
    import fmha
    # Two probes a round (the best of two), two rounds a case: case 1 steady, case 2 halved.
    probe = iter([100.0] * 4 + [100.0, 100.0, 50.0, 50.0])
    monkeypatch.setattr(fmha._C, "cpu_fma_peak_gflops", lambda threads: next(probe))
    cases = [("tiny", 1, 2, 2, 32, 48, 16, False), ("tiny2", 1, 2, 2, 32, 32, 16, False)]
    out = tmp_path / "suite.json"
    # measured_peaks takes three probes first: start the sequence after them.
    monkeypatch.setattr(suite, "measured_peaks", lambda fmha, n: dict(
        fp32_fma_peak_gflops=100.0, bf16_dot_peak_gflops=None, amx_bf16_peak_gflops=None,
        peak_of_dtype=dict(float32="fp32_fma"), peak_gflops_of_dtype=dict(float32=100.0)))
    suite.run(cases, ["float32"], ["fwd"], str(out), 1, flex=False)
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    flags = {r["case"]: (r["probes_moved"], r["probe_spread"]) for r in result["rows"]}
    assert flags["tiny"] == (False, 0.0)
    assert flags["tiny2"][0] is True and flags["tiny2"][1] == pytest.approx(0.5)
    assert result["meta"]["probes_moved"] == ["tiny2 float32 fwd"]
    assert "PROBES MOVED 50%" in printed and "the peak probes moved by more than" in printed


def test_contention_fair_share():
    """The fair slowdown: equal weights share the cores evenly, niced ones take little, and
    nobody gets more than a core."""
    assert contention.fair_slowdown(2, [], 2) == pytest.approx(1.0)
    assert contention.fair_slowdown(2, [0], 2) == pytest.approx(1.5)
    assert contention.fair_slowdown(2, [0, 0], 2) == pytest.approx(2.0)
    assert contention.fair_slowdown(2, [10], 2) == pytest.approx(2 / (2 * 2048 / 2158))
    assert contention.fair_slowdown(1, [0], 2) == pytest.approx(1.0)  # a free core each
    assert contention.fair_slowdown(2, [0], 4) == pytest.approx(1.0)


def test_competitors_are_always_stopped():
    """The busy processes run inside the with-block and are gone after it, also when it
    raises."""
    with pytest.raises(KeyboardInterrupt):
        with contention.Competitors(2, 10) as comp:
            procs = list(comp.procs)
            assert len(procs) == 2 and all(p.poll() is None for p in procs)
            raise KeyboardInterrupt
    assert all(p.poll() is not None for p in procs)
