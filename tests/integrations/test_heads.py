"""Head importance and pruning (fmha.nn.head_importance, heads_to_prune, prune_heads):
the importance is E|dL/d gate| (checked against central finite differences of the loss in
float64, on fmha.nn.MultiheadAttention layers and on a Hugging Face BERT running on fmha),
pruning a head physically computes what zeroing its gate computes, and the selection rules
hold (lowest first, one head left per layer, per-layer ratios)."""


import pytest

torch = pytest.importorskip("torch")

import fmha.nn  # noqa: E402
from fmha import _heads  # noqa: E402


class TwoLayers(torch.nn.Module):
    def __init__(self, e=24, h=4, kv=2):
        super().__init__()
        self.a = fmha.nn.MultiheadAttention(e, h, batch_first=True, num_kv_heads=kv)
        self.b = fmha.nn.MultiheadAttention(e, h, batch_first=True)

    def forward(self, x):
        y = x + self.a(x, x, x, need_weights=False)[0]
        return y + self.b(y, y, y, need_weights=False)[0]


def _loss(model, batch):
    x, w = batch
    return (model(x) * w).sum() if not isinstance(x, dict) else \
        (model(**x).last_hidden_state * w).sum()


def _finite_difference_importance(model, layers, batches, eps=1e-6):
    """E|dL/dgate_h| by central differences, gates set by hand."""
    out = {}
    for name, m, heads in layers:
        scores = torch.zeros(heads, dtype=torch.float64)
        for batch in batches:
            for h in range(heads):
                vals = []
                for sign in (1, -1):
                    g = torch.ones(heads, dtype=torch.float64)
                    g[h] += sign * eps
                    setattr(m, _heads.GATE, g)
                    with torch.no_grad():
                        vals.append(_loss(model, batch).item())
                    delattr(m, _heads.GATE)
                scores[h] += abs(vals[0] - vals[1]) / (2 * eps)
        out[name] = scores / len(batches)
    return out


def _batches(shape, n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g, dtype=torch.float64),
             torch.randn(*shape, generator=g, dtype=torch.float64)) for _ in range(n)]


def test_importance_is_the_gate_gradient_on_fmha_layers():
    torch.manual_seed(0)
    model = TwoLayers().double()
    batches = _batches((2, 7, 24))
    got = fmha.nn.head_importance(model, batches, _loss, normalize=False)
    assert list(got) == ["a", "b"]
    want = _finite_difference_importance(
        model, [(n, getattr(model, n), 4) for n in "ab"], batches)
    for name in want:
        torch.testing.assert_close(got[name].double(), want[name], rtol=1e-4, atol=1e-6)
    assert not hasattr(model.a, _heads.GATE)  # the gates are gone afterwards
    normed = fmha.nn.head_importance(model, batches, _loss)
    for name in normed:
        torch.testing.assert_close(normed[name].norm(), torch.tensor(1.0))


def _tiny_bert():
    transformers = pytest.importorskip("transformers")
    import fmha.integrations.transformers  # noqa: F401  (registers "fmha")
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=24, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=30,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertModel._from_config(cfg, attn_implementation="fmha").double().eval()


def _bert_batches(n=2):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 50, (2, 9), generator=g)
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[1, 6:] = 0
        out.append((dict(input_ids=ids, attention_mask=mask),
                    torch.randn(2, 9, 24, generator=g, dtype=torch.float64)))
    return out


def test_importance_through_the_hugging_face_attention_function():
    model = _tiny_bert()
    batches = _bert_batches()
    got = fmha.nn.head_importance(model, batches, _loss, normalize=False)
    assert list(got) == ["encoder.layer.0.attention.self", "encoder.layer.1.attention.self"]
    layers = _heads.attention_layers(model, lambda: _loss(model, batches[0]))
    want = _finite_difference_importance(model, layers, batches)
    for name in want:
        torch.testing.assert_close(got[name].double(), want[name], rtol=1e-4, atol=1e-6)


def _gated_output(model, forward, heads):
    """The output with the given heads' gates at 0 (nothing pruned)."""
    layers = {n: m for n, m, _ in _heads.attention_layers(model, forward)}
    try:
        for name, hs in heads.items():
            m = layers[name]
            n = m.num_heads if isinstance(m, fmha.nn.MultiheadAttention) else \
                m.num_attention_heads
            g = torch.ones(n, dtype=torch.float64)
            g[hs] = 0
            setattr(m, _heads.GATE, g)
        with torch.no_grad():
            return forward()
    finally:
        for m in layers.values():
            if hasattr(m, _heads.GATE):
                delattr(m, _heads.GATE)


