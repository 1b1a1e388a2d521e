"""Serving Hugging Face models on fmha: transformers' continuous batching (generate_batch)
and generate() on fmha's paged pools (PagedCache), for tiny models built from configs.

On the CPU, greedy tokens equal those of the reference implementation with a DynamicCache
("sdpa"; "eager" for Gemma 2 and gpt-oss, whose softcap / sinks "sdpa" lacks) in float32,
and counting wrappers around the kernel entry points show that fmha computed every layer.

On CUDA (the ``cuda`` cases, skipped without a GPU; tools/gpu_check.sh runs them) the same
paths run fmha's CUDA kernels, which take float16/bfloat16 only: the models run in bfloat16
(float16 under 8-bit pools), so tokens cannot be compared for identity with a float32
reference. Instead every token fmha chose must be the float32 reference's greedy choice up
to what the tested logit error allows (``_assert_near_greedy``), teacher-forced logits stay
within the bounds of the CPU tests, the counting wrappers see CUDA tensors only, and no call
was refused on the device (``fmha.kvcache.check_refused``). Without a GPU,
``test_every_tensor_follows_the_device`` checks on the "meta" device that everything the
integration allocates follows the model's device.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fmha._paged  # noqa: E402
import fmha.integrations.transformers as fmha_hf  # noqa: E402  (registers "fmha")
from fmha.kvcache import check_refused  # noqa: E402

V = 97
NEW = 6

CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA GPU: run by tools/gpu_check.sh")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
#: The relative logit error (of max |logit|) bfloat16 serving is held to, on the CPU and on
#: CUDA (test_bf16_paged_cache_logits_within_tolerance).
BF16_BOUND = 0.02


def _small(**extra):
    base = dict(vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    base.update(extra)
    return base


FAMILIES = {
    "llama-gqa": ("LlamaForCausalLM", transformers.LlamaConfig(**_small()), "sdpa"),
    "mistral-sliding-window": ("MistralForCausalLM",
                               transformers.MistralConfig(**_small(sliding_window=5)), "sdpa"),
    "qwen2": ("Qwen2ForCausalLM", transformers.Qwen2Config(**_small()), "sdpa"),
    # Alternating sliding (window 5) and full layers, softcapped scores.
    "gemma2-softcap": ("Gemma2ForCausalLM", transformers.Gemma2Config(**_small(
        head_dim=8, attn_logit_softcapping=2.0, final_logit_softcapping=5.0, sliding_window=5,
        query_pre_attn_scalar=8)), "eager"),
    # Sinks, a sliding and a full layer, experts.
    "gpt-oss-sinks": ("GptOssForCausalLM", transformers.GptOssConfig(**_small(
        hidden_size=64, intermediate_size=64, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"])), "eager"),
}


def _build(name, impl, dtype=torch.float32):
    cls, cfg, _ = FAMILIES[name]
    torch.manual_seed(0)
    model = getattr(transformers, cls)._from_config(copy.deepcopy(cfg), attn_implementation=impl)
    if name == "gpt-oss-sinks":
        with torch.no_grad():   # sinks that matter: some rows put most of their mass on them
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-2.0, 3.0, 4))
    return model.to(dtype).eval()


_BUILT = {}


def _pair(name):
    """(reference model, fmha model) with the same weights, built once per module."""
    if name not in _BUILT:
        ref = _build(name, FAMILIES[name][2])
        mod = _build(name, "fmha")
        mod.load_state_dict(ref.state_dict())
        _BUILT[name] = (ref, mod)
    return _BUILT[name]


_ON_CUDA = {}


def _cuda_model(name, dtype=torch.bfloat16):
    """The fmha model of _pair(name) on CUDA in ``dtype`` (the CUDA kernels take float16 and
    bfloat16 only), built once per module."""
    if (name, dtype) not in _ON_CUDA:
        _ON_CUDA[name, dtype] = copy.deepcopy(_pair(name)[1]).to("cuda", dtype)
    return _ON_CUDA[name, dtype]


def _assert_near_greedy(ref, prompt, generated, bound=BF16_BOUND):
    """Each token of ``generated`` (after the unpadded ``prompt``) is the float32 reference's
    greedy choice up to a logit error of ``bound`` * max |logit|: if fmha's logits are within
    e of the reference's, the token fmha picks has a reference logit at most 2e below the
    best. Ties that bfloat16 may break either way pass; a token a wrong attention picked
    does not."""
    ids = torch.tensor([list(prompt) + list(generated)])
    with torch.no_grad():
        logits = ref(ids).logits[0, len(prompt) - 1:-1].float()
    chosen = logits.gather(-1, torch.tensor(list(generated))[:, None])[:, 0]
    gap = (logits.max(-1).values - chosen).max().item()
    allowed = 2 * bound * logits.abs().max().item()
    assert gap <= allowed, (f"a generated token's reference logit is {gap:.3g} below the best, "
                            f"more than the {allowed:.3g} a {bound} logit error allows")


def _prompts(seed=1, lengths=(5, 13, 8, 11)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (n,), generator=g).tolist() for n in lengths]


class _Calls(dict):
    """Calls per entry point, and the device types of the queries they were given."""

    def __init__(self):
        super().__init__(varlen=0, paged=0, pool=0)
        self.devices = set()


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the fmha entry points the serving paths call (varlen prefill, paged decode
    over transformers' pages, and PagedCache's pool), and records their queries' devices
    (on CUDA tensors the entries run the CUDA kernels)."""
    calls = _Calls()

    def counting(key, real):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            calls.devices.add(args[0].device.type)
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(fmha_hf, "attention_varlen", counting("varlen", fmha_hf.attention_varlen))
    monkeypatch.setattr(fmha_hf, "attention_with_kvcache",
                        counting("paged", fmha_hf.attention_with_kvcache))
    monkeypatch.setattr(fmha._paged, "attention_with_kvcache",
                        counting("pool", fmha._paged.attention_with_kvcache))
    return calls


