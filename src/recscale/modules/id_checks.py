"""Ids against their tables: the per-step check (``embedding.validate_ids``) and, with
the check off, the explanation of a lookup that failed on an id.

The batch is jagged and feature-major: bag ``i`` of ``offsets [F*B+1]`` is feature
``i // B``, sample ``i % B``; ``values [N]`` are the ids, feature f's between
``offsets[f*B]`` and ``offsets[(f+1)*B]``. ``table_sizes [F]`` holds each feature's
row count (int64, beside the ids).
"""

from __future__ import annotations

from typing import Protocol

import torch


class IdOutOfRangeError(ValueError):
    """An id is negative or >= its table's row count; names the feature and the value."""


class _Named(Protocol):
    name: str
    num_rows: int


def check_ids(
    values: torch.Tensor,
    feature: torch.Tensor,
    bag_of_id: torch.Tensor,
    batch_size: int,
    table_sizes: torch.Tensor,
    tables: list[_Named],
) -> None:
    """Raise :class:`IdOutOfRangeError` for the first id outside its table (``feature``
    and ``bag_of_id``: each value's feature and bag)."""
    bad = (values < 0) | (values >= table_sizes[feature])
    if bool(bad.any()):
        n = int(bad.nonzero()[0, 0])
        f = int(feature[n])
        raise IdOutOfRangeError(
            f"id {int(values[n])} of feature {tables[f].name} (sample "
            f"{int(bag_of_id[n]) % batch_size} "
            f"of the batch) is outside its table of {tables[f].num_rows} rows"
        )


def explain_failed_lookup(
    error: Exception,
    values: torch.Tensor,
    offsets: torch.Tensor,
    batch_size: int,
    table_sizes: torch.Tensor,
    tables: list[_Named],
) -> None:
    """With the per-step check off, a lookup that failed (torch's index error, a tier's
    row out of bounds) may have met an id past its table: raise the check's
    :class:`IdOutOfRangeError` for it, chained to ``error``. Returns when every id is in
    its table (then ``error`` is something else: the caller re-raises it); the check
    costs nothing on the steps that succeed."""
    try:
        lengths = (offsets[1:] - offsets[:-1]).cpu()
        bag_of_id = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        feature = torch.div(bag_of_id, batch_size, rounding_mode="floor")
        check_ids(values.cpu(), feature, bag_of_id, batch_size, table_sizes.cpu(), tables)
    except IdOutOfRangeError as bad:
        raise IdOutOfRangeError(
            f"{bad} (found when the lookup failed: embedding.validate_ids is off)"
        ) from error
    except Exception:  # the ids cannot be read back (a device in a failed state): say `error`
        return
