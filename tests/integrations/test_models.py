"""The Hugging Face architecture matrix on attn_implementation="fmha": for each family a
small randomly initialised model built from a config (no downloads), with padding in the
batch where the family takes a mask:

- eval forward: fmha's outputs against "sdpa"'s and "eager"'s (1e-4 of the largest entry,
  float32; padded positions, whose outputs no implementation defines alike, are left out);
- one training step (attention dropout 0: the implementations draw their masks
  differently): every parameter's gradient against "sdpa"'s (Gemma 2, which has no
  "sdpa" path: "eager"'s);
- decoders: 8 greedy tokens with the KV cache, identical to the same reference's;
- the attention really running through fmha (a counting wrapper).

Families: BERT, RoBERTa, ViT, CLIP (text and vision towers), Whisper (encoder, decoder
self- and cross-attention), T5 (relative position bias), BART (cross-attention), GPT-2,
Llama (GQA), Mistral (sliding window), Qwen2, Gemma 2 (softcap + sliding window).
The families known not to work, and why, are listed in docs/guides/integrations.md ("Hugging Face transformers").
"""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fmha.integrations.transformers as fmha_hf  # noqa: E402  (registers "fmha")

V = 99  # vocabulary
TOL = 1e-4


def _ids(seed, shape=(2, 12)):
    return torch.randint(3, V, shape, generator=torch.Generator().manual_seed(seed))


def _padding(right=True, n=12, pad=4):
    mask = torch.ones(2, n, dtype=torch.long)
    if right:
        mask[1, n - pad:] = 0
    else:
        mask[1, :pad] = 0
    return mask


def _pixels(seed, size=32):
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(seed))


# family: (model class, config, inputs(seed) -> kwargs, valid(kwargs) -> bool mask of the
# output rows to compare (None = all), output(model output) -> tensor, decoder?)
def _bert_like(cls_name, cfg_name):
    cfg = getattr(transformers, cfg_name)(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64, attention_probs_dropout_prob=0.0)

    def inputs(seed):
        return dict(input_ids=_ids(seed), attention_mask=_padding())
    return (getattr(transformers, cls_name), cfg, inputs, lambda kw: kw["attention_mask"].bool(),
            lambda out: out.last_hidden_state, False)


def _vit():
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=37)
    return (transformers.ViTModel, cfg, lambda seed: dict(pixel_values=_pixels(seed)), None,
            lambda out: out.last_hidden_state, False)


def _clip():
    cfg = transformers.CLIPConfig(
        text_config=dict(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=37,
                         max_position_embeddings=32),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=37),
        projection_dim=16)

    def inputs(seed):
        return dict(input_ids=_ids(seed), attention_mask=_padding(),
                    pixel_values=_pixels(seed))
    # text and image embeddings both come out of logits_per_image
    return (transformers.CLIPModel, cfg, inputs, None,
            lambda out: torch.cat([out.text_embeds, out.image_embeds]), False)


def _whisper():
    cfg = transformers.WhisperConfig(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37,
        decoder_ffn_dim=37, num_mel_bins=16, max_source_positions=16,
        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None)

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        return dict(input_features=torch.randn(2, 16, 32, generator=g),
                    decoder_input_ids=_ids(seed, (2, 6)))
    return (transformers.WhisperForConditionalGeneration, cfg, inputs, None,
            lambda out: out.logits, True)


def _t5():
    cfg = transformers.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=37, num_layers=2,
                                num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)

    def inputs(seed):
        return dict(input_ids=_ids(seed), attention_mask=_padding(),
                    decoder_input_ids=_ids(seed + 1, (2, 6)))
    return (transformers.T5ForConditionalGeneration, cfg, inputs, None,
            lambda out: out.logits, True)


def _bart():
    cfg = transformers.BartConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4,
                                  encoder_ffn_dim=37, decoder_ffn_dim=37,
                                  max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, decoder_start_token_id=2)

    def inputs(seed):
        return dict(input_ids=_ids(seed), attention_mask=_padding(),
                    decoder_input_ids=_ids(seed + 1, (2, 6)))
    return (transformers.BartForConditionalGeneration, cfg, inputs, None,
            lambda out: out.logits, True)


def _causal_lm(cls_name, cfg):
    def inputs(seed):
        return dict(input_ids=_ids(seed), attention_mask=_padding(right=False))
    return (getattr(transformers, cls_name), cfg, inputs,
            lambda kw: kw["attention_mask"].bool(), lambda out: out.logits, True)


