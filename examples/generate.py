"""Greedy decoding with a small Llama-style decoder, through fmha's paged KV cache and torch SDPA.

The model (token embeddings, RMSNorm, rotary position embeddings, grouped-query attention,
SwiGLU MLP) is randomly initialised from a seed; nothing is downloaded. The same weights
generate from the same prompt batch twice:

  fmha   ``fmha.kvcache.PagedKVCache``: the prompt is prefilled through the cache (causal
         attention over the new rows) and each new token is one reserve -> attention per
         layer -> commit step; the cache is a pool of fixed-size blocks.
  torch  ``torch.nn.functional.scaled_dot_product_attention`` over a cache grown with
         ``torch.cat`` at every step.

Everything but attention is the same float32 arithmetic, so the greedy tokens must be the
same; the exit status is 1 when they are not. Prints, for both: time to first token
(prefill), the median time of one decode step (one token for every sequence), decode
tokens/s and the KV cache's bytes::

    python examples/generate.py --threads 2 --json generate.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import fmha
from fmha.bench import cpu_model
from fmha.kvcache import PagedKVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (batch, seqlen, heads, head_dim), rotate-half convention;
    cos, sin (seqlen, head_dim // 2) for the rows' positions."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    """x + attention(norm(x)), then x + SwiGLU(norm(x))."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.attn_norm = RMSNorm(hidden)
        self.wq = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x, cos, sin, attend):
        b, n, _ = x.shape
        h = self.attn_norm(x)
        q = rotate(self.wq(h).view(b, n, self.heads, self.head_dim), cos, sin)
        k = rotate(self.wk(h).view(b, n, self.kv_heads, self.head_dim), cos, sin)
        v = self.wv(h).view(b, n, self.kv_heads, self.head_dim)
        x = x + self.wo(attend(q, k, v).reshape(b, n, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    def __init__(self, vocab: int, hidden: int, heads: int, kv_heads: int, layers: int,
                 max_len: int, theta: float = 10000.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, kv_heads, 4 * hidden)
                                    for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        d = hidden // heads
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32),
                             theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor, start: int, cache) -> torch.Tensor:
        """Logits of the last position of tokens (batch, n), the rows start .. start + n - 1
        of every sequence; the cache holds rows 0 .. start - 1 and receives the new ones."""
        n = tokens.shape[1]
        cos, sin = self.cos[start:start + n], self.sin[start:start + n]
        cache.begin(n)
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, lambda q, k, v, i=i: cache.attend(i, q, k, v))
        cache.end(n)
        return self.head(self.norm(x[:, -1]))


class FmhaCache:
    """The batch's sequences in an fmha PagedKVCache."""

    def __init__(self, model: Decoder, batch: int, max_len: int, block_size: int):
        blk = model.blocks[0]
        per_seq = -(-max_len // block_size)
        self.cache = PagedKVCache(batch * per_seq, block_size, len(model.blocks), blk.kv_heads,
                                  blk.head_dim, dtype=torch.float32,
                                  max_blocks_per_seq=per_seq)
        self.ids = [self.cache.add_sequence() for _ in range(batch)]

    def begin(self, n):
        self.cache.reserve(self.ids, n)

    def attend(self, layer, q, k, v):
        # Bottom-right causal: prefill (n rows over n) and decode (1 row over all) alike.
        return self.cache.attention(layer, q, k, v, self.ids, causal=True)

    def end(self, n):
        self.cache.commit(self.ids, n)

    def nbytes(self) -> int:
        return self.cache.bytes_used()


class TorchCache:
    """Per-layer K, V (batch, kv_heads, rows, head_dim), grown with torch.cat."""

    def __init__(self, layers: int):
        self.k, self.v = [None] * layers, [None] * layers

    def begin(self, n):
        pass

    def attend(self, layer, q, k, v):
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        past = self.k[layer]
        if past is not None:
            k, v = torch.cat([past, k], dim=2), torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        # is_causal is top-left aligned: right for the prefill (no past) and, with one
        # query row, not needed for a decode step.
        assert past is None or q.shape[1] == 1
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v,
                                             is_causal=past is None, enable_gqa=True)
        return out.transpose(1, 2)

    def end(self, n):
        pass

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v if t is not None)


