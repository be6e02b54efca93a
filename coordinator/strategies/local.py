"""local: nothing to aggregate; the coordinator only keeps the clock and collects metrics."""

from __future__ import annotations

from collections.abc import Mapping

from coordinator.strategies.base import FitReply, Strategy, register_strategy


@register_strategy
class LocalStrategy(Strategy):
    name = "local"
    aggregates = False

    def aggregate_fit(self, round_: int, replies: Mapping[str, FitReply]) -> None:
        return None
