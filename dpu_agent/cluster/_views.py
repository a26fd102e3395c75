"""Member-list deltas by epoch: what `members` with `since` answers.

A client holding the view of epoch E asks `members since=E`: the answer is "unchanged" (the
epoch is still E), the rows that changed and the names that went since E, or (E too old or
never seen here) nothing, and the caller sends the whole list. The serving rows are all an
epoch hashes (kvproto.placement.membership_epoch: names, addresses, capacity, zone, state),
so one epoch stands for one serving set; the view first seen at an epoch is the one kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["VIEW_HISTORY_MAX", "ViewHistory"]

# Views remembered by epoch. A view change is a join, leave or failure (seconds apart at
# least); a client refreshes every few seconds, so it is rarely more than a few epochs
# behind. A client further behind gets the whole list, as without deltas.
VIEW_HISTORY_MAX = 32


class ViewHistory:
    """The member rows of the last VIEW_HISTORY_MAX epochs this agent answered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._views: OrderedDict[int, dict[str, Mapping[str, Any]]] = OrderedDict()

    def delta(
        self, rows: Sequence[Mapping[str, Any]], epoch: int, since: int
    ) -> dict[str, Any] | None:
        """`{"unchanged": True}`, `{"changed": [...], "removed": [...]}` against the view of
        epoch `since`, or None when that view is not remembered (send the whole list)."""
        now = {str(r["name"]): r for r in rows}
        with self._lock:
            if epoch not in self._views:
                self._views[epoch] = now
                while len(self._views) > VIEW_HISTORY_MAX:
                    self._views.popitem(last=False)
            old = self._views.get(since)
        if since == epoch:
            return {"unchanged": True}
        if old is None:
            return None
        return {
            "changed": [dict(r) for name, r in now.items() if old.get(name) != r],
            "removed": [name for name in old if name not in now],
        }

    def remember(self, rows: Sequence[Mapping[str, Any]], epoch: int) -> None:
        """Keep the view a whole-list answer gave (a later delta is against it)."""
        self.delta(rows, epoch, epoch)