def test_pruning_computes_what_zero_gates_compute():
    torch.manual_seed(0)
    model = TwoLayers().double()
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    heads = {"a": [0, 1], "b": [2]}  # a: both query heads of kv head 0
    want = _gated_output(model, lambda: model(x), heads)
    fmha.nn.prune_heads(model, heads)
    assert (model.a.num_heads, model.a.num_kv_heads, model.b.num_heads) == (2, 1, 3)
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=1e-12, atol=1e-12)

    bert = _tiny_bert()
    kw = _bert_batches(1)[0][0]
    heads = {"encoder.layer.0.attention.self": [1, 3], "encoder.layer.1.attention.self": [0]}
    want = _gated_output(bert, lambda: bert(**kw).last_hidden_state, heads)
    fmha.nn.prune_heads(bert, heads)
    assert bert.encoder.layer[0].attention.self.query.weight.shape == (12, 24)
    assert bert.encoder.layer[0].attention.output.dense.weight.shape == (24, 12)
    with torch.no_grad():
        got = bert(**kw).last_hidden_state
    keep = kw["attention_mask"].bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-10, atol=1e-10)


def test_heads_to_prune_rules():
    imp = {"x": torch.tensor([0.1, 0.9, 0.5]), "y": torch.tensor([0.05, 0.04]),
           "z": torch.tensor([0.3, 0.2, 0.8, 0.7])}
    # 9 heads, 44% -> 4: the lowest are y1, y0, x0, z1; y keeps one, so z0 comes in.
    assert fmha.nn.heads_to_prune(imp, 0.44) == {"x": [0], "y": [1], "z": [0, 1]}
    assert fmha.nn.heads_to_prune(imp, 0.0) == {"x": [], "y": [], "z": []}
    assert fmha.nn.heads_to_prune(imp, 0.5, per_layer=True) == {"x": [0, 2], "y": [1],
                                                                "z": [0, 1]}
    random_order = {"x": torch.tensor([3., 2., 1.]), "y": torch.tensor([0., 9.]),
                    "z": torch.tensor([9., 9., 9., 0.5])}
    assert fmha.nn.heads_to_prune(imp, 0.3, order=random_order) == {"x": [2], "y": [0],
                                                                    "z": [3]}
    with pytest.raises(ValueError, match="ratio"):
        fmha.nn.heads_to_prune(imp, 1.0)


def test_bad_input():
    with pytest.raises(ValueError, match="no attention layer runs on fmha"):
        fmha.nn.head_importance(torch.nn.Linear(3, 3), [torch.zeros(3)],
                                lambda m, b: m(b).sum())
    with pytest.raises(ValueError, match="batches"):
        fmha.nn.head_importance(TwoLayers(), [], _loss)
    with pytest.raises(ValueError, match="no module named"):
        fmha.nn.prune_heads(TwoLayers(), {"nope": [0]})
    with pytest.raises(NotImplementedError, match="Linear"):
        fmha.nn.prune_heads(torch.nn.Sequential(torch.nn.Linear(2, 2)), {"0": [0]})


def test_pruning_requests_are_checked_before_anything_changes():
    torch.manual_seed(0)
    model = TwoLayers()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # "a" is valid; "b"'s index is out of range, then a GQA choice leaves kv heads unequal
    for heads, match in (({"a": [0, 1], "b": [4]}, r"expected indices in \[0, 4\)"),
                         ({"b": [1], "a": [0]}, "as many"),
                         ({"b": [-1], "a": [0, 1]}, r"expected indices")):
        with pytest.raises(ValueError, match=match):
            fmha.nn.prune_heads(model, heads)
        assert model.a.num_heads == 4 and model.b.num_heads == 4
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), k


def test_pruning_keeps_frozen_weights_frozen():
    bert = _tiny_bert()
    layer = bert.encoder.layer[0].attention
    layer.self.query.weight.requires_grad_(False)
    fmha.nn.prune_heads(bert, {"encoder.layer.0.attention.self": [0]})
    assert not layer.self.query.weight.requires_grad
    assert layer.self.key.weight.requires_grad


def test_heads_to_prune_refuses_nan_and_partial_orders():
    imp = {"x": torch.tensor([0.1, float("nan")])}
    with pytest.raises(ValueError, match="NaN"):
        fmha.nn.heads_to_prune(imp, 0.5)
    with pytest.raises(ValueError, match="order"):
        fmha.nn.heads_to_prune({"x": torch.tensor([0.1, 0.2])}, 0.5, order={"y": torch.ones(2)})
