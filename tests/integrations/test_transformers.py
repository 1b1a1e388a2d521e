"""Hugging Face transformers: attn_implementation="fmha" on a small randomly initialised
Llama (grouped kv heads) built from a config, no downloads. Outputs, the loss and a
training step's gradients agree with attn_implementation="sdpa"; padding masks, greedy
generation with the KV cache, and the attention really running through fmha are checked.
"""

import copy
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fmha.integrations.transformers as fmha_hf  # noqa: E402  (registers "fmha")

VOCAB = 97


def tiny_llama(attn_implementation, seed=0):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    # Each model gets its own config: _from_config records the implementation in it.
    return transformers.LlamaForCausalLM._from_config(copy.deepcopy(config),
                                                      attn_implementation=attn_implementation)


@pytest.fixture(scope="module")
def models():
    ref = tiny_llama("sdpa")
    mod = tiny_llama("fmha")
    mod.load_state_dict(ref.state_dict())
    assert ref.config._attn_implementation == "sdpa"
    assert mod.config._attn_implementation == "fmha"
    return ref, mod


def batch(seed=1, pad_left=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    if pad_left:
        mask[1, :pad_left] = 0
    return ids, mask


def test_fmha_is_registered_and_used(models, monkeypatch):
    assert "fmha" in transformers.AttentionInterface()
    assert "fmha" in transformers.masking_utils.AttentionMaskInterface()
    calls = []
    real = fmha_hf.attention

    def spy(q, k, v, **kw):
        calls.append((q.shape, k.shape, kw))
        return real(q, k, v, **kw)

    monkeypatch.setattr(fmha_hf, "attention", spy)
    _, mod = models
    ids, _ = batch()
    mod(ids)
    assert len(calls) == 2                                  # one per layer
    q_shape, k_shape, kw = calls[0]
    assert q_shape == (2, 12, 4, 16) and k_shape == (2, 12, 2, 16)   # GQA, not repeated
    # No padding: the mask builder skips the mask and fmha runs causal (top-left).
    assert kw["causal"] is True and kw["mask"] is None and kw["alignment"] == "top_left"


@pytest.mark.parametrize("pad_left", [0, 3])
def test_forward_and_training_step_agree_with_sdpa(models, pad_left):
    ref, mod = models
    ids, mask = batch(pad_left=pad_left)
    labels = ids.masked_fill(mask == 0, -100)
    results = []
    for m in (ref, mod):
        m.train()
        m.zero_grad()
        out = m(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        results.append((out.logits.detach(), out.loss.detach(),
                        {n: p.grad.clone() for n, p in m.named_parameters()}))
    (logits_r, loss_r, grads_r), (logits_m, loss_m, grads_m) = results
    keep = mask.bool()          # padded positions' logits are not meaningful in either
    torch.testing.assert_close(logits_m[keep], logits_r[keep], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_m, loss_r, rtol=1e-6, atol=1e-6)
    assert grads_m.keys() == grads_r.keys()
    for name in grads_r:
        assert torch.isfinite(grads_m[name]).all(), name
        torch.testing.assert_close(grads_m[name], grads_r[name], rtol=1e-4, atol=1e-6,
                                   msg=name)
    assert grads_m["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0


def test_greedy_generation_with_kv_cache_matches(models):
    ref, mod = models
    ids, _ = batch(seed=3)
    ref.eval()
    mod.eval()
    with torch.no_grad():
        a = ref.generate(ids[:1], max_new_tokens=6, do_sample=False)
        b = mod.generate(ids[:1], max_new_tokens=6, do_sample=False)
    assert a.shape == (1, 18)
    assert torch.equal(a, b)


def test_position_bias_and_float_mask(models):
    """The adapter alone: a float mask plus a T5-style position bias, softcap, GQA."""
    q = torch.randn(2, 4, 5, 8, dtype=torch.float64)
    k = torch.randn(2, 2, 7, 8, dtype=torch.float64)
    v = torch.randn(2, 2, 7, 8, dtype=torch.float64)
    mask = torch.zeros(2, 1, 5, 7, dtype=torch.float64)
    mask[1, ..., -2:] = torch.finfo(torch.float64).min
    pos = torch.randn(1, 4, 5, 7, dtype=torch.float64)
    module = torch.nn.Module()
    out, weights = fmha_hf.fmha_attention_forward(module, q, k, v, mask, scaling=0.5,
                                                  position_bias=pos, softcap=20.0)
    assert weights is None and out.shape == (2, 5, 4, 8) and out.is_contiguous()
    kk, vv = (x.repeat_interleave(2, dim=1) for x in (k, v))
    s = q @ kk.transpose(-1, -2) * 0.5
    s = 20.0 * torch.tanh(s / 20.0) + pos + mask
    ref = (torch.softmax(s, -1) @ vv).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def test_fmha_imports_without_transformers():
    # The integration is opt-in: importing fmha (and its torch parts) never loads it.
    code = ("import sys, fmha, fmha.nn, fmha.integrations; "
            "fmha.scaled_dot_product_attention; "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_batched_greedy_generation_with_left_padding_matches(models):
    """Two prompts, the second left-padded: prefill with a padding mask, then decoding
    steps whose mask keeps hiding the pad rows of the KV cache."""
    ref, mod = models
    ids, mask = batch(seed=5, pad_left=4)
    ref.eval()
    mod.eval()
    with torch.no_grad():
        a = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                         pad_token_id=0)
        b = mod.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                         pad_token_id=0)
    assert a.shape == (2, 20)
    assert torch.equal(a, b)


def tiny_gpt_oss(attn_implementation, seed=0):
    """A gpt-oss-style model (attention sinks, alternating sliding/full layers, MoE), tiny."""
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=6, max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM._from_config(copy.deepcopy(config),
                                                        attn_implementation=attn_implementation)
    with torch.no_grad():  # sinks that matter: some rows put most of their mass on them
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-2.0, 3.0, 4))
    return model.float()


def test_gpt_oss_attention_sinks_match_eager():
    """gpt-oss passes its per-head sinks as s_aux: logits, loss and the sinks' gradients
    agree with transformers' eager attention (the one implementation that has sinks)."""
    ref = tiny_gpt_oss("eager")
    mod = tiny_gpt_oss("fmha")
    mod.load_state_dict(ref.state_dict())
    ids, mask = batch(seed=3, pad_left=2)
    outs = []
    for model in (ref, mod):
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        outs.append((out.logits.detach(), out.loss.detach(),
                     [layer.self_attn.sinks.grad.clone() for layer in model.model.layers]))
    (logits_r, loss_r, sinks_r), (logits_f, loss_f, sinks_f) = outs
    keep = mask.bool()  # padded positions attend to nothing real in either implementation
    torch.testing.assert_close(logits_f[keep], logits_r[keep], rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(loss_f, loss_r, rtol=2e-4, atol=2e-4)
    for g_f, g_r in zip(sinks_f, sinks_r):
        assert g_r.abs().max() > 1e-4  # the sinks do receive gradient
        torch.testing.assert_close(g_f, g_r, rtol=2e-3, atol=2e-4)
