"""Click logs with user and item ids: implicit feedback for retrieval.

A click log lists impressions, one per line, in a MovieLens layout with the click in
place of the stars::

    user \\t item \\t clicked \\t timestamp        (or user::item::clicked::timestamp, or CSV)
    17   \\t 301  \\t 1       \\t 1700000000

``clicked`` is 1 (a click: a positive pair for ``jaxrec train --data clicks:PATH``) or 0
(shown, not clicked: the item is a candidate, the pair no positive). Ids are any
non-negative integers, re-indexed densely as MovieLens ids are; the timestamp is kept
for temporal splits (write 0 when there is none).
"""

from __future__ import annotations

import os

import numpy as np

from jaxrec.data._batch import DataFormatError
from jaxrec.data._movielens import MovieLensRatings, load_interaction_lines

_HINT = "pass a file of 'user<TAB>item<TAB>clicked<TAB>timestamp' lines, clicked 0 or 1."


def load_click_log(path: str | os.PathLike) -> MovieLensRatings:
    """The whole click log, in file order, as ``MovieLensRatings`` whose ``ratings`` are the
    clicks (0.0 or 1.0). A malformed line, a negative id or a click other than 0 or 1 is a
    ``DataFormatError`` naming the line."""
    path, rows, numbers = load_interaction_lines(path, "click log file", "clicked", _HINT)
    checks = (("user", rows.users, rows.users < 0, "is negative (ids are >= 0)"),
              ("item", rows.items, rows.items < 0, "is negative (ids are >= 0)"),
              ("clicked", rows.ratings, ~np.isin(rows.ratings, (0.0, 1.0)), "is not 0 or 1"))
    for name, values, bad, what in checks:
        if bad.any():
            row = int(np.argmax(bad))
            raise DataFormatError(f"{path}, line {numbers[row]}, field {name}: "
                                  f"{values[row].item()!r} {what}; fix or remove this line.")
    return rows
