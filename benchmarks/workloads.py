"""The benchmark workloads: each builds a model and its inputs, in plain torch (no extra packages).

Every workload is a function returning ``(model, args, loss_fn)``; ``loss_fn(output)`` gives the scalar.
The inputs are what a user's plain training step passes: a model's images and token ids do not require
grad; a chain of ops without parameters gets an input that does (else it has no backward to run).
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

Workload = tuple[Callable[..., Any], tuple, Callable[[Any], torch.Tensor]]


class _Block(nn.Module):
    """A GPT-2 block: pre-norm causal self-attention and a GELU MLP, with residuals."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.attn_qkv = nn.Linear(width, 3 * width)
        self.attn_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp_fc = nn.Linear(width, 4 * width)
        self.mlp_proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.attn_qkv(self.ln_1(x)).split(width, dim=-1)
        shape = (batch, seq, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(width // self.heads)
        mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1)
        y = (attn @ v).transpose(1, 2).reshape(batch, seq, width)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(x))))


class GPT2Style(nn.Module):
    """Token and position embeddings, blocks, final norm, an LM head tied to the token embedding."""

    def __init__(self, layers: int = 4, width: int = 256, heads: int = 4, vocab: int = 5000, context: int = 128):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def gpt2_style() -> Workload:
    """GPT-2-style transformer: 4 layers, width 256, sequence 128, batch 4."""
    model = GPT2Style()
    ids = torch.randint(0, 5000, (4, 128))
    return model, (ids,), lambda loss: loss


def gpt2_style_large() -> Workload:
    """GPT-2-small-sized (12 layers, width 768, 12 heads, vocabulary 50,257), sequence 512, batch 8: a training
    step of the size a GPU runs, where its kernels, not Python launching them, take the time (too slow for
    this CPU machine's runs; named when wanted, as on a GPU)."""
    model = GPT2Style(layers=12, width=768, heads=12, vocab=50257, context=512)
    ids = torch.randint(0, 50257, (8, 512))
    return model, (ids,), lambda loss: loss


class _ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNetStyle(nn.Module):
    """A ResNet-18-like CNN for 32x32 images (narrower): stem, 4 stages of 2 blocks, a classifier."""

    def __init__(self, width: int = 16, classes: int = 10, imagenet_stem: bool = False):
        super().__init__()
        if imagenet_stem:  # torchvision's: a 7x7 convolution with stride 2, then a max pool
            conv, pool = nn.Conv2d(3, width, 7, 2, 3, bias=False), [nn.MaxPool2d(3, 2, 1)]
        else:
            conv, pool = nn.Conv2d(3, width, 3, 1, 1, bias=False), []
        self.stem = nn.Sequential(conv, nn.BatchNorm2d(width), nn.ReLU(), *pool)
        stages, cin = [], width
        for i, stride in enumerate((1, 2, 2, 2)):
            cout = width * 2**i
            stages += [_ResidualBlock(cin, cout, stride), _ResidualBlock(cout, cout, 1)]
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.adaptive_avg_pool2d(self.stages(self.stem(x)), 1).flatten(1))


def resnet_style() -> Workload:
    """ResNet-style CNN with BatchNorm: batch 32, 32x32 images."""
    model = ResNetStyle()
    labels = torch.randint(0, 10, (32,))
    return model, (torch.randn(32, 3, 32, 32),), lambda logits: F.cross_entropy(logits, labels)


def resnet18() -> Workload:
    """ResNet-18 as torchvision builds it (widths 64 to 512, its stem; torchvision not needed): batch 32,
    32x32 images."""
    model = ResNetStyle(width=64, imagenet_stem=True)
    labels = torch.randint(0, 10, (32,))
    return model, (torch.randn(32, 3, 32, 32),), lambda logits: F.cross_entropy(logits, labels)


def resnet_small() -> Workload:
    """The ResNet-style CNN at batch 2, 16x16 images: its kernels cost little, so what a traced step adds per
    module and per node (the same as at batch 32) is most of the difference; for instructions.py."""
    model = ResNetStyle()
    labels = torch.randint(0, 10, (2,))
    return model, (torch.randn(2, 3, 16, 16),), lambda logits: F.cross_entropy(logits, labels)


def tiny_ops(count: int = 6000) -> Workload:
    """``count`` elementwise ops on 8-element tensors: per-node fixed cost dominates."""

    def chain(x: torch.Tensor) -> torch.Tensor:
        for i in range(count // 3):
            x = (x * 1.0001 + 0.001).tanh() if i % 2 else (x * 0.9999 - 0.001).sin()
        return x

    return chain, (torch.randn(8, requires_grad=True),), lambda out: out.sum()


def tiny_unary(count: int = 6000) -> Workload:
    """``count`` calls of ``sin`` on an 8-element tensor: one node per op, the cheapest backward per node."""

    def chain(x: torch.Tensor) -> torch.Tensor:
        for _ in range(count):
            x = x.sin()
        return x

    return chain, (torch.randn(8, requires_grad=True),), lambda out: out.sum()


def _step(x: torch.Tensor) -> torch.Tensor:
    return (x * 1.0001).tanh()


def tiny_calls(count: int = 6000) -> Workload:
    """``count`` elementwise ops made in calls of a two-op Python function: a user frame entered and left
    per two nodes, which creation sites pay for."""

    def chain(x: torch.Tensor) -> torch.Tensor:
        for _ in range(count // 2):
            x = _step(x)
        return x

    return chain, (torch.randn(8, requires_grad=True),), lambda out: out.sum()


class _ParamChain(nn.Module):
    def __init__(self, count: int):
        super().__init__()
        self.count = count
        self.weight = nn.Parameter(1 + 1e-4 * torch.randn(8))  # near 1: weight**count stays finite

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.count):
            x = x * self.weight
        return x


def tiny_param(count: int = 6000) -> Workload:
    """``count`` products with one 8-element parameter: every node sends two gradients, and the
    parameter's AccumulateGrad receives ``count`` of them."""
    return _ParamChain(count), (torch.randn(8),), lambda out: out.sum()


def wide_mlp() -> Workload:
    """A wide MLP: 4 Linear layers of width 2048, batch 64."""
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(2048, 2048), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(2048, 10))
    return model, (torch.randn(64, 2048),), lambda out: out.pow(2).mean()


