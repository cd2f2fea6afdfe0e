"""Which way a metric is better, from its name: ``eval_loss`` lower, ``accuracy`` higher.

The sweep table and ``dlaunch report`` rank jobs by it, and ``trainer.checkpoint.best.mode=auto`` keeps the
checkpoint of the lowest or highest evaluation by it. A name that says neither is for the user to say.
"""

from __future__ import annotations

LOWER_IS_BETTER = ("loss", "error", "err", "mse", "mae", "rmse", "perplexity", "ppl", "nll", "cer", "wer", "bits", "bpc", "bpb")
HIGHER_IS_BETTER = ("acc", "accuracy", "auc", "f1", "precision", "recall", "ap", "map", "score", "bleu", "rouge", "iou")


def lower_by_name(metric: str) -> bool | None:
    """True where the name's words say lower is better, False where they say higher; None where neither."""
    words = metric.lower().replace("-", "_").replace("/", "_").replace(".", "_").split("_")
    if any(w in LOWER_IS_BETTER for w in words):
        return True
    if any(w in HIGHER_IS_BETTER for w in words):
        return False
    return None