def _cb_config():
    # A small pool (page size 4: requests span several pages), no CUDA-graph padding.
    return transformers.ContinuousBatchingConfig(page_size=4, num_blocks=96, max_batch_tokens=64,
                                                 max_blocks_per_request=16)


def _generate_batch(model, prompts):
    gen = transformers.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1,
                                        pad_token_id=0)
    with torch.no_grad():
        out = model.generate_batch(prompts, generation_config=gen,
                                   continuous_batching_config=_cb_config(), warmup=False)
    return [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_generate_batch_matches_reference(name, device, kernel_calls):
    ref, mod = _pair(name)
    prompts = _prompts()
    if device == "cpu":
        expected = _generate_batch(ref, prompts)
        assert sum(kernel_calls.values()) == 0
        got = _generate_batch(mod, prompts)
        assert got == expected
    else:
        mod = _cuda_model(name)
        got = _generate_batch(mod, prompts)
        assert all(len(t) == NEW for t in got)
        for prompt, tokens in zip(prompts, got):
            _assert_near_greedy(ref, prompt, tokens)
        check_refused()
    assert kernel_calls.devices == {device}
    layers = mod.config.num_hidden_layers
    # Every layer of every forward ran on fmha: at least the prefill and NEW - 1 decode steps.
    assert kernel_calls["varlen"] + kernel_calls["paged"] >= layers * NEW
    assert kernel_calls["varlen"] % layers == 0 and kernel_calls["paged"] % layers == 0
    if name in ("llama-gqa", "qwen2"):
        # Full attention only: decode-only steps read transformers' pages in place.
        assert kernel_calls["paged"] > 0
    else:
        # A sliding layer: transformers (5.24) has no block table for it, so every step
        # comes packed (each request's rows gathered by its cache).
        assert kernel_calls["paged"] == 0


def _padded_batch(seed=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :7] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_generate_on_paged_cache_matches_reference(name, device, kernel_calls):
    ref, mod = _pair(name)
    ids, mask = _padded_batch()
    kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    if device == "cpu":
        with torch.no_grad():
            expected = ref.generate(ids, **kw)
            cache = fmha_hf.PagedCache(mod.config, block_size=3, max_cache_len=32)
            got = mod.generate(ids, cache=cache, **kw)
        assert got.tolist() == expected.tolist()
    else:
        mod = _cuda_model(name)
        with torch.no_grad():
            cache = fmha_hf.PagedCache(mod.config, block_size=3, max_cache_len=32)
            got = mod.generate(ids.cuda(), cache=cache, **{**kw, "attention_mask": mask.cuda()})
        check_refused()
        assert cache.pool.device.type == "cuda" and cache.pool.dtype == torch.bfloat16
        for row, m in zip(got.cpu(), mask):
            prompt = row[:12][m.bool()].tolist()
            _assert_near_greedy(ref, prompt, row[12:].tolist())
    assert kernel_calls.devices == {device}
    layers = mod.config.num_hidden_layers
    # Prefill: one call per padded sequence and layer; then one per decode step and layer.
    assert kernel_calls["pool"] == layers * (3 + NEW - 1)
    assert cache.get_seq_length() == 12 + NEW - 1
    # Padding is not stored: sequence b holds its real tokens and the new ones.
    assert [cache.pool.length(s) for s in cache._ids] == [12 + NEW - 1, 8 + NEW - 1, 5 + NEW - 1]


@pytest.mark.parametrize("name", ["llama-gqa", "gemma2-softcap"])
def test_beam_search_on_paged_cache(name, kernel_calls):
    ref, mod = _pair(name)
    ids, mask = _padded_batch(seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
              num_beams=3)
    with torch.no_grad():
        expected = ref.generate(ids, **kw)
        got = mod.generate(ids, cache=fmha_hf.PagedCache(mod.config, block_size=4,
                                                                   max_cache_len=32), **kw)
    assert got.tolist() == expected.tolist()
    assert kernel_calls["pool"] > 0


@CUDA
def test_beam_search_on_paged_cache_on_cuda(kernel_calls, monkeypatch):
    """Beam search on CUDA: the beams' reordering forks sequences of pools on the GPU (blocks
    copied on write there) and every step runs the CUDA decode. Which beam wins may differ
    from the float32 reference in bfloat16, so the tokens are checked on the CPU only
    (test_beam_search_on_paged_cache); here, that the search runs through the pools on
    CUDA, forks, and keeps each prompt."""
    forks = []
    real_fork = fmha._paged.PagedKVCache.fork
    monkeypatch.setattr(fmha._paged.PagedKVCache, "fork",
                        lambda self, seq: forks.append(seq) or real_fork(self, seq))
    mod = _cuda_model("llama-gqa")
    ids, mask = _padded_batch(seed=4)
    with torch.no_grad():
        got = mod.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=NEW,
                           do_sample=False, pad_token_id=0, num_beams=3,
                           cache=fmha_hf.PagedCache(mod.config, block_size=4, max_cache_len=32))
    check_refused()
    assert got.shape == (3, 12 + NEW) and torch.equal(got[:, :12].cpu(), ids)
    assert forks and kernel_calls["pool"] > 0 and kernel_calls.devices == {"cuda"}


