"""The coordinator's checkpoint: the whole run's state written (atomically) after every round,
and a restarted coordinator resuming from it (the base of `coordinator.server.Coordinator`,
which sets the state declared here)."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import asdict
from pathlib import Path
from typing import Any

from coordinator.fleet import CoordinatorError, Fleet, RunInfo
from coordinator.results import RoundRecord
from coordinator.strategies import ClientInfo, Strategy
from edge_sdk.algorithms import BaseAlgorithmConfig
from edge_sdk.protocol import Capabilities
from edge_sdk.state import StateError, load_state, save_state
from model_zoo import ArchSpec

__all__ = ["Checkpointing"]

log = logging.getLogger(__name__)


class Checkpointing(ABC):
    """Writes the run's state to `checkpoint_path` after every round (`_save_checkpoint`) and
    reads it back (`restore`): the registry, the records, the strategy's state, the scores the
    rollback check compares with, and the bytes moved so far."""

    fleet: Fleet
    info: RunInfo
    algorithm: str
    config: BaseAlgorithmConfig
    rounds: int
    seed: int
    checkpoint_path: Path | None
    strategy: Strategy | None
    records: list[RoundRecord]
    _round: int
    _kept: int
    _restored: bool
    _scores: dict[str, float]
    _scored_after: int | None
    _bytes_before: tuple[int, int]

    # The run's identity, its registry and its strategy, as the coordinator and its checkpoint
    # read them.
    @property
    def run_id(self) -> str:
        return self.info.run_id

    @property
    def incarnation(self) -> int:
        return self.info.incarnation

    @property
    def clients(self) -> dict[str, ClientInfo]:
        """The registered clients, by id."""
        return self.fleet.clients

    def _strategy(self) -> Strategy:
        if self.strategy is None:
            raise RuntimeError("the run has not started: no strategy yet")
        return self.strategy

    @abstractmethod
    def _new_strategy(self) -> Strategy:
        """A fresh strategy for this run's clients (the coordinator's)."""

    def _save_checkpoint(self) -> None:
        if self.checkpoint_path is None:
            return
        save_state(
            self.checkpoint_path,
            {
                "format": 1,
                "run": self.run_id,
                "algorithm": self.algorithm,
                "config": self.config.model_dump_json(),
                "rounds": self.rounds,
                "seed": self.seed,
                "incarnation": self.incarnation,
                "clients": [
                    {
                        "id": c.id,
                        "spec": c.spec.to_json(),
                        "capabilities": c.capabilities.model_dump_json(),
                    }
                    for c in self.clients.values()
                ],
                "records": [asdict(rec) for rec in self.records],
                "strategy": self._strategy().state_dict(),
                "scores": dict(self._scores),
                "scored_after": self._scored_after,
                "bytes": [
                    self._bytes_before[0] + self.fleet.bytes_out,
                    self._bytes_before[1] + self.fleet.bytes_in,
                ],
            },
        )

    def restore(self) -> bool:
        """Load `checkpoint_path` when it exists: the registry, every completed round and the
        strategy's state (global model, random generator...). True when there was one."""
        if self.checkpoint_path is None or not self.checkpoint_path.exists():
            return False
        try:
            state = load_state(self.checkpoint_path)
            keys = ("run", "algorithm", "config", "rounds", "seed")
            theirs = tuple(state[k] for k in keys)
        except (StateError, KeyError) as exc:
            raise CoordinatorError(f"cannot resume from {self.checkpoint_path}: {exc}") from exc
        ours = (self.run_id, self.algorithm, self.config.model_dump_json(), self.rounds, self.seed)
        if theirs != ours:
            raise CoordinatorError(
                f"the checkpoint {self.checkpoint_path} was written by a run with another "
                "run id, algorithm, config, round count or seed; start over with --fresh (or "
                "restore the original settings)"
            )
        for c in state["clients"]:
            spec = ArchSpec.from_json(c["spec"])
            caps = Capabilities.model_validate_json(c["capabilities"])
            self.clients[c["id"]] = ClientInfo(c["id"], spec, caps)
        self.records = [RoundRecord(**_record_fields(rec)) for rec in state["records"]]
        self._kept = max((rec.round for rec in self.records if not rec.failed), default=0)
        self._scores = {str(k): float(v) for k, v in state.get("scores", {}).items()}
        self._scored_after = state.get("scored_after")
        out_in = state.get("bytes", [0, 0])
        self._bytes_before = (int(out_in[0]), int(out_in[1]))
        incarnation = max(self.incarnation, int(state["incarnation"]) + 1)
        self.info = RunInfo(**{**asdict(self.info), "incarnation": incarnation})
        self._new_strategy().setup()
        self._strategy().load_state_dict(state["strategy"])
        self._round = len(self.records)
        self._restored = True
        log.info(
            "resumed run %s after round %d (incarnation %d)",
            self.run_id,
            self._round,
            self.incarnation,
        )
        return True


def _record_fields(rec: dict[str, Any]) -> dict[str, Any]:
    """A checkpointed round record's fields; a checkpoint written before records counted the
    online clients listed them all."""
    if isinstance(rec.get("online"), list):
        rec = {**rec, "online": len(rec["online"])}
    return rec
