"""A small ResNet as one layer chain: seed 001's model-parallel workload, scaled down.

The seed splits torchvision's ResNet50 as ``conv1, bn1, relu, maxpool, layer1..layer4,
avgpool`` then ``fc``; :func:`small_resnet` keeps that chain shape (an ``nn.Sequential`` with
the same names) with three basic-block layers, sized for 8x8 digits or 32x32 images.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

__all__ = ["BasicBlock", "small_resnet"]


class BasicBlock(nn.Module):
    """ResNet's basic residual block (He et al., 2016), with a 1x1 projection when needed."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, cin, H, W) -> (B, cout, H / stride, W / stride)."""
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def small_resnet(in_channels: int = 1, classes: int = 10, width: int = 16) -> nn.Sequential:
    """conv1, bn1, relu, layer1..layer3, avgpool, flatten, fc: 9 layers a split can cut."""
    return nn.Sequential(
        OrderedDict(
            conv1=nn.Conv2d(in_channels, width, 3, 1, 1, bias=False),
            bn1=nn.BatchNorm2d(width),
            relu=nn.ReLU(),
            layer1=BasicBlock(width, width),
            layer2=BasicBlock(width, 2 * width, stride=2),
            layer3=BasicBlock(2 * width, 4 * width, stride=2),
            avgpool=nn.AdaptiveAvgPool2d(1),
            flatten=nn.Flatten(),  # the seed's x.view(x.size(0), -1)
            fc=nn.Linear(4 * width, classes),
        )
    )
