"""Click-prediction metrics, computed exactly on the full set of predictions.

* ``auc``: the Mann-Whitney statistic, P(score_pos > score_neg) + 1/2 P(equal), so
  tied scores count one half - exactly what a brute-force pairwise count gives.
* ``logloss``: mean binary cross-entropy of the predicted probabilities.
* ``normalized_entropy``: logloss divided by the entropy of the observed CTR (the
  logloss of always predicting the CTR); below 1 means better than that baseline.
* ``calibration``: mean predicted probability / observed CTR (1 is calibrated).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact ROC AUC with ties counted as 1/2; NaN if only one class is present."""
    scores = scores.detach().reshape(-1).to(torch.float64).cpu()
    labels = labels.detach().reshape(-1).to(torch.float64).cpu()
    n_pos = float(labels.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    sorted_scores, order = torch.sort(scores)
    sorted_labels = labels[order]
    _, counts = torch.unique_consecutive(sorted_scores, return_counts=True)
    ends = torch.cumsum(counts, 0)
    pos_cum = torch.cumsum(sorted_labels, 0)
    pos_in_group = torch.diff(pos_cum[ends - 1], prepend=torch.zeros(1, dtype=torch.float64))
    neg_in_group = counts.to(torch.float64) - pos_in_group
    neg_below = (
        torch.cumsum(neg_in_group, 0) - neg_in_group
    )  # negatives with a strictly lower score
    wins = (pos_in_group * neg_below).sum() + 0.5 * (pos_in_group * neg_in_group).sum()
    return float(wins / (n_pos * n_neg))


def logloss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float(
        F.binary_cross_entropy_with_logits(
            logits.detach().double().reshape(-1), labels.double().reshape(-1)
        )
    )


def normalized_entropy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    ctr = float(labels.double().mean())
    if ctr <= 0.0 or ctr >= 1.0:
        return float("nan")
    baseline = -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))
    return logloss(logits, labels) / baseline


def binary_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """All metrics of a set of predictions (``logits`` are pre-sigmoid scores)."""
    probs = torch.sigmoid(logits.detach().double())
    ctr = float(labels.double().mean())
    return {
        "auc": auc(logits, labels),
        "logloss": logloss(logits, labels),
        "ne": normalized_entropy(logits, labels),
        "calibration": float(probs.mean()) / ctr if ctr > 0 else float("nan"),
        "ctr": ctr,
        "count": int(labels.numel()),
    }


def metrics_text(m: dict) -> str:
    """``binary_metrics``' figures on one line; on a split of one class, AUC, NE and
    calibration are undefined, and the line says so rather than printing ``nan``."""

    def fig(key: str, digits: int) -> str:
        x = m.get(key)
        return "undefined" if x is None or math.isnan(x) else f"{x:.{digits}f}"

    text = (
        f"AUC {fig('auc', 4)}  logloss {fig('logloss', 4)}  NE {fig('ne', 4)}  "
        f"calibration {fig('calibration', 3)}"
    )
    ctr = m.get("ctr")
    if ctr in (0.0, 1.0):
        text += f" (every label is {int(ctr)}: a split of one class ranks nothing)"
    return text
