"""Convolutional zoo models: AlexNet, Inception-v3 and ResNet (plain PyTorch).

Every model is ``torch.fx.symbolic_trace``-able and its ``forward(inputs,
targets)`` returns the mean cross-entropy training loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AlexNetConfig", "AlexNet", "InceptionConfig", "InceptionV3", "ResNetConfig", "ResNet"]


def _ch(channels: int, width: float) -> int:
    """Scale a channel count by ``width`` (at least one channel)."""
    return max(1, int(channels * width))


@dataclass(frozen=True)
class AlexNetConfig:
    """AlexNet ("one weird trick" single-tower variant, as in torchvision)."""

    num_classes: int = 1000
    """Number of output classes (ImageNet-1k)."""
    image_size: int = 224
    """Side of the square RGB example input; at least 63."""
    width: float = 1.0
    """Multiplier on the feature-extractor channels (64, 192, 384, 256, 256)."""
    hidden: int = 4096
    """Width of the two hidden fully connected layers."""
    dropout: float = 0.5
    """Dropout probability in the classifier."""


class AlexNet(nn.Module):
    """AlexNet classifier returning the training loss."""

    def __init__(self, cfg: AlexNetConfig) -> None:
        super().__init__()
        c1, c2, c3, c4, c5 = (_ch(c, cfg.width) for c in (64, 192, 384, 256, 256))
        self.features = nn.Sequential(
            nn.Conv2d(3, c1, kernel_size=11, stride=4, padding=2),
            nn.ReLU(inplace=False),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(c1, c2, kernel_size=5, padding=2),
            nn.ReLU(inplace=False),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(c2, c3, kernel_size=3, padding=1),
            nn.ReLU(inplace=False),
            nn.Conv2d(c3, c4, kernel_size=3, padding=1),
            nn.ReLU(inplace=False),
            nn.Conv2d(c4, c5, kernel_size=3, padding=1),
            nn.ReLU(inplace=False),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(p=cfg.dropout),
            nn.Linear(c5 * 6 * 6, cfg.hidden),
            nn.ReLU(inplace=False),
            nn.Dropout(p=cfg.dropout),
            nn.Linear(cfg.hidden, cfg.hidden),
            nn.ReLU(inplace=False),
            nn.Linear(cfg.hidden, cfg.num_classes),
        )

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(inputs))
        logits = self.classifier(torch.flatten(x, 1))
        return F.cross_entropy(logits, targets)


@dataclass(frozen=True)
class InceptionConfig:
    """Inception-v3 (torchvision layout, no auxiliary logits)."""

    num_classes: int = 1000
    """Number of output classes (ImageNet-1k)."""
    image_size: int = 299
    """Side of the square RGB example input; at least 75."""
    width: float = 1.0
    """Multiplier on every convolution's output channels."""
    dropout: float = 0.5
    """Dropout probability before the final fully connected layer."""


