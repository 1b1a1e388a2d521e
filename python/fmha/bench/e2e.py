"""Whole models on fmha against the same models on torch SDPA: ``python -m fmha.bench --e2e``.

What a user of the Hugging Face integration sees, in one run on the same weights and inputs
(random weights, no download):

    vit     ViT-B/16 forward, batch 8, 224x224 images (197 tokens, 12 heads of 64): one call
            per layer of attention at a medium shape, between GEMMs that torch runs
    decode  greedy decoding with a Llama-style model (GQA, transformers' own KV cache): one
            attention call per layer per token, the call a serving loop makes the most

each with ``attn_implementation="fmha"`` and ``"sdpa"``, alternating the two so that a
drifting machine affects both alike. Reported: the median time of a ViT forward, and for
decoding the time to the first token (the prefill) and the median per-token latency of the
tokens after it; the ratio is SDPA's time / fmha's in the same rep, the median over reps
(> 1: fmha is faster). Needs transformers
(``pip install ".[test]"``).
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

from ._host import median_seconds


def _vit(torch, impls, reps, small=False):
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    # ViT-B/16 at 224x224 (small: a two-layer stand-in for the tests, same code path)
    cfg = (ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, image_size=32, patch_size=8) if small
           else ViTConfig())
    model = ViTModel(cfg, add_pooling_layer=False).eval()
    pixels = torch.randn(8, 3, cfg.image_size, cfg.image_size)
    # The implementations alternate rep by rep, so that a host whose speed drifts slows
    # both alike; the ratio is the median of each rep's pair.
    times = {i: [] for i in impls}
    with torch.no_grad():
        for impl in impls:  # warm-up
            model.set_attn_implementation(impl)
            model(pixel_values=pixels)
        for _ in range(reps):
            for impl in impls:
                model.set_attn_implementation(impl)
                times[impl].append(median_seconds(lambda: model(pixel_values=pixels), 1,
                                                  warmup=0))
    name = ("ViT stand-in (2 layers)" if small
            else "ViT-B/16 (transformers ViTModel, default config)")
    return dict(model=f"{name}, batch 8, {cfg.image_size}x{cfg.image_size}",
                seconds={i: statistics.median(v) for i, v in times.items()},
                sdpa_over_fmha=_paired_ratio(times))


def _paired_ratio(times) -> float:
    """Median over reps of sdpa's time / fmha's time in the same rep."""
    return statistics.median(s / f for f, s in zip(times["fmha"], times["sdpa"]))


def _decode(torch, impls, reps, small=False, new_tokens=32, prompt=64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=64 if small else 512,
                      intermediate_size=128 if small else 1376,
                      num_hidden_layers=2 if small else 8, num_attention_heads=8,
                      num_key_value_heads=2, max_position_embeddings=1024)
    if small:
        new_tokens, prompt = 4, 8
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, prompt))
    per_token, first = {i: [] for i in impls}, {i: [] for i in impls}
    tokens = {}

    def run(impl):
        model.set_attn_implementation(impl)
        stamps = []

        class Clock:  # a streamer: called with the prompt, then once per new token
            def put(self, _):
                stamps.append(time.perf_counter())

            def end(self):
                pass

        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, streamer=Clock(), pad_token_id=0)
        # stamps[0]: the prompt was handed over; stamps[1]: the first new token.
        first[impl].append(stamps[1] - t0)
        per_token[impl].append(statistics.median(
            b - a for a, b in zip(stamps[1:], stamps[2:])))
        tokens[impl] = out[0, prompt:].tolist()

    with torch.no_grad():
        for impl in impls:
            run(impl)  # warm-up
        for _ in range(reps):
            for impl in impls:
                run(impl)
    return dict(model=f"Llama-style, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
                      f"{cfg.num_attention_heads} query / {cfg.num_key_value_heads} kv heads "
                      f"of {cfg.hidden_size // cfg.num_attention_heads}; prompt {prompt}, "
                      f"{new_tokens} new tokens, greedy",
                first_token_seconds={i: statistics.median(v) for i, v in first.items()},
                per_token_seconds={i: statistics.median(v) for i, v in per_token.items()},
                per_token_sdpa_over_fmha=_paired_ratio(per_token),
                same_tokens=len({tuple(t) for t in tokens.values()}) == 1)


def run(out_path: Optional[str], threads: Optional[int], reps: int = 5, small: bool = False,
        save=None):
    """Both models, fmha and sdpa; small=True: two-layer stand-ins (tests); save: a _host.Save
    (the host's results file)."""
    import torch

    import fmha
    import fmha.integrations.transformers  # noqa: F401  (registers "fmha")

    from ._host import host_meta, write_result

    if threads:
        torch.set_num_threads(threads)
    impls = ("fmha", "sdpa")
    print(f"fmha {fmha.__version__} | CPU ISA {fmha.cpu_isa()} | threads "
          f"{fmha.get_num_threads()} | torch {torch.__version__}", flush=True)
    vit = _vit(torch, impls, reps, small)
    s = vit["seconds"]
    print(f"{vit['model']}: fmha {s['fmha'] * 1e3:.1f} ms, sdpa {s['sdpa'] * 1e3:.1f} ms "
          f"(sdpa/fmha, median of the {reps} alternated pairs: {vit['sdpa_over_fmha']:.3f}x)",
          flush=True)
    dec = _decode(torch, impls, reps, small)
    f, p = dec["first_token_seconds"], dec["per_token_seconds"]
    print(f"{dec['model']}: first token fmha {f['fmha'] * 1e3:.2f} ms, sdpa "
          f"{f['sdpa'] * 1e3:.2f} ms; per token fmha {p['fmha'] * 1e3:.3f} ms, sdpa "
          f"{p['sdpa'] * 1e3:.3f} ms (sdpa/fmha, median of the {reps} alternated pairs: "
          f"{dec['per_token_sdpa_over_fmha']:.3f}x); same tokens: "
          f"{dec['same_tokens']}", flush=True)
    result = dict(meta=dict(host_meta(torch, fmha), fmha_threads=fmha.get_num_threads()),
                  reps=reps, vit=vit, decode=dec)
    write_result(result, out_path, save)
    return result