def _families():
    small = dict(vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=64)
    return {
        "bert": _bert_like("BertModel", "BertConfig"),
        "roberta": _bert_like("RobertaModel", "RobertaConfig"),
        "vit": _vit(),
        "clip": _clip(),
        "whisper": _whisper(),
        "t5": _t5(),
        "bart": _bart(),
        "gpt2": _causal_lm("GPT2LMHeadModel", transformers.GPT2Config(
            vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.0)),
        "llama-gqa": _causal_lm("LlamaForCausalLM", transformers.LlamaConfig(
            num_key_value_heads=2, **small)),
        "mistral-sliding-window": _causal_lm("MistralForCausalLM", transformers.MistralConfig(
            num_key_value_heads=2, sliding_window=4, **small)),
        "qwen2": _causal_lm("Qwen2ForCausalLM", transformers.Qwen2Config(
            num_key_value_heads=2, **small)),
        "gemma2-softcap": _causal_lm("Gemma2ForCausalLM", transformers.Gemma2Config(
            num_key_value_heads=2, head_dim=8, attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0, sliding_window=4, query_pre_attn_scalar=8, **small)),
    }


FAMILIES = _families()


def _build(name, impl):
    cls, cfg, *_ = FAMILIES[name]
    torch.manual_seed(0)
    # _from_config records the implementation in the config: one copy per model.
    return cls._from_config(copy.deepcopy(cfg), attn_implementation=impl)


#: The implementations each family is compared with; the first also for gradients and
#: decoding. Gemma 2 has no "sdpa" path in transformers (it refuses it).
REFERENCES = {"gemma2-softcap": ("eager",)}


def _refs(name):
    return REFERENCES.get(name, ("sdpa", "eager"))


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(name):
        if name not in cache:
            models = {impl: _build(name, impl) for impl in ("fmha",) + _refs(name)}
            state = models[_refs(name)[0]].state_dict()
            for m in models.values():
                m.load_state_dict(state)
            cache[name] = models
        return cache[name]
    return get


def _close(what, actual, expected):
    err = (actual - expected).abs().max().item()
    bound = TOL * max(expected.abs().max().item(), 1.0)
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


@pytest.fixture
def count_fmha_calls(monkeypatch):
    calls = []
    inner = transformers.AttentionInterface._global_mapping["fmha"]

    def counting(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)
    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, "fmha", counting)
    return calls


@pytest.mark.parametrize("name", list(FAMILIES))
def test_eval_forward_matches_sdpa_and_eager(built, name, count_fmha_calls):
    _, _, inputs, valid, output, _ = FAMILIES[name]
    models = built(name)
    kw = inputs(1)
    outs = {}
    for impl, m in models.items():
        m.eval()
        with torch.no_grad():
            outs[impl] = output(m(**kw))
    assert count_fmha_calls, f"{name}: the fmha model never called fmha"
    keep = valid(kw) if valid else None
    for impl in _refs(name):
        a, b = outs["fmha"], outs[impl]
        if keep is not None:
            a, b = a[keep], b[keep]
        _close(f"{name} fmha vs {impl}", a, b)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_training_step_gradients_match_sdpa(built, name):
    _, _, inputs, valid, output, _ = FAMILIES[name]
    models = built(name)
    kw = inputs(2)
    grads, ref = {}, _refs(name)[0]
    for impl in ("fmha", ref):
        m = models[impl]
        m.train()
        m.zero_grad()
        torch.manual_seed(3)  # the same dropout draws in both (dropout is 0 unless configured)
        out = output(m(**kw))
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
        if valid is not None:
            weight = weight * valid(kw).reshape(valid(kw).shape + (1,) * (out.dim() - 2))
        (out * weight).sum().backward()
        grads[impl] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert grads["fmha"].keys() == grads[ref].keys()
    for n, g in grads[ref].items():
        _close(f"{name} d{n}", grads["fmha"][n], g)


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f[5]])
def test_greedy_decoding_matches_sdpa(built, name):
    _, _, inputs, _, _, _ = FAMILIES[name]
    models = built(name)
    kw = {k: v[:1] for k, v in inputs(5).items() if k != "decoder_input_ids"}
    tokens, ref = {}, _refs(name)[0]
    for impl in ("fmha", ref):
        m = models[impl]
        m.eval()
        with torch.no_grad():
            tokens[impl] = m.generate(**kw, max_new_tokens=8, min_new_tokens=8,
                                      do_sample=False)
    assert tokens["fmha"].shape[-1] >= 8
    assert torch.equal(tokens["fmha"], tokens[ref])


def test_a_family_with_its_own_attention_code_never_calls_fmha(count_fmha_calls):
    """DeBERTa-v2 computes its disentangled attention itself (no AttentionInterface call):
    transformers accepts attn_implementation="fmha" for it, but fmha never runs.
    docs/guides/integrations.md lists such families; this pins down that the listing is still true."""
    cfg = transformers.DebertaV2Config(vocab_size=V, hidden_size=32, num_hidden_layers=1,
                                       num_attention_heads=4, intermediate_size=37)
    m = transformers.DebertaV2Model._from_config(cfg, attn_implementation="fmha")
    with torch.no_grad():
        m(input_ids=_ids(1))
    assert not count_fmha_calls