class BasicConv2d(nn.Module):
    """Conv (no bias) + BatchNorm + ReLU."""

    def __init__(self, cin: int, cout: int, **kwargs) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, bias=False, **kwargs)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class InceptionA(nn.Module):
    def __init__(self, cin: int, pool_features: int, w: float) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, _ch(64, w), kernel_size=1)
        self.branch5x5_1 = BasicConv2d(cin, _ch(48, w), kernel_size=1)
        self.branch5x5_2 = BasicConv2d(_ch(48, w), _ch(64, w), kernel_size=5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, _ch(64, w), kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(_ch(64, w), _ch(96, w), kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(_ch(96, w), _ch(96, w), kernel_size=3, padding=1)
        self.branch_pool = BasicConv2d(cin, _ch(pool_features, w), kernel_size=1)
        self.out_channels = 2 * _ch(64, w) + _ch(96, w) + _ch(pool_features, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = self.branch_pool(F.avg_pool2d(x, kernel_size=3, stride=1, padding=1))
        return torch.cat([b1, b5, b3, bp], 1)


class InceptionB(nn.Module):
    def __init__(self, cin: int, w: float) -> None:
        super().__init__()
        self.branch3x3 = BasicConv2d(cin, _ch(384, w), kernel_size=3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, _ch(64, w), kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(_ch(64, w), _ch(96, w), kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(_ch(96, w), _ch(96, w), kernel_size=3, stride=2)
        self.out_channels = _ch(384, w) + _ch(96, w) + cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3(x)
        bd = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = F.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([b3, bd, bp], 1)


class InceptionC(nn.Module):
    def __init__(self, cin: int, channels_7x7: int, w: float) -> None:
        super().__init__()
        c7, c192 = _ch(channels_7x7, w), _ch(192, w)
        self.branch1x1 = BasicConv2d(cin, c192, kernel_size=1)
        self.branch7x7_1 = BasicConv2d(cin, c7, kernel_size=1)
        self.branch7x7_2 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, c192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(cin, c7, kernel_size=1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, c192, kernel_size=(1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(cin, c192, kernel_size=1)
        self.out_channels = 4 * c192

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        bd = self.branch7x7dbl_1(x)
        bd = self.branch7x7dbl_3(self.branch7x7dbl_2(bd))
        bd = self.branch7x7dbl_5(self.branch7x7dbl_4(bd))
        bp = self.branch_pool(F.avg_pool2d(x, kernel_size=3, stride=1, padding=1))
        return torch.cat([b1, b7, bd, bp], 1)


class InceptionD(nn.Module):
    def __init__(self, cin: int, w: float) -> None:
        super().__init__()
        c192, c320 = _ch(192, w), _ch(320, w)
        self.branch3x3_1 = BasicConv2d(cin, c192, kernel_size=1)
        self.branch3x3_2 = BasicConv2d(c192, c320, kernel_size=3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(cin, c192, kernel_size=1)
        self.branch7x7x3_2 = BasicConv2d(c192, c192, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(c192, c192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(c192, c192, kernel_size=3, stride=2)
        self.out_channels = c320 + c192 + cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_2(self.branch7x7x3_1(x))
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(b7))
        bp = F.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([b3, b7, bp], 1)


class InceptionE(nn.Module):
    def __init__(self, cin: int, w: float) -> None:
        super().__init__()
        c192, c320, c384, c448 = (_ch(c, w) for c in (192, 320, 384, 448))
        self.branch1x1 = BasicConv2d(cin, c320, kernel_size=1)
        self.branch3x3_1 = BasicConv2d(cin, c384, kernel_size=1)
        self.branch3x3_2a = BasicConv2d(c384, c384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(c384, c384, kernel_size=(3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(cin, c448, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(c448, c384, kernel_size=3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(c384, c384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(c384, c384, kernel_size=(3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(cin, c192, kernel_size=1)
        self.out_channels = c320 + 4 * c384 + c192

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b3 = self.branch3x3_1(x)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)
        bd = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        bd = torch.cat([self.branch3x3dbl_3a(bd), self.branch3x3dbl_3b(bd)], 1)
        bp = self.branch_pool(F.avg_pool2d(x, kernel_size=3, stride=1, padding=1))
        return torch.cat([b1, b3, bd, bp], 1)


class InceptionV3(nn.Module):
    """Inception-v3 classifier returning the training loss."""

    def __init__(self, cfg: InceptionConfig) -> None:
        super().__init__()
        w = cfg.width
        self.Conv2d_1a_3x3 = BasicConv2d(3, _ch(32, w), kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(_ch(32, w), _ch(32, w), kernel_size=3)
        self.Conv2d_2b_3x3 = BasicConv2d(_ch(32, w), _ch(64, w), kernel_size=3, padding=1)
        self.maxpool1 = nn.MaxPool2d(kernel_size=3, stride=2)
        self.Conv2d_3b_1x1 = BasicConv2d(_ch(64, w), _ch(80, w), kernel_size=1)
        self.Conv2d_4a_3x3 = BasicConv2d(_ch(80, w), _ch(192, w), kernel_size=3)
        self.maxpool2 = nn.MaxPool2d(kernel_size=3, stride=2)
        specs = [
            ("5b", InceptionA, (32,)), ("5c", InceptionA, (64,)), ("5d", InceptionA, (64,)),
            ("6a", InceptionB, ()), ("6b", InceptionC, (128,)), ("6c", InceptionC, (160,)),
            ("6d", InceptionC, (160,)), ("6e", InceptionC, (192,)), ("7a", InceptionD, ()),
            ("7b", InceptionE, ()), ("7c", InceptionE, ()),
        ]
        self.blocks = nn.Sequential()
        c = _ch(192, w)
        for name, cls, args in specs:
            block = cls(c, *args, w)
            self.blocks.add_module(f"Mixed_{name}", block)
            c = block.out_channels
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(p=cfg.dropout)
        self.fc = nn.Linear(c, cfg.num_classes)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(inputs)))
        x = self.maxpool1(x)
        x = self.maxpool2(self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x)))
        x = self.dropout(self.avgpool(self.blocks(x)))
        logits = self.fc(torch.flatten(x, 1))
        return F.cross_entropy(logits, targets)


@dataclass(frozen=True)
class ResNetConfig:
    """Bottleneck ResNet (torchvision ``resnet101`` layout by default)."""

    layers: tuple[int, ...] = (3, 4, 23, 3)
    """Bottleneck blocks per stage (ResNet-101: 3, 4, 23, 3)."""
    width: int = 64
    """Base width: stem channels and bottleneck width of the first stage."""
    num_classes: int = 1000
    """Number of output classes (ImageNet-1k)."""
    image_size: int = 224
    """Side of the square RGB example input."""


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (stride) -> 1x1 bottleneck with identity/projection shortcut."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = nn.Conv2d(cin, planes, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, cout, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(cout),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)


class ResNet(nn.Module):
    """Bottleneck ResNet classifier returning the training loss."""

    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        w = cfg.width
        self.conv1 = nn.Conv2d(3, w, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        cin = w
        stages = []
        for i, n_blocks in enumerate(cfg.layers):
            planes = w * 2**i
            blocks = []
            for j in range(n_blocks):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(Bottleneck(cin, planes, stride))
                cin = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.layers = nn.Sequential(*stages)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, cfg.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(inputs))))
        x = self.avgpool(self.layers(x))
        logits = self.fc(torch.flatten(x, 1))
        return F.cross_entropy(logits, targets)
