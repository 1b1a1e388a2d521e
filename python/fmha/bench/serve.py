"""Serving a Hugging Face model on fmha: ``python -m fmha.bench --serve``.

One Llama-style model (random weights from a config, bfloat16), greedy decoding:

    generate    model.generate() at each batch and prompt length, with
                  dynamic+sdpa   transformers' DynamicCache, attn_implementation="sdpa"
                  dynamic+fmha   the same cache on "fmha" (dense K/V every step)
                  paged+fmha     fmha.integrations.transformers.PagedCache, bf16 pools
                  paged8+fmha    PagedCache with int8 pools (dynamic per-row scales)
                reported as tokens/s (new tokens of the batch over the whole call, prefill
                included), the ratio of dynamic+sdpa's call time to this one's (median over
                the reps, the caches alternating within each), the prefill time (a 1-token
                call), the decode time per step ((T(n) - T(1)) / (n - 1)), the KV bytes
                (DynamicCache: held at the end; PagedCache: the pools allocated) and the
                share of a decode step spent in the attention function (timed around it,
                in a separate call).
    batch       model.generate_batch() (continuous batching) with "sdpa" and "fmha" on
                requests of mixed prompt lengths: generated tokens/s.

The default size finishes in a few minutes on two cores; ``--grid`` runs the full grid
(batch 1 and 8, prompts 512 and 4096, 128 new tokens; 8 and 32 concurrent requests).
Needs transformers.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Optional

DEFAULT = dict(batches=(1, 8), prompts=(128,), new_tokens=32, requests=(8,),
               request_lengths=(32, 256), reps=3)
GRID = dict(batches=(1, 8), prompts=(512, 4096), new_tokens=128, requests=(8, 32),
            request_lengths=(64, 2048), reps=1)

CACHES = ("dynamic+sdpa", "dynamic+fmha", "paged+fmha", "paged8+fmha")


def _model(torch, transformers):
    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1376,
                                   num_hidden_layers=8, num_attention_heads=8,
                                   num_key_value_heads=2, max_position_embeddings=8192)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def _kv_bytes(cache) -> int:
    if hasattr(cache, "bytes_allocated"):
        return cache.bytes_allocated()
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values) if t is not None)


class _AttentionTimer:
    """Accumulates the time spent in the model's attention function on decode steps, and
    notes when the first decode step's attention started (``share`` divides by the time from
    there to the end of the call)."""

    def __init__(self, torch, transformers):
        self.mapping = transformers.AttentionInterface._global_mapping
        self.seconds = 0.0
        self.start = None

    def share(self) -> float:
        return self.seconds / max(time.perf_counter() - self.start, 1e-9)

    def __enter__(self):
        self.saved = dict(self.mapping)
        for name in ("sdpa", "fmha"):
            fn = self.saved[name]

            def timed(module, query, *args, _fn=fn, **kwargs):
                t = time.perf_counter()
                out = _fn(module, query, *args, **kwargs)
                if query.shape[2] == 1:
                    self.seconds += time.perf_counter() - t
                    self.start = t if self.start is None else self.start
                return out
            self.mapping[name] = timed
        return self

    def __exit__(self, *exc):
        self.mapping.update(self.saved)


def _generate(torch, transformers, model, batch, prompt, new, reps):
    """Every cache of CACHES at one batch and prompt length; the caches alternate rep by rep,
    so that a host whose speed drifts slows all of them alike."""
    import fmha.integrations.transformers as fh

    g = torch.Generator().manual_seed(batch * 7919 + prompt)
    # Token 0 is the pad token: a prompt never holds it, or generate() would mask it out.
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=g)

    def call(which, n):
        model.set_attn_implementation("sdpa" if which == "dynamic+sdpa" else "fmha")
        if which.startswith("paged"):
            c = fh.PagedCache(model.config, dtype=torch.int8 if which == "paged8+fmha" else None,
                              block_size=16, max_cache_len=prompt + new)
        else:
            c = transformers.DynamicCache(config=model.config)
        t = time.perf_counter()
        out = model.generate(ids, cache=c, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        return time.perf_counter() - t, c, out

    full = {w: [] for w in CACHES}
    first = {w: [] for w in CACHES}
    res = {}
    with torch.no_grad():
        for w in CACHES:
            call(w, 2)  # warm-up
        for _ in range(reps):
            for w in CACHES:
                first[w].append(call(w, 1)[0])
                seconds, c, out = call(w, new)
                full[w].append(seconds)
                res[w] = dict(kv_bytes=_kv_bytes(c), tokens=out[:, prompt:].tolist())
        for w in CACHES:
            with _AttentionTimer(torch, transformers) as timer:
                call(w, new)
                res[w]["attention_share_of_decode"] = timer.share()
    for w in CACHES:
        full_s, first_s = statistics.median(full[w]), statistics.median(first[w])
        res[w].update(tokens_per_s=batch * new / full_s, prefill_s=first_s,
                      decode_step_s=(full_s - first_s) / (new - 1),
                      sdpa_over_this=statistics.median(
                          a / b for a, b in zip(full["dynamic+sdpa"], full[w])))
    return res


def _batch(torch, transformers, model, impl, requests, lengths, new):
    model.set_attn_implementation(impl)
    g = torch.Generator().manual_seed(requests)
    lo, hi = lengths
    sizes = torch.randint(lo, hi + 1, (requests,), generator=g).tolist()
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=g).tolist()
               for n in sizes]
    gen = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1,
                                        pad_token_id=0)
    page = 16
    blocks = sum(-(-(n + new) // page) for n in sizes) + 2 * requests
    cb = transformers.ContinuousBatchingConfig(page_size=page, num_blocks=blocks,
                                               max_batch_tokens=512,
                                               max_blocks_per_request=-(-(hi + new) // page) + 2)
    with torch.no_grad():
        t = time.perf_counter()
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                   warmup=False)
        seconds = time.perf_counter() - t
    tokens = [out[f"req_{i}"].generated_tokens for i in range(requests)]
    return dict(tokens_per_s=sum(len(t) for t in tokens) / seconds, seconds=seconds,
                prompt_lengths=sizes, tokens=tokens)


def run(out_path: Optional[str], threads: Optional[int], grid: bool = False, save=None):
    """The generate() and generate_batch() comparisons (grid: the full grid)."""
    import logging

    import torch
    import transformers

    import fmha
    import fmha.integrations.transformers as fh

    from ._host import host_meta, write_result

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    if threads:
        torch.set_num_threads(threads)
    size = GRID if grid else DEFAULT
    print(f"fmha {fmha.__version__} | CPU ISA {fmha.cpu_isa()} | threads "
          f"{fmha.get_num_threads()} | torch {torch.__version__} | transformers "
          f"{transformers.__version__}", flush=True)
    load_before = os.getloadavg()
    model = _model(torch, transformers)
    c = model.config
    desc = (f"Llama-style, {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
            f"{c.num_attention_heads} query / {c.num_key_value_heads} kv heads of "
            f"{c.hidden_size // c.num_attention_heads}, bfloat16, random weights; greedy")
    print(desc, flush=True)
    rows = []
    for prompt in size["prompts"]:
        for batch in size["batches"]:
            res = _generate(torch, transformers, model, batch, prompt, size["new_tokens"],
                            size["reps"])
            ref = res["dynamic+sdpa"]["tokens"]
            for w, r in res.items():
                r["same_tokens_as_sdpa"] = r.pop("tokens") == ref
                rows.append(dict(kind="generate", cache=w, batch=batch, prompt=prompt,
                                 new_tokens=size["new_tokens"], **r))
                print(f"generate {w:13s} batch {batch:2d} prompt {prompt:5d}: "
                      f"{r['tokens_per_s']:8.1f} tok/s, prefill {r['prefill_s'] * 1e3:8.1f} ms,"
                      f" step {r['decode_step_s'] * 1e3:7.2f} ms, sdpa/this "
                      f"{r['sdpa_over_this']:.2f}x, KV "
                      f"{r['kv_bytes'] / 2**20:7.2f} MiB, attention "
                      f"{r['attention_share_of_decode'] * 100:4.1f}% of a step, same tokens "
                      f"as sdpa: {r['same_tokens_as_sdpa']}", flush=True)
    for requests in size["requests"]:
        res = {impl: _batch(torch, transformers, model, impl, requests,
                            size["request_lengths"], size["new_tokens"])
               for impl in ("sdpa", "fmha")}
        same = res["sdpa"]["tokens"] == res["fmha"]["tokens"]
        for impl, r in res.items():
            r.pop("tokens")
            rows.append(dict(kind="generate_batch", impl=impl, requests=requests,
                             new_tokens=size["new_tokens"], same_tokens_as_sdpa=same, **r))
            print(f"generate_batch {impl:4s} {requests:3d} requests (prompts "
                  f"{min(r['prompt_lengths'])}..{max(r['prompt_lengths'])}): "
                  f"{r['tokens_per_s']:8.1f} tok/s ({r['seconds']:.1f} s), same tokens as "
                  f"sdpa: {same}", flush=True)
    result = dict(meta=dict(host_meta(torch, fmha), fmha_threads=fmha.get_num_threads(),
                            transformers=transformers.__version__,
                            transformers_tested=fh.TESTED_TRANSFORMERS,
                            # Other processes' load: the one-minute load average at start / end.
                            load_average=[load_before[0], os.getloadavg()[0]]),
                  model=desc, grid=grid, size={k: list(v) if isinstance(v, tuple) else v
                                               for k, v in size.items()}, rows=rows)
    write_result(result, out_path, save)
    return result