def deep_linear(pairs: int = 1000) -> Workload:
    """``pairs`` Linear(8, 8) + ReLU layers in one Sequential, batch 2: five nodes a layer, two of them a
    parameter's AccumulateGrad, and two module calls. Costs per module and per parameter dominate, and the
    gradients vanish on the way down (those of the first layers are about 1e-30 at 1,000 layers)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(pairs) for layer in (nn.Linear(8, 8), nn.ReLU())])
    return model, (torch.randn(2, 8),), lambda out: out.sum()


def big_activations() -> Workload:
    """Large activations, few parameters: where keeping gradients alive would show in peak memory."""
    model = nn.Sequential(*[nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()) for _ in range(6)])
    return model, (torch.randn(32, 16, 128, 128),), lambda out: out.pow(2).mean()


def chain(nodes: int) -> Workload:
    """A straight chain of about ``nodes`` backward nodes (one op each) on a 4-element tensor."""

    def run(x: torch.Tensor) -> torch.Tensor:
        for _ in range(nodes - 2):
            x = x * 1.000001
        return x

    return run, (torch.randn(4, requires_grad=True),), lambda out: out.sum()


class _HFCausalLM(nn.Module):
    """A Hugging Face language model called on ``ids`` as its own labels; returns the loss."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, labels=ids).loss


def hf_gpt2() -> Workload:
    """Hugging Face GPT-2 from a config (random weights): 4 layers, width 256, sequence 128, batch 4."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=5000, n_positions=128, bos_token_id=0, eos_token_id=0)
    model = _HFCausalLM(GPT2LMHeadModel(config).train())
    return model, (torch.randint(0, 5000, (4, 128)),), lambda loss: loss


def hf_gpt2_base() -> Workload:
    """Hugging Face GPT-2 with its default config (12 layers, width 768, vocabulary 50,257; random
    weights): sequence 128, batch 2."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    model = _HFCausalLM(GPT2LMHeadModel(GPT2Config(n_positions=128)).train())
    return model, (torch.randint(0, 50257, (2, 128)),), lambda loss: loss


def hf_bert() -> Workload:
    """Hugging Face BERT for masked LM from a config (random weights): 4 layers, width 256, sequence 128,
    batch 4, the inputs as their own labels."""
    import transformers
    from transformers import BertConfig, BertForMaskedLM

    transformers.logging.set_verbosity_error()
    config = BertConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024)
    model = _HFCausalLM(BertForMaskedLM(config).train())  # called the same way: labels=ids, returns .loss
    return model, (torch.randint(0, config.vocab_size, (4, 128)),), lambda loss: loss


def tv_resnet50() -> Workload:
    """torchvision's ResNet-50 (random weights, 1,000 classes): batch 64, 224x224 images, a GPU-sized step."""
    import torchvision

    model = torchvision.models.resnet50()
    labels = torch.randint(0, 1000, (64,))
    return model, (torch.randn(64, 3, 224, 224),), lambda logits: F.cross_entropy(logits, labels)


def tv_resnet18() -> Workload:
    """torchvision's ResNet-18 (random weights, 10 classes): batch 32, 32x32 images."""
    import torchvision

    model = torchvision.models.resnet18(num_classes=10)
    labels = torch.randint(0, 10, (32,))
    return model, (torch.randn(32, 3, 32, 32),), lambda logits: F.cross_entropy(logits, labels)


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "gpt2-style": gpt2_style,
    "resnet-style": resnet_style,
    "tiny-ops": tiny_ops,
    "tiny-unary": tiny_unary,
    "tiny-param": tiny_param,
    "tiny-calls": tiny_calls,
    "wide-mlp": wide_mlp,
    "deep-linear": deep_linear,
}
if importlib.util.find_spec("transformers") is not None:  # not a gradtrace dependency; imported when used
    WORKLOADS["hf-gpt2"] = hf_gpt2
if importlib.util.find_spec("torchvision") is not None:
    WORKLOADS["tv-resnet18"] = tv_resnet18
DEFAULT = list(WORKLOADS)  # what overhead.py runs unless told; the larger models below only when named
WORKLOADS["resnet18"] = resnet18
WORKLOADS["resnet-small"] = resnet_small
WORKLOADS["gpt2-style-large"] = gpt2_style_large
if importlib.util.find_spec("torchvision") is not None:
    WORKLOADS["tv-resnet50"] = tv_resnet50
if importlib.util.find_spec("transformers") is not None:
    WORKLOADS["hf-gpt2-base"] = hf_gpt2_base
    WORKLOADS["hf-bert"] = hf_bert