def _stepwise_logits(model, ids, tokens, cache):
    """Teacher-forced logits: the prompt, then the given tokens one at a time."""
    out = []
    with torch.no_grad():
        logits = model(ids, cache=cache, use_cache=True).logits[:, -1]
        out.append(logits.float())
        for t in tokens.T:
            logits = model(t[:, None], cache=cache, use_cache=True).logits[:, -1]
            out.append(logits.float())
    return torch.stack(out, 1)


def _forced(name, dtype):
    """Reference float32 greedy tokens, then float32 logits of the reference and
    teacher-forced logits of fmha at ``dtype`` pools."""
    ref, mod = _pair(name)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, V, (4, 24), generator=g)
    with torch.no_grad():
        seq = ref.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
    tokens = seq[:, 24:-1]
    expected = _stepwise_logits(ref, ids, tokens, transformers.DynamicCache(config=ref.config))
    return ref, mod, ids, tokens, expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype,bound", [("int8", 0.01), ("float8_e4m3fn", 0.02)])
def test_8bit_paged_cache_token_agreement_and_logit_error(cache_dtype, bound, device,
                                                          kernel_calls):
    """8-bit pools (dynamic per-row scales) on a float32 Llama (on CUDA, whose kernels take no
    float32, a float16 one: its own error is a tenth of the bounds): teacher-forced logits
    within ``bound`` of the float32 reference's range, and greedy tokens mostly the same."""
    ref, mod, ids, tokens, expected = _forced("llama-gqa", torch.float32)
    if device == "cuda":
        mod, ids, tokens = _cuda_model("llama-gqa", torch.float16), ids.cuda(), tokens.cuda()
    dt = getattr(torch, cache_dtype)
    got = _stepwise_logits(mod, ids, tokens, fmha_hf.PagedCache(mod.config, dtype=dt,
                                                                 block_size=8, max_cache_len=48))
    got = got.cpu()
    if device == "cuda":
        check_refused()
    assert kernel_calls["pool"] > 0 and kernel_calls.devices == {device}
    err = (got - expected).abs().max().item() / expected.abs().max().item()
    assert err <= bound, f"{cache_dtype}: relative logit error {err:.3g} > {bound}"
    # Nonzero: the pools really hold 8-bit codes.
    assert err > 0
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agree >= 0.95, f"{cache_dtype}: greedy agreement {agree:.2f}"


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_paged_cache_logits_within_tolerance(device, kernel_calls):
    """bfloat16 model and pools: teacher-forced logits within 2% of the float32 reference's
    range, like "sdpa" with a DynamicCache in bfloat16 (whose error is measured alongside)."""
    ref, mod, ids, tokens, expected = _forced("llama-gqa", torch.float32)
    ref16 = copy.deepcopy(ref).to(device, torch.bfloat16)
    mod16 = copy.deepcopy(mod).to(device, torch.bfloat16)
    ids, tokens = ids.to(device), tokens.to(device)
    scale = expected.abs().max().item()
    sdpa = _stepwise_logits(ref16, ids, tokens, transformers.DynamicCache(config=ref16.config))
    got = _stepwise_logits(mod16, ids, tokens, fmha_hf.PagedCache(mod16.config, block_size=8,
                                                                   max_cache_len=48))
    if device == "cuda":
        check_refused()
    assert kernel_calls["pool"] > 0 and kernel_calls.devices == {device}
    err = (got.cpu() - expected).abs().max().item() / scale
    err_sdpa = (sdpa.cpu() - expected).abs().max().item() / scale
    assert err <= BF16_BOUND, f"bf16 fmha relative logit error {err:.3g} (sdpa {err_sdpa:.3g})"


