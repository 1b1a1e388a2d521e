"""fmha.nn.MultiheadAttention against torch.nn.MultiheadAttention.

The two modules share a state_dict (same keys, shapes and, from the same seed, values) and
must agree on outputs, attention weights and every gradient (inputs, parameters, float
masks) across the constructor options and forward arguments of torch's module; float64 so
that the bound is tight. Then the fmha extras (grouped kv heads, prune_heads), dropout,
rows that see no key, errors, use inside torch.nn.TransformerEncoderLayer and a fullgraph
torch.compile.
"""

import pytest

torch = pytest.importorskip("torch")

import fmha  # noqa: E402
import fmha.nn  # noqa: E402
from conftest import compile_and_compare

# torch's module warns when the two masks' dtypes differ (a case tested on purpose).
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")

F64 = torch.float64
E, H, N, L, S = 16, 4, 2, 5, 7


def make_pair(dtype=F64, **kw):
    """torch's and fmha's module from the same seed; asserts identical state_dicts."""
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, dtype=dtype, **kw)
    torch.manual_seed(0)
    mod = fmha.nn.MultiheadAttention(E, H, dtype=dtype, **kw)
    a, b = ref.state_dict(), mod.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), f"{name}: different initialisation"
    return ref, mod


def randn(*shape, seed, dtype=F64):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def inputs(mod, batch_first=False, unbatched=False, self_attention=False, kv_shared=False,
           dtype=F64):
    """query, key, value in the module's layout."""
    def shape(n, f):
        if unbatched:
            return (n, f)
        return (N, n, f) if batch_first else (n, N, f)
    q = randn(*shape(L, E), seed=1, dtype=dtype)
    if self_attention:
        q = randn(*shape(S, E), seed=1, dtype=dtype)
        return q, q, q
    k = randn(*shape(S, mod.kdim), seed=2, dtype=dtype)
    v = k if kv_shared else randn(*shape(S, mod.vdim), seed=3, dtype=dtype)
    return q, k, v


def run(mod, q, k, v, **fwd):
    """Forward + backward of a fixed weighted sum of the output (and weights); returns the
    output, weights and the gradients of inputs, parameters and float masks."""
    leaves = {}
    if q is k and k is v:
        q = k = v = q.detach().clone().requires_grad_(True)
        leaves["q"] = q
    else:
        q = q.detach().clone().requires_grad_(True)
        if k is v:
            k = v = k.detach().clone().requires_grad_(True)
        else:
            k = k.detach().clone().requires_grad_(True)
            v = v.detach().clone().requires_grad_(True)
        leaves.update(q=q, k=k, v=v)
    for name in ("attn_mask", "key_padding_mask"):
        m = fwd.get(name)
        if m is not None and m.is_floating_point():
            fwd[name] = leaves[name] = m.detach().clone().requires_grad_(True)
    mod.zero_grad()
    out, w = mod(q, k, v, **fwd)
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()
    if w is not None:
        loss = loss + (w * torch.linspace(0, 2, w.numel(), dtype=w.dtype).view_as(w)).sum()
    loss.backward()
    res = {"out": out.detach(), "weights": None if w is None else w.detach()}
    res.update({f"d{n}": x.grad for n, x in leaves.items()})
    res.update({f"d.{n}": p.grad for n, p in mod.named_parameters()})
    return res


def assert_agree(ref, mod, q, k, v, atol=1e-12, rtol=1e-10, **fwd):
    a = run(ref, q, k, v, **dict(fwd))
    b = run(mod, q, k, v, **dict(fwd))
    assert list(a) == list(b)
    assert (a["weights"] is None) == (b["weights"] is None)
    for name in a:
        if a[name] is None:
            assert b[name] is None, name
            continue
        assert a[name].shape == b[name].shape, name
        assert torch.isfinite(b[name]).all(), name
        torch.testing.assert_close(b[name], a[name], atol=atol, rtol=rtol, msg=name)
    return a, b


