"""A short run of examples/train_tiny_lm.py: the fmha and torch loss curves agree within the
example's stated tolerance, the loss goes down, the JSON record is written; and a broken
attention (a wrong scale) would be caught by the same comparison."""

import importlib.util
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_tiny_lm.py"
# One thread: the short run is dominated by tiny ops, where two threads only add
# synchronisation (and suffer most when the cores are shared).
SHORT = ["--steps", "25", "--batch", "8", "--context", "32", "--d-model", "32", "--heads",
         "2", "--layers", "1", "--lr", "1e-2", "--threads", "1"]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_tiny_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_short_run_curves_agree(example, tmp_path):
    out = tmp_path / "curves.json"
    assert example.main(SHORT + ["--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["same_initialisation"] is True
    assert len(result["loss_fmha"]) == len(result["loss_torch"]) == 25
    assert result["tolerance"] == example.TOLERANCE
    assert result["max_abs_diff"] <= example.TOLERANCE
    assert result["agree"] is True
    for name in ("loss_fmha", "loss_torch"):
        curve = result[name]
        # Starts near log(vocab) (uniform guess) and learns something within 25 steps.
        assert abs(curve[0] - torch.log(torch.tensor(float(result["vocab"])))) < 0.5
        assert sum(curve[-5:]) / 5 < curve[0] - 0.5, curve


def test_a_wrong_attention_would_disagree(example, monkeypatch):
    import fmha.nn
    real = fmha.nn.attention

    def off_by_scale(q, k, v, **kw):
        return real(q, k, v, **{**kw, "scale": 1.5 / q.shape[-1] ** 0.5})

    monkeypatch.setattr(fmha.nn, "attention", off_by_scale)
    result = example.run(example.parse_args(SHORT))
    assert not result["agree"]
    assert result["max_abs_diff"] > 10 * example.TOLERANCE


def test_generate_short_run(tmp_path):
    """examples/generate.py: fmha's paged-cache decoding gives torch SDPA's greedy tokens."""
    spec = importlib.util.spec_from_file_location("generate", EXAMPLE.parent / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    out = tmp_path / "generate.json"
    assert generate.main(["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                          "--prompt-len", "10", "--new-tokens", "6", "--batch", "3",
                          "--block-size", "4", "--threads", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["tokens_equal"] is True


def test_vit_example_small(tmp_path):
    """examples/vit.py on its 2-layer stand-in: both implementations run forward and a
    training step, the result file records them, and the logits agree."""
    spec = importlib.util.spec_from_file_location(
        "vit_example", Path(__file__).resolve().parents[2] / "examples" / "vit.py")
    vit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vit)
    out = tmp_path / "vit.json"
    assert vit.main(["--small", "--batch", "4", "--reps", "1", "--dtypes", "float32",
                     "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    timed = {(r["mode"], r["impl"]) for r in rows if "seconds" in r}
    assert timed == {(m, i) for m in ("inference", "training") for i in ("fmha", "sdpa")}
    logits = next(r for r in rows if r["mode"] == "logits")
    assert logits["max_abs_diff"] <= 1e-5 * max(logits["max_abs"], 1.0)
