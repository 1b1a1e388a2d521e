"""Serve a batch of prompts through Hugging Face continuous batching on fmha.

A small Llama-style model is built from a config (random weights, nothing downloaded), then
the same prompts are served with ``model.generate_batch()`` twice: on ``"sdpa"`` and on
``"fmha"``. Prints the generated tokens/s of each and whether the greedy tokens agree.

    python examples/serve_hf.py [--requests 16] [--new-tokens 32] [--dtype float32]

In float32 the two produce the same tokens; in bfloat16 their roundings differ, and a few
tokens may too.
"""

import argparse
import copy
import logging
import time

import torch
import transformers

import fmha.integrations.transformers  # noqa: F401  (registers attn_implementation="fmha")


def build(dtype):
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688,
                                      num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def serve(model, impl, prompts, new_tokens):
    model.set_attn_implementation(impl)
    gen = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False,
                                        eos_token_id=-1, pad_token_id=0)
    # A pool sized for the requests (pages of 16 tokens), not a share of the host's memory.
    pages = sum(-(-(len(p) + new_tokens) // 16) for p in prompts) + 2 * len(prompts)
    cb = transformers.ContinuousBatchingConfig(page_size=16, num_blocks=pages,
                                               max_batch_tokens=256)
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                   warmup=False)
        seconds = time.perf_counter() - start
    tokens = [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]
    return tokens, sum(map(len, tokens)) / seconds


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    a = ap.parse_args(argv)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    model = build(getattr(torch, a.dtype))
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(16, 200, (a.requests,), generator=g).tolist()
    prompts = [torch.randint(1, 2048, (n,), generator=g).tolist() for n in lengths]
    results = {impl: serve(copy.deepcopy(model), impl, prompts, a.new_tokens)
               for impl in ("sdpa", "fmha")}
    print(f"{a.requests} requests, prompts {min(lengths)}..{max(lengths)} tokens, "
          f"{a.new_tokens} new tokens each, {a.dtype}, torch threads {torch.get_num_threads()}")
    for impl, (_, rate) in results.items():
        print(f"  {impl:5s} {rate:8.1f} tokens/s")
    same = results["sdpa"][0] == results["fmha"][0]
    print(f"  same greedy tokens: {same}")
    return results


if __name__ == "__main__":
    main()
