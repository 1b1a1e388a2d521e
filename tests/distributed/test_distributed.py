"""fmha.distributed across processes: ring attention (both layouts), Ulysses and
tensor-parallel heads on 1, 2 and 4 ranks of a Gloo group on this host, each against the
single-process result (outputs, lse and every gradient within 1e-5), plus refusals that
reach every rank and a launcher that fails cleanly instead of hanging. The scenarios are in
tests/distributed_cases.py; one launch per group size runs them all."""

import pytest

import distributed_cases as cases

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

WORLDS = (1, 2, 4)


@pytest.fixture(scope="module")
def outcomes():
    """{world: the launcher's results}, each world launched once, on first use."""
    done = {}

    def get(world):
        if world not in done:
            done[world] = cases.launch(world, cases.SCENARIOS)
        return done[world]
    return get


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("scenario", list(cases.SCENARIOS))
def test_scenario(outcomes, world, scenario):
    results = outcomes(world)
    per_rank = results[scenario]
    failures = {r: text for r, text in per_rank.items() if text != "ok"}
    assert not failures, "\n".join(f"rank {r}:\n{t}" for r, t in failures.items())
    assert sorted(per_rank) == list(range(world)), (
        f"ranks that reported: {sorted(per_rank)}; the workers: {results.get('<worker>')}")


@pytest.mark.parametrize("world", WORLDS)
def test_every_rank_exits_cleanly(outcomes, world):
    """After the scenarios every worker tears its process group down and exits with 0."""
    assert "<worker>" not in outcomes(world), outcomes(world)["<worker>"]


def test_a_failing_rank_does_not_hang_the_others():
    """Rank 1 raises before the call while rank 0 waits for it in ring_attention: rank 1's
    error is reported and rank 0 fails or is stopped within seconds, not at the deadline."""
    import time
    t0 = time.monotonic()
    results = cases.launch(2, ["rank 1 raises"], deadline_s=120)
    elapsed = time.monotonic() - t0
    assert "boom on rank 1" in results["rank 1 raises"][1]
    # Rank 0 either fails (Gloo notices rank 1 is gone) or is stopped by the launcher.
    rank0 = results["rank 1 raises"].get(0) or results["<worker>"][0]
    assert rank0 != "ok" and ("Error" in rank0 or "terminated" in rank0), rank0
    assert elapsed < 60, f"the launcher took {elapsed:.0f} s"


def test_ring_example_under_torchrun(tmp_path):
    """examples/ring_attention.py as docs/guides/distributed.md starts it (torchrun, 2 processes, Gloo), on a
    shorter sequence: the ring run stays under the per-process cap that the whole sequence
    exceeds, and the check against single-process fmha.attention passes."""
    import subprocess
    import sys
    from pathlib import Path
    example = Path(__file__).resolve().parents[2] / "examples" / "ring_attention.py"
    # --standalone: torchrun picks a free port for its rendezvous itself.
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", str(example), "--seqlen", "8192"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0 and "PASS" in run.stdout, run.stdout + run.stderr[-3000:]
    assert "largest per-rank peak" in run.stdout