@torch.inference_mode()
def generate(model: Decoder, prompt: torch.Tensor, new_tokens: int, cache) -> dict:
    """Greedy decoding of new_tokens tokens per sequence; the tokens and timings."""
    t0 = time.perf_counter()
    logits = model(prompt, 0, cache)
    token = logits.argmax(-1)
    ttft = time.perf_counter() - t0
    tokens, all_logits, steps = [token], [logits], []
    for i in range(1, new_tokens):
        t0 = time.perf_counter()
        logits = model(token[:, None], prompt.shape[1] + i - 1, cache)
        token = logits.argmax(-1)
        steps.append(time.perf_counter() - t0)
        tokens.append(token)
        all_logits.append(logits)
    return {"tokens": torch.stack(tokens, 1), "logits": torch.stack(all_logits, 1),
            "ttft": ttft, "steps": steps, "kv_bytes": cache.nbytes()}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4, help="decoder blocks")
    p.add_argument("--hidden", type=int, default=256, help="model width")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per sequence")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per sequence")
    p.add_argument("--batch", type=int, default=4, help="sequences")
    p.add_argument("--block-size", type=int, default=16, help="rows per KV-cache block")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch and fmha (default: torch's setting)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    p.add_argument("--json", type=Path, default=None, help="write the measurements here")
    args = p.parse_args(argv)
    if args.hidden % args.heads or args.heads % args.kv_heads or (args.hidden // args.heads) % 2:
        p.error("--hidden must be a multiple of --heads with an even head size, and --heads "
                "a multiple of --kv-heads")
    if min(args.prompt_len, args.new_tokens, args.batch, args.block_size, args.layers) < 1:
        p.error("sizes must be >= 1")
    return args


def run(args: argparse.Namespace) -> dict:
    if args.threads is not None:
        torch.set_num_threads(args.threads)     # fmha follows torch's setting
    max_len = args.prompt_len + args.new_tokens
    torch.manual_seed(args.seed)
    model = Decoder(args.vocab, args.hidden, args.heads, args.kv_heads, args.layers,
                    max_len).eval()
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt_len))
    caches = {"fmha": lambda: FmhaCache(model, args.batch, max_len, args.block_size),
              "torch": lambda: TorchCache(args.layers)}
    runs = {}
    for name, make in caches.items():
        generate(model, prompt, 2, make())    # untimed: one-off start-up costs
        runs[name] = generate(model, prompt, args.new_tokens, make())
    same = torch.equal(runs["fmha"]["tokens"], runs["torch"]["tokens"])
    result = {
        "cpu": cpu_model(), "threads": torch.get_num_threads(), "cpu_isa": fmha.cpu_isa(),
        "torch_version": torch.__version__, "fmha_version": fmha.__version__,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokens_equal": same,
        # Only attention's rounding differs, so the logits agree to float32 accuracy.
        "max_abs_logit_diff": float((runs["fmha"]["logits"] - runs["torch"]["logits"])
                                    .abs().max()),
    }
    for name, r in runs.items():
        decode = sum(r["steps"])
        result[name] = {
            "ttft_s": r["ttft"],
            "per_token_s_median": statistics.median(r["steps"]) if r["steps"] else None,
            # Decode throughput: the tokens of every sequence after the first, per second.
            "tokens_per_s": args.batch * len(r["steps"]) / decode if decode else None,
            "kv_cache_bytes": r["kv_bytes"],
            "tokens": r["tokens"].tolist(),
        }
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    c = result["config"]
    print(f"host: {result['cpu']}, {result['threads']} threads, fmha {result['fmha_version']}"
          f" ({result['cpu_isa']}), torch {result['torch_version']}")
    print(f"model: {c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads / "
          f"{c['kv_heads']} kv heads, vocab {c['vocab']}, {result['parameters']:,} parameters;"
          f" batch {c['batch']}, prompt {c['prompt_len']}, {c['new_tokens']} new tokens")
    print(f"{'':18}{'TTFT ms':>10}{'ms/token':>10}{'tokens/s':>10}{'KV bytes':>12}")
    for name, label in (("fmha", "fmha PagedKVCache"), ("torch", "torch SDPA + cat")):
        r = result[name]
        per_token = r["per_token_s_median"]
        print(f"{label:18}{r['ttft_s'] * 1e3:10.2f}"
              f"{per_token * 1e3 if per_token else float('nan'):10.2f}"
              f"{r['tokens_per_s'] or float('nan'):10.0f}{r['kv_cache_bytes']:12,}")
    print(f"greedy tokens {'identical' if result['tokens_equal'] else 'DIFFER'} "
          f"(max |logit difference| {result['max_abs_logit_diff']:.1e})")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["tokens_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
