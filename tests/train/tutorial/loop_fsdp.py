"""ElasticLoop with FSDP2 or DDP on the digits MLP: one epoch, rank 0 writes the final parameters as JSON."""
import json
import sys

import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from slurm_elastic.train import ElasticLoop


def main(out: str, fsdp: bool) -> None:
    loop = ElasticLoop(global_batch=48)
    digits = load_digits()
    data = TensorDataset(torch.tensor(digits.data / 16.0), torch.tensor(digits.target))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10)).double()
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)           # before the optimizer: it must hold the sharded parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    net, optimizer, loader = loop.prepare(model, optimizer, DataLoader(data, batch_size=4, shuffle=True))
    for x, y in loader:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist()
              for n, p in model.named_parameters()}
    if loop.rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"step": loop.step, "params": params}, f)
    loop.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "fsdp")
