import math

import torch

from recscale.metrics import auc, binary_metrics, logloss, metrics_text, normalized_entropy


def brute_force_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_auc_matches_pairwise_count_with_ties():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        n = int(torch.randint(2, 300, (1,), generator=g))
        # Few distinct score values: many ties.
        scores = torch.randint(0, 1 + trial % 7, (n,), generator=g).float() / 3
        labels = torch.randint(0, 2, (n,), generator=g).float()
        labels[0], labels[1] = 0.0, 1.0
        assert math.isclose(
            auc(scores, labels), brute_force_auc(scores.tolist(), labels.tolist()), rel_tol=1e-12
        )


def test_auc_extremes_and_degenerate():
    labels = torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert auc(torch.tensor([0.1, 0.2, 0.3, 0.4]), labels) == 1.0
    assert auc(torch.tensor([0.4, 0.3, 0.2, 0.1]), labels) == 0.0
    assert auc(torch.tensor([0.5, 0.5, 0.5, 0.5]), labels) == 0.5
    assert math.isnan(auc(torch.tensor([0.1, 0.2]), torch.tensor([1.0, 1.0])))


def test_logloss_ne_and_calibration():
    logits = torch.tensor([2.0, -1.0, 0.5, -3.0])
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0])
    p = torch.sigmoid(logits.double())
    y = labels.double()
    expected = float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())
    assert math.isclose(logloss(logits, labels), expected, rel_tol=1e-9)
    ctr = 0.5
    assert math.isclose(
        normalized_entropy(logits, labels), expected / -(2 * ctr * math.log(ctr)), rel_tol=1e-9
    )
    m = binary_metrics(logits, labels)
    assert math.isclose(m["calibration"], float(p.mean()) / ctr, rel_tol=1e-9)
    assert m["count"] == 4 and m["ctr"] == 0.5


def test_predicting_the_ctr_gives_ne_one():
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0] * 25)
    logit = math.log(0.25 / 0.75)
    assert math.isclose(normalized_entropy(torch.full((100,), logit), labels), 1.0, rel_tol=1e-9)


def test_the_metrics_line_says_undefined_for_a_split_of_one_class():
    logits = torch.tensor([0.3, -1.0, 2.0])
    two = metrics_text(binary_metrics(logits, torch.tensor([1.0, 0.0, 1.0])))
    assert two.startswith("AUC 1.0000  logloss ") and "undefined" not in two and "nan" not in two
    for label in (0, 1):
        one = metrics_text(binary_metrics(logits, torch.full((3,), float(label))))
        assert "nan" not in one.lower() and one.startswith("AUC undefined  logloss ")
        assert f"every label is {label}" in one
        assert ("NE undefined" in one) and ("calibration undefined" in one) == (label == 0)
