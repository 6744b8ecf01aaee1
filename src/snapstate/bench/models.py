"""Models of the study, defined here: CIFAR VGG-16, ResNet-18/50 and a GPT-style transformer."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VGG16_LAYOUT: list[int | str] = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M"]
VGG16_LAYOUT += [512, 512, 512, "M", 512, 512, 512, "M"]


@dataclass(frozen=True)
class ModelSpec:
    """A parsed model name such as ``resnet18``, ``resnet18:w=0.25`` or ``gpt:p=10M``."""

    family: str
    options: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        if not self.options:
            return self.family
        return self.family + ":" + ",".join(f"{k}={v}" for k, v in self.options)

    def get(self, key: str, default: str) -> str:
        return dict(self.options).get(key, default)

    @property
    def kind(self) -> str:
        """``image`` for CIFAR classifiers, ``text`` for the transformer."""
        return "text" if self.family == "gpt" else "image"


def parse_model(name: str) -> ModelSpec:
    """Parse ``family[:k=v,...]``; raises ValueError naming the known families."""
    family, _, rest = name.strip().partition(":")
    if family not in BUILDERS:
        raise ValueError(f"unknown model {family!r}; known: {', '.join(sorted(BUILDERS))}")
    options = []
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"model option {part!r} in {name!r} is not key=value")
        options.append((key.strip(), value.strip()))
    return ModelSpec(family, tuple(options))


def parse_count(text: str) -> int:
    """Parse ``10M``, ``1.5B``, ``300k`` or a plain integer."""
    scale = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}
    text = text.strip().lower()
    if text and text[-1] in scale:
        return int(float(text[:-1]) * scale[text[-1]])
    return int(float(text))


def _width(base: int, width: float) -> int:
    # Keep at least 4 channels so the tiniest smoke variants still train.
    return max(4, int(round(base * width)))


class VGG(nn.Module):
    """VGG-16 for 32x32 inputs (batch norm variant, one linear classifier)."""

    def __init__(self, width: float = 1.0, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for item in VGG16_LAYOUT:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
                continue
            out = _width(int(item), width)
            layers += [nn.Conv2d(channels, out, 3, padding=1, bias=False), nn.BatchNorm2d(out)]
            layers.append(nn.ReLU(inplace=True))
            channels = out
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class BasicBlock(nn.Module):
    """ResNet-18 block: two 3x3 convolutions."""

    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = _shortcut(cin, planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class Bottleneck(nn.Module):
    """ResNet-50 block: 1x1, 3x3, 1x1 with expansion 4."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.shortcut = _shortcut(cin, out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        return F.relu(self.bn3(self.conv3(out)) + self.shortcut(x))


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    """CIFAR ResNet: 3x3 stem without max-pool, four stages, global average pool."""

    def __init__(
        self, block: type[BasicBlock | Bottleneck], blocks: list[int], width: float
    ) -> None:
        super().__init__()
        self.cin = _width(64, width)
        self.conv1 = nn.Conv2d(3, self.cin, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(self.cin)
        stages = []
        for i, count in enumerate(blocks):
            stages.append(self._stage(block, _width(64 * 2**i, width), count, 1 if i == 0 else 2))
        self.layers = nn.Sequential(*stages)
        self.fc = nn.Linear(self.cin, 10)

    def _stage(
        self, block: type[BasicBlock | Bottleneck], planes: int, count: int, stride: int
    ) -> nn.Sequential:
        mods = []
        for s in [stride] + [1] * (count - 1):
            mods.append(block(self.cin, planes, s))
            self.cin = planes * block.expansion
        return nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(F.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the transformer; ``for_params`` picks one from a parameter budget."""

    layers: int
    dim: int
    heads: int
    vocab: int = 2048
    block: int = 64
    dropout: float = 0.1

    @staticmethod
    def for_params(target: int, vocab: int = 2048, block: int = 64) -> GPTConfig:
        # GPT-2's aspect ratio (dim = 64 x layers) picks one shape for any budget.
        best = min(
            range(1, 97), key=lambda n: abs(math.log(_gpt_params(n, 64 * n, vocab, block) / target))
        )
        return GPTConfig(layers=best, dim=64 * best, heads=best, vocab=vocab, block=block)


def _gpt_params(layers: int, dim: int, vocab: int, block: int) -> int:
    return 12 * layers * dim * dim + 2 * vocab * dim + block * dim


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim)
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        att = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """GPT-style decoder; the head is not tied so every tensor has one owner in a state dict."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.zeros(1, cfg.block, cfg.dim))
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.Sequential(*[Block(cfg) for _ in range(cfg.layers)])
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos[:, : idx.shape[1]])
        return self.head(self.ln(self.blocks(x)))


def gpt_config(spec: ModelSpec) -> GPTConfig:
    """Shape from ``p=<params>`` or explicit ``l=<layers>,d=<dim>``; vocab ``v``, context ``t``."""
    vocab, block = int(spec.get("v", "2048")), int(spec.get("t", "64"))
    if "l" in dict(spec.options):
        dim = int(spec.get("d", "256"))
        return GPTConfig(int(spec.get("l", "4")), dim, max(1, dim // 64), vocab, block)
    return GPTConfig.for_params(parse_count(spec.get("p", "10M")), vocab, block)


def _build_gpt(spec: ModelSpec) -> nn.Module:
    return GPT(gpt_config(spec))


def _build_vgg(spec: ModelSpec) -> nn.Module:
    return VGG(float(spec.get("w", "1")))


def _build_resnet18(spec: ModelSpec) -> nn.Module:
    return ResNet(BasicBlock, [2, 2, 2, 2], float(spec.get("w", "1")))


def _build_resnet50(spec: ModelSpec) -> nn.Module:
    return ResNet(Bottleneck, [3, 4, 6, 3], float(spec.get("w", "1")))


BUILDERS: dict[str, Callable[[ModelSpec], nn.Module]] = {
    "vgg16": _build_vgg,
    "resnet18": _build_resnet18,
    "resnet50": _build_resnet50,
    "gpt": _build_gpt,
}


def build_model(name: str, seed: int = 0) -> nn.Module:
    """Build the named model with parameters drawn from ``seed`` (same on every rank)."""
    spec = parse_model(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BUILDERS[spec.family](spec)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
