"""A rank of the noise test: ElasticLoop on a fixed linear-regression data set, lr 0, metrics every step."""

from __future__ import annotations

import json
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slurm_elastic.train import ElasticLoop


def main() -> None:
    body = json.loads(open(os.environ["NOISE_DATA"]).read())
    x = torch.tensor(body["x"], dtype=torch.float64)
    y = torch.tensor(body["y"], dtype=torch.float64)
    model = nn.Linear(x.shape[1], 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.tensor(body["w0"], dtype=torch.float64).unsqueeze(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)   # parameters fixed: the truth stays put
    loop = ElasticLoop(global_batch=16, metrics_every_s=0.0, noise_smoothing=0.995,
                       noise_every_steps=1, fast_exit=False)
    net, optimizer, loader = loop.prepare(model, optimizer, DataLoader(TensorDataset(x, y), batch_size=8,
                                                                        shuffle=True))
    for epoch in range(6):
        loader.set_epoch(epoch)
        for xb, yb in loader:
            optimizer.zero_grad()
            (0.5 * (net(xb).squeeze(1) - yb).pow(2).mean()).backward()
            optimizer.step()
    loop.close()


if __name__ == "__main__":
    main()
