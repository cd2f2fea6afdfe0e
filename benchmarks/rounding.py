"""How far last-bit differences carry in the benchmark workload (``benchmarks/breakdown.py --parts rounding``).

The plain loop as is, with the first layer's initial weights scaled by (1 + 1e-7), and with each global batch's
gradient summed as two halves (dlaunch's 2-replica split); losses every 40 steps.
"""

from __future__ import annotations


def bench_rounding(steps: int) -> dict[str, list[float]]:
    import torch

    import workload as w

    torch.set_num_threads(2)
    data = w.make_data(0)
    x_all, y_all = data.tensors
    order = torch.tensor(w.epoch_order(0, 0))

    def run(scale: float, halves: bool) -> list[float]:
        torch.manual_seed(0)
        model = w.make_model()
        with torch.no_grad():
            model[0].weight.mul_(scale)
        optimizer = torch.optim.SGD(model.parameters(), lr=w.LR, momentum=w.MOMENTUM)
        out = []
        for step in range(steps):
            idx = order[step * w.GLOBAL_BATCH:(step + 1) * w.GLOBAL_BATCH]
            x, y = x_all[idx], y_all[idx]
            if halves:  # the mean gradient as two halves' means, averaged: dlaunch's 2-replica arithmetic
                for h in range(2):
                    part = slice(h * w.GLOBAL_BATCH // 2, (h + 1) * w.GLOBAL_BATCH // 2)
                    (torch.nn.functional.cross_entropy(model(x[part]), y[part]) / 2).backward()
                with torch.no_grad():
                    loss = torch.nn.functional.cross_entropy(model(x), y)
            else:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if (step + 1) % 40 == 0:
                out.append(loss.item())
        return out

    return {"as is": run(1.0, False), "first layer x (1 + 1e-7)": run(1 + 1e-7, False), "gradient as two halves": run(1.0, True)}
