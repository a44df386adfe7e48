"""A small transformer language model in plain torch, with a tied LM head.

Shows a realistic graph: token embedding (int64 ids, which do not require
grad), hand-written multi-head self-attention (Linear q/k/v/o, causal mask,
softmax), LayerNorm, an MLP, residual adds, and an LM head whose weight *is*
the embedding weight — so that parameter has a single AccumulateGrad node fed
by both EmbeddingBackward0 and the head's matmul.

Loss design: the forward computes the next-token cross-entropy itself (targets
are the same ids shifted by one) and returns ``{"logits": ..., "loss": ...}``;
the tracer's loss rule picks the ``"loss"`` entry, so no ``loss_fn`` is needed.
Input: int64[2, 16] token ids.

Run it with::

    gradtrace run sample_models/transformer.py
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 50
CONTEXT = 16


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x):
        batch, seq, dim = x.shape
        head_dim = dim // self.heads

        def split_heads(t):
            return t.view(batch, seq, self.heads, head_dim).transpose(1, 2)

        q, k, v = split_heads(self.q(x)), split_heads(self.k(x)), split_heads(self.v(x))
        scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
        mixed = (weights @ v).transpose(1, 2).reshape(batch, seq, dim)
        return self.o(mixed)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 32, heads: int = 4, context: int = CONTEXT):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(context, dim) * 0.02)
        self.block = Block(dim, heads)
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # weight tying
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, ids):
        seq = ids.shape[1]
        h = self.embed(ids) + self.pos[:seq]
        logits = self.lm_head(self.ln_f(self.block(h)))
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
        )
        return {"logits": logits, "loss": loss}


def build_model():
    return TinyLM()


def example_inputs():
    return torch.randint(0, VOCAB, (2, CONTEXT))
