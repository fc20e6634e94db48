"""Your own training loop on a torchvision-style ResNet: pipetrain runs the pipeline, you run the rest.

A ResNet written the way torchvision writes one (BasicBlock, BatchNorm, a downsampling shortcut),
scikit-learn's 8x8 digits behind a plain ``Dataset`` with random-shift augmentation, a
``DataLoader``, a learning-rate schedule from ``torch.optim.lr_scheduler``, evaluation after every
epoch and a checkpoint of the whole model at the end. The same file runs three ways::

    python examples/resnet_own_loop.py                              # spawns 2 local workers
    torchrun --nproc-per-node 2 examples/resnet_own_loop.py         # torchrun on one machine
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 examples/resnet_own_loop.py      # on each of two machines

Every rank runs this whole script; `pipe.step` hands the next batch to the pipeline and returns the
losses of the updates that finished, on the rank of the last stage. Options: ``--schedule``
(1f1b by default; pipedream keeps the pipeline full across calls), ``--epochs``, ``--out``.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from pipetrain import Pipeline
from pipetrain.paths import check_outputs


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision's ResNet layout, sized for 8x8 single-channel images."""

    def __init__(self, layers=(2, 2, 2), widths=(16, 32, 64), num_classes: int = 10) -> None:
        super().__init__()
        self.inplanes = widths[0]
        self.conv1 = nn.Conv2d(1, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._make_layer(widths[0], layers[0], 1)
        self.layer2 = self._make_layer(widths[1], layers[1], 2)
        self.layer3 = self._make_layer(widths[2], layers[2], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[2], num_classes)

    def _make_layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class Digits(Dataset):
    """scikit-learn's digits as 1x8x8 images; training samples shift by up to one pixel."""

    def __init__(self, train: bool) -> None:
        from sklearn.datasets import load_digits

        images, labels = load_digits(return_X_y=True)
        images = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
        keep = order[:1440] if train else order[1440:]
        self.images, self.labels, self.train = images[keep], torch.tensor(labels)[keep], train

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        image = self.images[index]
        if self.train:
            dx, dy = torch.randint(-1, 2, (2,)).tolist()
            image = torch.roll(image, shifts=(dy, dx), dims=(1, 2))
        return (image - 0.3) / 0.4, int(self.labels[index])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", default="out/resnet_own_loop")
    args = parser.parse_args()
    check_outputs(directories={"--out": args.out})  # an unwritable folder fails now, not after training

    torch.manual_seed(0)  # every rank builds the same initial model
    model = ResNet()
    train_set, test_set = Digits(train=True), Digits(train=False)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(1))
    steps = args.epochs * len(loader)
    pipe = Pipeline(
        model, split_at=["layer2"], schedule=args.schedule, microbatches=4 if args.schedule != "pipedream" else 1,
        optimizer=torch.optim.SGD, optimizer_options=dict(lr=0.1, momentum=0.9, weight_decay=5e-4),
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=steps),
    )
    pipe.start(steps=steps, batch_size=args.batch_size)
    for epoch in range(args.epochs):
        seen = []
        for x, y in (loader if pipe.reads_data else [(None, None)] * len(loader)):
            seen += [loss for _, loss in pipe.step(x, y)]
        metrics = pipe.evaluate(test_set)
        if metrics is not None:  # the rank of the last stage
            print(f"epoch {epoch + 1}: train loss {sum(seen) / max(len(seen), 1):.4f}, test loss {metrics['loss']:.4f}, "
                  f"accuracy {100 * metrics['accuracy']:.2f} %", flush=True)
    result = pipe.finish()
    if pipe.is_main:  # rank 0 holds the whole trained model now
        os.makedirs(args.out, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(args.out, "resnet.pt"))
        print(f"{result.samples_per_s:.0f} samples/s on {result.workers} workers; wrote {args.out}/resnet.pt")


if __name__ == "__main__":
    main()