def test_a_checkpoint_loaded_with_from_pretrained(tmp_path):
    """A checkpoint written by save_pretrained (a deterministic tiny Qwen2) and loaded with
    attn_implementation="fmha" serves the same tokens through both paths."""
    ref, _ = _pair("qwen2")
    ref.save_pretrained(tmp_path)
    mod = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="fmha",
                                                            dtype=torch.float32).eval()
    prompts = _prompts(seed=5, lengths=(9, 4))
    assert _generate_batch(mod, prompts) == _generate_batch(ref, prompts)
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        expected = ref.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        got = mod.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                           cache=fmha_hf.PagedCache(mod.config, block_size=5))
    assert got.tolist() == expected.tolist()


def test_unsupported_options_raise_naming_them():
    ref, mod = _pair("llama-gqa")
    ids = torch.tensor([_prompts()[1]])
    with torch.no_grad():
        with pytest.raises(ValueError, match="output_attentions"):
            mod(ids, cache=fmha_hf.PagedCache(mod.config), use_cache=True,
                output_attentions=True)
        with pytest.raises(ValueError, match="attn_implementation"):
            ref(ids, cache=fmha_hf.PagedCache(ref.config), use_cache=True)
        with pytest.raises(TypeError, match="dtype"):
            mod(ids, cache=fmha_hf.PagedCache(mod.config, dtype=torch.bfloat16),
                use_cache=True)
        with pytest.raises(NotImplementedError, match="crop"):
            fmha_hf.PagedCache(mod.config).crop(1)
        with pytest.raises(ValueError, match="block_size"):
            fmha_hf.PagedCache(mod.config, block_size=0)
        # Pools on another device than the model's: refused before anything is allocated.
        cache = fmha_hf.PagedCache(mod.config, device="meta")
        with pytest.raises(ValueError, match="device: PagedCache's pools are on meta"):
            mod(ids, cache=cache, use_cache=True)
        assert cache.pool is None
        # A step that does not fit is refused before anything is written: no block taken.
        cache = fmha_hf.PagedCache(mod.config, max_cache_len=4, block_size=2)
        with pytest.raises(ValueError, match="n:"):
            mod(ids, cache=cache, use_cache=True)
        assert cache.pool.num_free_blocks == cache.pool.num_blocks
        assert cache.get_seq_length() == 0