def masks(unbatched=False, seed=0):
    """Torch-convention masks (True = blocked) that never block every key of a row: key 0
    is never blocked by attn_mask, the padding blocks only the last two keys."""
    g = torch.Generator().manual_seed(seed)
    am2 = torch.rand(L, S, generator=g) < 0.35
    am2[:, 0] = False
    am3 = torch.rand((1 if unbatched else N) * H, L, S, generator=g) < 0.35
    am3[..., 0] = False
    kpm = torch.zeros(S if unbatched else (N, S), dtype=torch.bool)
    kpm[..., -2:] = True
    if not unbatched:
        kpm[0, -1] = False   # different padding per sequence
    return am2, am3, kpm


def float_of(m, seed):
    """An additive mask: -inf where m blocks, random elsewhere."""
    return randn(*m.shape, seed=seed).masked_fill(m, float("-inf"))


# ---------------------------------------------------------------- construction

@pytest.mark.parametrize("kw", [
    {}, dict(bias=False), dict(add_bias_kv=True), dict(kdim=12, vdim=10),
    dict(kdim=12, vdim=10, bias=False, add_bias_kv=True, add_zero_attn=True),
    dict(dropout=0.1, batch_first=True),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_same_seed_same_parameters_and_state_dict(kw):
    ref, mod = make_pair(**kw)          # asserts keys, shapes and values
    for attr in ("embed_dim", "kdim", "vdim", "num_heads", "head_dim", "dropout",
                 "batch_first", "add_zero_attn", "_qkv_same_embed_dim"):
        assert getattr(mod, attr) == getattr(ref, attr), attr
    assert isinstance(mod.out_proj, torch.nn.Linear)
    # Checkpoints load both ways, strictly.
    ref.load_state_dict(mod.state_dict())
    mod.load_state_dict(ref.state_dict())


# ---------------------------------------------------------------- the agreement battery

CONFIGS = [
    dict(),
    dict(bias=False),
    dict(add_bias_kv=True),
    dict(add_zero_attn=True),
    dict(add_bias_kv=True, add_zero_attn=True),
    dict(kdim=12, vdim=10),
    dict(kdim=12, vdim=10, bias=False, add_bias_kv=True),
]


def mask_cases(unbatched=False):
    am2, am3, kpm = masks(unbatched)
    causal = torch.ones(L, S, dtype=torch.bool).triu(1)
    return {
        "none": {},
        "kpm_bool": dict(key_padding_mask=kpm),
        "kpm_float": dict(key_padding_mask=float_of(kpm, 5)),
        "attn2d_bool": dict(attn_mask=am2),
        "attn2d_float": dict(attn_mask=float_of(am2, 6)),
        "attn3d_bool": dict(attn_mask=am3),
        "attn3d_float": dict(attn_mask=float_of(am3, 7)),
        "attn3d_bool+kpm_bool": dict(attn_mask=am3, key_padding_mask=kpm),
        "attn2d_float+kpm_bool": dict(attn_mask=float_of(am2, 8), key_padding_mask=kpm),
        "attn2d_bool+kpm_float": dict(attn_mask=am2, key_padding_mask=float_of(kpm, 9)),
        "attn3d_float+kpm_float": dict(attn_mask=float_of(am3, 10),
                                       key_padding_mask=float_of(kpm, 11)),
        "causal": dict(attn_mask=causal, is_causal=True),
        "causal+kpm": dict(attn_mask=causal, is_causal=True, key_padding_mask=kpm),
    }


@pytest.mark.parametrize("config", CONFIGS,
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
@pytest.mark.parametrize("batch_first", [False, True])
def test_agree_over_masks(config, batch_first):
    """Every mask kind, with and without weights, per-head and averaged weights."""
    ref, mod = make_pair(batch_first=batch_first, **config)
    q, k, v = inputs(mod, batch_first=batch_first)
    for name, fwd in mask_cases().items():
        for need_weights, average in ((False, True), (True, True), (True, False)):
            try:
                assert_agree(ref, mod, q, k, v, need_weights=need_weights,
                             average_attn_weights=average, **fwd)
            except AssertionError as e:
                raise AssertionError(f"masks={name} need_weights={need_weights} "
                                     f"average={average}: {e}") from e


@pytest.mark.parametrize("config", [dict(), dict(add_bias_kv=True, add_zero_attn=True),
                                    dict(kdim=12, vdim=10)],
                         ids=["default", "bias_kv+zero_attn", "kdim_vdim"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_agree_unbatched(config, batch_first):
    ref, mod = make_pair(batch_first=batch_first, **config)
    q, k, v = inputs(mod, batch_first=batch_first, unbatched=True)
    for name, fwd in mask_cases(unbatched=True).items():
        for need_weights in (False, True):
            a, b = assert_agree(ref, mod, q, k, v, need_weights=need_weights, **fwd)
            assert b["out"].shape == (L, E), name


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("sharing", ["self_attention", "kv_shared"])
def test_agree_shared_inputs(batch_first, sharing):
    """query is key is value (one packed projection GEMM) and key is value."""
    ref, mod = make_pair(batch_first=batch_first)
    q, k, v = inputs(mod, batch_first=batch_first, **{sharing: True})
    assert (q is k) == (sharing == "self_attention") and k is v
    am2, _, kpm = masks()
    if sharing == "self_attention":
        am2 = torch.ones(S, S, dtype=torch.bool).triu(1)
    else:
        kpm = None
    assert_agree(ref, mod, q, k, v, attn_mask=am2, key_padding_mask=kpm)
    assert_agree(ref, mod, q, k, v, need_weights=False)


@pytest.mark.parametrize("train", [True, False])
def test_agree_train_and_eval_mode(train):
    # dropout is configured but 0 in effect: 0.0 in training mode, ignored in eval mode.
    for dropout in ((0.0,) if train else (0.0, 0.5)):
        ref, mod = make_pair(dropout=dropout, batch_first=True)
        ref.train(train)
        mod.train(train)
        q, k, v = inputs(mod, batch_first=True)
        am2, _, kpm = masks()
        assert_agree(ref, mod, q, k, v, attn_mask=am2, key_padding_mask=kpm)


def test_agree_float32():
    ref, mod = make_pair(dtype=torch.float32, batch_first=True)
    q, k, v = inputs(mod, batch_first=True, dtype=torch.float32)
    _, am3, kpm = masks()
    assert_agree(ref, mod, q, k, v, attn_mask=am3, key_padding_mask=kpm, atol=2e-6,
                 rtol=1e-5)


def test_causal_hint_uses_fmha_causal(monkeypatch):
    """is_causal with its mask, no padding mask, no weights: the mask is not read (as in
    torch), fmha runs its causal kernel, top-left aligned."""
    calls = []
    real = fmha.nn.attention

    def spy(q, k, v, **kw):
        calls.append(kw)
        return real(q, k, v, **kw)

    monkeypatch.setattr(fmha.nn, "attention", spy)
    ref, mod = make_pair(batch_first=True)
    q, k, v = inputs(mod, batch_first=True)
    causal = torch.ones(L, S, dtype=torch.bool).triu(1)
    assert_agree(ref, mod, q, k, v, attn_mask=causal, is_causal=True, need_weights=False)
    assert calls[-1]["causal"] is True and calls[-1]["alignment"] == "top_left"
    assert calls[-1]["mask"] is None and calls[-1]["bias"] is None
    # With weights requested the mask itself is applied (torch does the same).
    mod(q, k, v, attn_mask=causal, is_causal=True, need_weights=True)
    assert calls[-1]["causal"] is False and calls[-1]["mask"] is not None


# ---------------------------------------------------------------- rows that see no key

def test_fully_masked_row_is_zero_not_nan():
    ref, mod = make_pair(batch_first=True)
    q, k, v = inputs(mod, batch_first=True)
    am = torch.zeros(L, S, dtype=torch.bool)
    am[2] = True                                   # query 2 may see nothing
    a = run(ref, q, k, v, attn_mask=am)
    b = run(mod, q, k, v, attn_mask=am)
    assert torch.isnan(a["out"][:, 2]).all()       # torch: NaN
    # fmha: attention output 0 there, so the module returns out_proj's bias; weights 0.
    torch.testing.assert_close(b["out"][:, 2], mod.out_proj.bias.detach().expand(N, E))
    assert torch.equal(b["weights"][:, 2], torch.zeros(N, S, dtype=F64))
    for name, g in b.items():
        assert torch.isfinite(g).all(), name
    keep = [0, 1, 3, 4]
    torch.testing.assert_close(b["out"][:, keep], a["out"][:, keep])


# ---------------------------------------------------------------- dropout

def test_dropout_in_training_only_and_reproducible():
    mod = fmha.nn.MultiheadAttention(E, H, dropout=0.5, batch_first=True, dtype=F64)
    q, k, v = inputs(mod, batch_first=True)
    mod.train()
    torch.manual_seed(3)
    a, wa = mod(q, k, v)
    torch.manual_seed(3)
    b, _ = mod(q, k, v)
    torch.manual_seed(4)
    c, _ = mod(q, k, v)
    assert torch.equal(a, b) and not torch.allclose(a, c)
    mod.eval()
    d, wd = mod(q, k, v)
    e, _ = mod(q, k, v)
    assert torch.equal(d, e) and not torch.allclose(a, d)
    # The returned weights are the probabilities before dropout (documented).
    torch.testing.assert_close(wa, wd)


# ---------------------------------------------------------------- grouped kv heads

@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("config", [dict(), dict(kdim=12, vdim=10, add_bias_kv=True,
                                                add_zero_attn=True)],
                         ids=["default", "kdim_vdim+extras"])
def test_num_kv_heads_equals_repeated_kv_projection(kv_heads, config):
    """GQA with kv heads shared by groups of query heads computes what torch's module
    computes with each kv head's projection repeated for its group."""
    torch.manual_seed(0)
    mod = fmha.nn.MultiheadAttention(E, H, num_kv_heads=kv_heads, batch_first=True, dtype=F64,
                                     **config)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=F64, **config)
    d, group = E // H, H // kv_heads
    kv_dim = kv_heads * d

    def rep(t):   # (kv_heads * d, ...) -> (H * d, ...), head j -> heads j*group..
        return t.unflatten(0, (kv_heads, d)).repeat_interleave(group, 0).flatten(0, 1)

    with torch.no_grad():   # non-zero biases, so that their placement is checked too
        mod.in_proj_bias.copy_(randn(*mod.in_proj_bias.shape, seed=4))
    sd = mod.state_dict()
    new = dict(sd)
    if mod._qkv_same_embed_dim:
        assert sd["in_proj_weight"].shape == (E + 2 * kv_dim, E)
        wq, wk, wv = sd["in_proj_weight"].split([E, kv_dim, kv_dim])
        new["in_proj_weight"] = torch.cat([wq, rep(wk), rep(wv)])
    else:
        assert sd["k_proj_weight"].shape == (kv_dim, 12)
        new["k_proj_weight"] = rep(sd["k_proj_weight"])
        new["v_proj_weight"] = rep(sd["v_proj_weight"])
    bq, bk, bv = sd["in_proj_bias"].split([E, kv_dim, kv_dim])
    new["in_proj_bias"] = torch.cat([bq, rep(bk), rep(bv)])
    if "bias_k" in sd:
        assert sd["bias_k"].shape == (1, 1, kv_dim)
        new["bias_k"] = rep(sd["bias_k"][0, 0])[None, None]
        new["bias_v"] = rep(sd["bias_v"][0, 0])[None, None]
    ref.load_state_dict(new)
    q, k, v = inputs(mod, batch_first=True)
    _, am3, kpm = masks()
    for fwd in ({}, dict(attn_mask=am3, key_padding_mask=kpm, average_attn_weights=False)):
        out_m, w_m = mod(q, k, v, **fwd)
        out_r, w_r = ref(q, k, v, **fwd)
        torch.testing.assert_close(out_m, out_r, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(w_m, w_r, atol=1e-12, rtol=1e-10)


def test_num_kv_heads_validation():
    with pytest.raises(ValueError, match="num_kv_heads"):
        fmha.nn.MultiheadAttention(E, H, num_kv_heads=3)
    assert "num_kv_heads=2" in repr(fmha.nn.MultiheadAttention(E, H, num_kv_heads=2))


# ---------------------------------------------------------------- prune_heads

def zero_heads_reference(mod, heads):
    """A copy of mod whose heads contribute nothing: their out_proj columns zeroed."""
    import copy
    ref = copy.deepcopy(mod)
    d = mod.head_dim
    with torch.no_grad():
        for h in heads:
            ref.out_proj.weight[:, h * d:(h + 1) * d] = 0
    return ref


@pytest.mark.parametrize("config", [dict(), dict(kdim=12, vdim=10, add_bias_kv=True)],
                         ids=["packed", "separate+bias_kv"])
def test_prune_heads_equals_zeroed_heads(config):
    torch.manual_seed(0)
    mod = fmha.nn.MultiheadAttention(E, H, batch_first=True, dtype=F64, **config)
    with torch.no_grad():
        mod.in_proj_bias.copy_(randn(*mod.in_proj_bias.shape, seed=5))
    ref = zero_heads_reference(mod, [1, 2])
    q, k, v = inputs(mod, batch_first=True)
    _, _, kpm = masks()
    n_params = sum(p.numel() for p in mod.parameters())
    mod.prune_heads([1, 2])
    assert mod.num_heads == 2 and mod.num_kv_heads == 2 and mod.pruned_heads == {1, 2}
    assert mod.out_proj.weight.shape == (E, 2 * mod.head_dim)
    assert sum(p.numel() for p in mod.parameters()) < n_params
    out_m, w_m = mod(q, k, v, key_padding_mask=kpm, average_attn_weights=False)
    out_r, w_r = ref(q, k, v, key_padding_mask=kpm, average_attn_weights=False)
    torch.testing.assert_close(out_m, out_r, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(w_m, w_r[:, [0, 3]], atol=1e-12, rtol=1e-10)
    # Indices stay those of construction: pruning 0 (and 1 again) now leaves head 3.
    mod.prune_heads({0, 1})
    ref = zero_heads_reference(ref, [0])
    assert mod.num_heads == 1 and mod.pruned_heads == {0, 1, 2}
    torch.testing.assert_close(mod(q, k, v, need_weights=False)[0],
                               ref(q, k, v, need_weights=False)[0], atol=1e-12, rtol=1e-10)
    # Gradients flow into the new, smaller parameters.
    mod(q, k, v)[0].sum().backward()
    assert all(p.grad is not None for p in mod.parameters())
    with pytest.raises(ValueError, match="every head"):
        mod.prune_heads([3])
    with pytest.raises(ValueError, match="heads"):
        mod.prune_heads([4])


def test_prune_heads_grouped_kv():
    torch.manual_seed(0)
    mod = fmha.nn.MultiheadAttention(E, H, num_kv_heads=2, batch_first=True, dtype=F64)
    q, k, v = inputs(mod, batch_first=True)
    with pytest.raises(ValueError, match="same number"):
        mod.prune_heads([0])            # kv head 0 would keep 1 query head, kv head 1 two
    ref = zero_heads_reference(mod, [0, 1])
    mod.prune_heads([0, 1])             # the whole group of kv head 0
    assert (mod.num_heads, mod.num_kv_heads) == (2, 1)
    assert mod.in_proj_weight.shape == (2 * mod.head_dim + 2 * mod.head_dim, E)
    torch.testing.assert_close(mod(q, k, v)[0], ref(q, k, v)[0], atol=1e-12, rtol=1e-10)
    ref = zero_heads_reference(ref, [3])
    mod.prune_heads([3])                # one query head per kv head: fine
    assert (mod.num_heads, mod.num_kv_heads) == (1, 1)
    torch.testing.assert_close(mod(q, k, v)[0], ref(q, k, v)[0], atol=1e-12, rtol=1e-10)


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("call,exc,match", [
    (lambda m, q: m(q, q, q, is_causal=True), ValueError, "is_causal"),
    (lambda m, q: m(q, q, q, attn_mask=torch.ones(L, L, dtype=torch.int64)), TypeError,
     "attn_mask"),
    (lambda m, q: m(q, q, q, attn_mask=torch.ones(L, L + 1, dtype=torch.bool)), ValueError,
     "attn_mask"),
    (lambda m, q: m(q, q, q, attn_mask=torch.ones(N, L, L, dtype=torch.bool)), ValueError,
     "attn_mask"),
    (lambda m, q: m(q, q, q, key_padding_mask=torch.ones(N, L + 1, dtype=torch.bool)),
     ValueError, "key_padding_mask"),
    (lambda m, q: m(q, q, q, key_padding_mask=torch.ones(N, L, dtype=torch.int32)),
     TypeError, "key_padding_mask"),
    (lambda m, q: m(q[..., :8], q[..., :8], q[..., :8]), ValueError, "query"),
    (lambda m, q: m(q[0], q, q), ValueError, "key, value"),
    (lambda m, q: m(q, q[:1], q[:1]), ValueError, "batch size"),
])
def test_errors(call, exc, match):
    mod = fmha.nn.MultiheadAttention(E, H, batch_first=True)
    q = torch.randn(N, L, E)
    with pytest.raises(exc, match=match):
        call(mod, q)


def test_constructor_errors():
    with pytest.raises(ValueError, match="multiple"):
        fmha.nn.MultiheadAttention(10, 4)
    with pytest.raises(ValueError, match="greater than 0"):
        fmha.nn.MultiheadAttention(0, 4)


# ---------------------------------------------------------------- in a torch model

def test_drop_in_for_transformer_encoder_layer():
    """Swap the attention of a torch.nn.TransformerEncoderLayer for fmha's, reusing its
    weights: the layer computes the same thing, forward and backward."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0,
                                             batch_first=True, dtype=F64)
    import copy
    swapped = copy.deepcopy(layer)
    swapped.self_attn = fmha.nn.MultiheadAttention(E, H, batch_first=True, dtype=F64)
    swapped.self_attn.load_state_dict(layer.self_attn.state_dict())
    x = randn(N, S, E, seed=1)
    _, _, kpm = masks()
    causal = torch.nn.Transformer.generate_square_subsequent_mask(S, dtype=F64)
    for fwd in (dict(src_key_padding_mask=kpm), dict(src_mask=causal, is_causal=True)):
        outs = []
        for m in (layer, swapped):
            m.zero_grad()
            xx = x.clone().requires_grad_(True)
            y = m(xx, **fwd)
            y.pow(2).sum().backward()
            outs.append((y.detach(), xx.grad, m.self_attn.in_proj_weight.grad))
        for a, b in zip(*outs):
            torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-10)


# ---------------------------------------------------------------- torch.compile

class TinyTransformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = fmha.nn.MultiheadAttention(E, H, batch_first=True, num_kv_heads=2,
                                               add_zero_attn=True)
        self.cross = fmha.nn.MultiheadAttention(E, H, kdim=12, vdim=12)
        self.ff = torch.nn.Linear(E, E)

    def forward(self, x, memory, kpm, causal):
        h = x + self.attn(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]
        c, w = self.cross(h.transpose(0, 1), memory, memory, key_padding_mask=kpm)
        return self.ff(h + c.transpose(0, 1)) + w.sum(-1, keepdim=True)


def test_compile_fullgraph_module():
    torch.manual_seed(0)
    model = TinyTransformer()
    x = torch.randn(N, L, E, requires_grad=True)
    memory = torch.randn(S, N, 12)
    _, _, kpm = masks()
    causal = torch.nn.Transformer.generate_square_subsequent_mask(L)
    compile_and_compare(model, x, memory, kpm, causal)
