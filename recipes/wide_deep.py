"""Wide & Deep click-through-rate model on generated data: the model a parameter server is made for.

Run it:

    dlaunch recipe=wide_deep                                                     # one device
    dlaunch recipe=wide_deep strategy=parameter_server cluster.workers=2 cluster.ps=2   # chief + 2 workers, 2 ps

Each example is ``fields`` categorical features (user, ad, site, hour, ...), each
an id in one hashed id space of ``num_ids``, and a click label. The ids follow a
power law, as real ones do: a few are everywhere, most are rare, so a batch of
240 touches about a thousand of the embedding tables' 100,000 rows. Those tables
are most of the model's parameters, which is why ``strategy=parameter_server``
shards them across ps tasks and has workers pull only the rows their batch names.

The data is generated from a fixed seed (``trainer.seed + 1``), so every process
builds the same dataset; labels come from a hidden ground truth (one weight per
id plus an interaction between the first two fields), so a model can learn them
only as well as the rare ids allow. ``evaluate`` reports the held-out log loss,
AUC and accuracy. ``train_step`` is plain torch and runs unchanged under every
strategy.
"""

from __future__ import annotations

import torch
from pydantic import Field, PositiveInt
from torch import nn
from torch.utils.data import TensorDataset

from launcher.runtime.recipe import BuildContext, OptimizerConfig, Parts, RecipeConfig

EVAL_CHUNK = 1024  # rows per forward pass in evaluate


class Config(RecipeConfig):
    num_ids: int = Field(100_000, gt=0)  # size of the hashed id space shared by all fields: the tables' rows
    fields: int = Field(8, ge=2)  # categorical fields per example (the first two interact in the ground truth)
    embedding_dim: int = Field(16, gt=0)
    hidden: list[PositiveInt] = Field(default_factory=lambda: [64, 32], min_length=1)  # the deep part's hidden layer widths
    examples: int = Field(32768, gt=0)
    eval_examples: int = Field(4096, gt=0)
    zipf_exponent: float = Field(1.1, ge=0)  # how skewed id frequencies are: P(rank r) ~ 1 / (r + 1) ** zipf_exponent
    optimizer: OptimizerConfig = OptimizerConfig(name="adagrad", lr=0.05)


class WideDeep(nn.Module):
    """Wide: one weight per id, summed over fields, plus a bias. Deep: one shared embedding table, the
    fields' vectors concatenated into an MLP. The logit is their sum.

    Plain ``nn.Embedding`` modules, called as modules: a parameter-server strategy intercepts
    those calls to pull only the rows a batch names.
    """

    def __init__(self, num_ids: int, fields: int, embedding_dim: int, hidden: list[int]):
        super().__init__()
        self.wide_embedding = nn.Embedding(num_ids, 1)
        self.wide_bias = nn.Parameter(torch.zeros(1))
        self.deep_embedding = nn.Embedding(num_ids, embedding_dim)
        layers: list[nn.Module] = []
        width = fields * embedding_dim
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)
        # An unseen id should say nothing: wide weights start at zero, deep vectors small.
        nn.init.zeros_(self.wide_embedding.weight)
        nn.init.normal_(self.deep_embedding.weight, std=0.01)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [batch, fields] int64 -> logits [batch, 1]."""
        wide = self.wide_embedding(ids).sum(dim=1) + self.wide_bias  # [batch, 1]
        deep = self.mlp(self.deep_embedding(ids).flatten(1))  # [batch, fields * dim] -> [batch, 1]
        return wide + deep


def make_data(cfg: Config, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Train and held-out sets of (ids [N, fields] int64, labels [N, 1] float) from one hidden ground truth."""
    g = torch.Generator().manual_seed(seed + 1)
    # Each field owns a block of the id space, scattered over it by a random permutation (the "hash"),
    # and draws ranks within its block from a power law.
    per_field = max(cfg.num_ids // cfg.fields, 1)
    hashed = torch.randperm(cfg.num_ids, generator=g)
    offsets = torch.arange(cfg.fields) * per_field
    rank_weights = 1.0 / (torch.arange(per_field, dtype=torch.float64) + 1) ** cfg.zipf_exponent
    cdf = rank_weights.cumsum(0) / rank_weights.sum()
    # The ground truth: a weight per id, an interaction between fields 0 and 1, a bias towards no click.
    w_true = torch.randn(cfg.num_ids, generator=g)
    factors = torch.randn(cfg.num_ids, 4, generator=g) * 0.7
    bias = -1.0

    def sample(n: int) -> TensorDataset:
        ranks = torch.searchsorted(cdf, torch.rand(n, cfg.fields, generator=g, dtype=torch.float64)).clamp_(max=per_field - 1)
        ids = hashed[(ranks + offsets) % cfg.num_ids]
        logit = bias + w_true[ids].sum(dim=1) + (factors[ids[:, 0]] * factors[ids[:, 1]]).sum(dim=1)
        clicks = torch.bernoulli(torch.sigmoid(logit), generator=g)
        return TensorDataset(ids, clicks.unsqueeze(1))

    return sample(cfg.examples), sample(cfg.eval_examples)


def build(cfg: Config, ctx: BuildContext) -> Parts:
    """Called inside strategy.scope(): the strategy decides where the parameters live."""
    model = WideDeep(cfg.num_ids, cfg.fields, cfg.embedding_dim, cfg.hidden)
    train_data, eval_data = make_data(cfg, ctx.seed)
    return Parts(model=model, optimizer=cfg.optimizer.build(model.parameters()), train_data=train_data, eval_data=eval_data)


def train_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One replica's share of a global batch -> its mean log loss. dlaunch does backward and the update."""
    ids, clicks = batch
    return nn.functional.binary_cross_entropy_with_logits(model(ids), clicks)


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve by ranks (Mann-Whitney U): the chance a random positive outscores a
    random negative, ties counting half. NaN when one class is missing."""
    scores, positive = scores.flatten().double(), labels.flatten() > 0.5
    n_pos = int(positive.sum())
    n_neg = positive.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    values, inverse, counts = torch.unique(scores, sorted=True, return_inverse=True, return_counts=True)
    first_rank = counts.cumsum(0) - counts + 1  # 1-based rank of each distinct score's first occurrence
    mean_rank = (first_rank + (counts - 1) / 2.0).double()  # tied scores share their average rank
    rank_sum = mean_rank[inverse][positive].sum().item()
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def evaluate(model: nn.Module, parts: Parts) -> dict[str, float]:
    """Held-out log loss, AUC and accuracy (threshold 0.5).

    The data goes through ``model`` in chunks, to the parameters' device (under a parameter server too:
    for the evaluation the chief's module holds the values, pulled from the ps tasks).
    """
    ids, clicks = parts.eval_data.tensors
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = torch.cat([model(chunk.to(device)).detach().float().cpu() for chunk in ids.split(EVAL_CHUNK)])
    return {
        "eval_loss": nn.functional.binary_cross_entropy_with_logits(logits, clicks).item(),
        "eval_auc": auc(logits, clicks),
        "eval_accuracy": ((logits > 0).float() == clicks).float().mean().item(),
        "eval_click_rate": clicks.mean().item(),
    }