def _layer_calls(cache, q, k, v, layers=2):
    """One model step through PagedCache: every layer's Cache.update, then its attention."""
    module = torch.nn.Module()
    for layer in range(layers):
        kw = {}
        cache.update(k, v, layer, kwargs=kw)
        out, _ = fmha_hf.fmha_attention_forward(module, q, k, v, None, scaling=0.3, **kw)
        assert out.device == q.device and out.shape == q.transpose(1, 2).shape
    return out


def _cb_decode_kwargs(device, n=3):
    """A decode-only continuous-batching step's keyword arguments (n requests), on device."""
    i32 = dict(dtype=torch.int32, device=device)
    return dict(cu_seq_lens_q=torch.arange(n + 1, **i32),
                cu_seq_lens_k=torch.tensor([0, 4, 9, 11][:n + 1], **i32),
                max_length_q=1, max_length_k=5,
                block_table=torch.tensor([[0, 1, -1], [2, 3, -1], [4, -1, -1]][:n], **i32),
                k_cache=torch.empty(6, 4, 2, 8, dtype=torch.bfloat16, device=device),
                v_cache=torch.empty(6, 4, 2, 8, dtype=torch.bfloat16, device=device))


@pytest.mark.parametrize("pool_dtype", ["bfloat16", "int8"])
def test_every_tensor_follows_the_device(pool_dtype, monkeypatch):
    """Without a GPU: on the "meta" device (shapes and devices, no data), every tensor the
    integration makes or hands to a kernel -- PagedCache's pools and scales, the lengths and
    block tables of each step (copy-on-write after a reorder included), the continuous-
    batching decode's lengths and table and the varlen offsets -- is on the model's device,
    so none would be a CPU tensor beside CUDA ones. The kernel entries are stand-ins that
    record the devices of what they get and return an empty result there."""
    seen = []

    def recording(real_name):
        def stand_in(q, k_or_cache, v_or_cache, *args, **kwargs):
            seen.extend((real_name, name, x.device.type) for name, x in
                        [("q", q), ("k/k_cache", k_or_cache), ("v/v_cache", v_or_cache)]
                        + [(str(i), a) for i, a in enumerate(args)] + list(kwargs.items())
                        if isinstance(x, torch.Tensor))
            if real_name == "varlen":
                return torch.empty(q.shape[:2] + (v_or_cache.shape[-1],), dtype=q.dtype,
                                   device=q.device)
            return torch.empty(q.shape[:3] + (v_or_cache.shape[-1],), dtype=q.dtype,
                               device=q.device)
        return stand_in

    monkeypatch.setattr(fmha._paged, "attention_with_kvcache", recording("pool"))
    monkeypatch.setattr(fmha_hf, "attention_with_kvcache", recording("paged"))
    monkeypatch.setattr(fmha_hf, "attention_varlen", recording("varlen"))
    _, mod = _pair("llama-gqa")
    meta = dict(dtype=torch.bfloat16, device="meta")
    cache = fmha_hf.PagedCache(mod.config, dtype=getattr(torch, pool_dtype), block_size=4)
    for n in (5, 1):          # prefill, one decode step
        _layer_calls(cache, torch.empty(2, 4, n, 8, **meta), *[torch.empty(2, 2, n, 8, **meta)] * 2)
    cache.reorder_cache(torch.tensor([1, 1]))    # both rows continue row 1: copy on write
    _layer_calls(cache, torch.empty(2, 4, 1, 8, **meta), *[torch.empty(2, 2, 1, 8, **meta)] * 2)
    pools = [cache.pool.k_pool(0), cache.pool.v_pool(1)]
    if pool_dtype == "int8":
        pools += [cache.pool.k_scale(0), cache.pool.v_scale(1)]
    assert [p.device.type for p in pools] == ["meta"] * len(pools)
    # Continuous batching: a decode-only step through the block table, then a packed one.
    module = torch.nn.Module()
    kw = _cb_decode_kwargs("meta")
    fmha_hf.fmha_attention_forward(module, torch.empty(1, 4, 3, 8, **meta),
                                   *[torch.empty(1, 2, 3, 8, **meta)] * 2, None, **kw)
    for key in ("block_table", "k_cache", "v_cache"):
        del kw[key]
    fmha_hf.fmha_attention_forward(module, torch.empty(1, 4, 3, 8, **meta),
                                   *[torch.empty(1, 2, 11, 8, **meta)] * 2, None, **kw)
    entries = {entry for entry, _, _ in seen}
    assert entries == {"pool", "paged", "varlen"}
    assert [x for x in seen if x[2] != "meta"] == []
    names = {name for _, name, _ in seen}
    assert {"cache_seqlens", "block_table"} <= names
    if pool_dtype == "int8":
        assert {"k_scale", "v_scale"} <= names


def _refused_float32(device):
    """The two serving paths with a float32 model on ``device`` (not the CPU)."""
    _, mod = _pair("llama-gqa")
    f32 = dict(dtype=torch.float32, device=device)
    cache = fmha_hf.PagedCache(mod.config)
    with pytest.raises(NotImplementedError, match="dtype: the model runs in float32 on"):
        _layer_calls(cache, torch.empty(2, 4, 5, 8, **f32), *[torch.empty(2, 2, 5, 8, **f32)] * 2)
    assert cache.pool is None          # refused before the pools were allocated
    kw = _cb_decode_kwargs(device)
    with pytest.raises(NotImplementedError, match="float32 .*continuous batching"):
        fmha_hf.fmha_attention_forward(torch.nn.Module(), torch.empty(1, 4, 3, 8, **f32),
                                       *[torch.empty(1, 2, 3, 8, **f32)] * 2, None, **kw)


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=CUDA)])
def test_float32_off_the_cpu_is_refused_naming_the_dtype(device):
    """fmha's CUDA kernels take float16/bfloat16: a float32 model on CUDA (on any device but
    the CPU: "meta" checks it without a GPU) is refused by both serving paths, naming the
    dtype, before a pool is allocated; nothing falls back to another device or dtype."""
    _refused_float32(device)


def test_kwargs_fmha_does_not_use_are_ignored():
    """The attention function on the continuous-batching path ignores transformers' other
    keyword arguments (the read/write indices, the cache object, position ids, ...)."""
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 4, 7, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    module = torch.nn.Module()
    out, w = fmha_hf.fmha_attention_forward(
        module, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4,
        max_length_k=4, read_index=[torch.arange(3)], write_index=[], cache=object(),
        position_ids=torch.arange(7)[None], logits_indices=torch.tensor([2, 6]), unknown=1)
    assert w is None and out.shape == (1, 7, 4, 8)
    for lo, hi in ((0, 3), (3, 7)):
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], is_causal=True, scale=0.3,
            enable_gqa=True)
        torch.testing.assert_close(out[0, lo:hi], expected[0].transpose(0, 1))


def test_example_serve_hf_short_run():
    """examples/serve_hf.py, three short requests: both implementations serve the same
    float32 greedy tokens."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "serve_hf.py"
    spec = importlib.util.spec_from_file_location("serve_hf", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    results = example.main(["--requests", "3", "--new-tokens", "3"])
    assert results["sdpa"][0] == results["fmha"][0]
    assert all(len(t) == 3 for t in results["fmha"][0])
