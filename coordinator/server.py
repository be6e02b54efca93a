"""The Coordinator: the one round loop, with deadlines, quorum, retries, records and checkpoints.

A round: the strategy picks clients and the models each receives → the fleet runs the phase
(`coordinator.fleet`: over the network, or in this process) and hands back each client's reply,
validated (schema, model names, architectures, shapes, finite values, counts), or nothing → if
enough valid replies arrived (quorum) the strategy aggregates, else the round runs again or is
recorded as failed with the state left as it was, the clients' included (their next task says
which round was kept last, and a client that trained in a later one goes back to the state before
it) → evaluation on every client (or on `round.eval_clients` of them, a sample fixed for the
run) → checkpoint.
After the last round a finalize task goes to every client (fine-tuning, ONNX export; in a
simulation with `round.eval_clients`, to the sample alone) and the final per-client scores come
back with it. The coordinator knows no topics, blobs or chunks:
registration, presence and the wire are the fleet's.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.checkpoint import Checkpointing
from coordinator.config_sections import RoundConfig
from coordinator.fleet import (
    BrokerUnfit,
    CoordinatorError,
    Fleet,
    Interrupted,
    PhaseRequest,
    RunInfo,
    Validator,
    check_reply,
)
from coordinator.results import ClientResult, RoundRecord, RunResult
from coordinator.robust import (
    MOVED_MIN,
    Contribution,
    RobustConfig,
    flagged_before,
    moved_by,
    rolled_back,
    standing_out,
    suspects,
)
from coordinator.round_scores import accuracies, client_score, mean_metrics
from coordinator.strategies import (
    FitReply,
    ServerData,
    Strategy,
    StrategyError,
    strategy_class,
)
from edge_sdk import topics
from edge_sdk.algorithms import BaseAlgorithmConfig
from edge_sdk.codec import DEFAULT_MAX_BLOB_BYTES, WireModel
from edge_sdk.protocol import Phase
from model_zoo import ArchSpec

__all__ = [
    "Coordinator",
    "CoordinatorError",
    "CoordinatorStats",
    "Interrupted",
    "RoundConfig",
    "eval_sample",
]

log = logging.getLogger(__name__)


@dataclass
class CoordinatorStats:
    """Live counters for operators (the daemon's Prometheus metrics read them)."""

    rounds_completed: int = 0
    rounds_failed: int = 0
    round_seconds: list[float] = field(default_factory=list)


class Coordinator(Checkpointing):
    def __init__(
        self,
        fleet: Fleet,
        *,
        algorithm: str,
        config: BaseAlgorithmConfig,
        rounds: int,
        expected_clients: int,
        clients_per_round: int | None = None,
        allow: Sequence[str] | None = None,
        global_model: str | None = None,
        model_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
        round_config: RoundConfig | None = None,
        robust: RobustConfig | None = None,
        run_id: str = "default",
        seed: int = 0,
        incarnation: int | None = None,
        max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES,
        on_round: Callable[[RoundRecord], None] | None = None,
        checkpoint_path: str | Path | None = None,
        server_data: ServerData | None = None,
        eval_families: Mapping[str, str] | None = None,
        finalize_sample: bool = False,
    ) -> None:
        """`fleet`: where the clients are (`NetworkFleet(transport)`, `LocalFleet(nodes)`).
        `checkpoint_path`: after every round the whole state is written there (atomically);
        a coordinator that finds it resumes at the next round (see `restore`).

        With `round.eval_clients`, `eval_families` is the architecture each client counts
        under in the sample (a simulation: its config's, so that every baseline evaluates the
        same clients; none: the one it registered), and `finalize_sample` finalizes the sample
        alone (a simulation; a deployment finalizes every device, whose model it is)."""
        if rounds < 1 or expected_clients < 1:
            raise ValueError(
                f"need rounds >= 1 and expected_clients >= 1, got {rounds}, {expected_clients}"
            )
        self.fleet = fleet
        self.algorithm = algorithm
        self.strategy_cls = strategy_class(algorithm)
        self.config = config
        self.rounds = rounds
        allowed = frozenset(topics.check_id(c, "client id") for c in allow) if allow else None
        self.expected_clients = len(allowed) if allowed else expected_clients
        self.clients_per_round = clients_per_round
        self.global_model = global_model
        self.model_kwargs = {k: dict(v) for k, v in (model_kwargs or {}).items()}
        self.rc = round_config or RoundConfig()
        self.robust = robust or RobustConfig()
        self.seed = seed
        self.on_round = on_round
        self.checkpoint_path = Path(checkpoint_path) if checkpoint_path else None
        self.server_data = server_data
        self.eval_families = dict(eval_families) if eval_families is not None else None
        self.finalize_sample = finalize_sample
        self._evaluated: frozenset[str] | None = None  # the sample, once drawn (`_eval_plan`)
        self.info = RunInfo(
            run_id=topics.check_id(run_id, "run id"),
            algorithm=algorithm,
            config=config.model_dump(mode="json"),
            rounds=rounds,
            # A new number per start: clients that see it change on the status topic re-register.
            incarnation=incarnation if incarnation is not None else new_incarnation(),
            expected_clients=self.expected_clients,
            allow=allowed,
            max_blob_bytes=max_blob_bytes,
            max_abs=self.robust.max_abs,
            reconnect_grace_s=self.rc.reconnect_grace_s,
        )
        self.strategy: Strategy | None = None
        self.stats = CoordinatorStats()
        self._round = 0
        self._kept = 0  # the last round whose training was aggregated
        # The last evaluation, per client (its global model's accuracy, else its personalized
        # one), and the kept round whose state it evaluated: a round is rolled back when its
        # evaluation shows most clients much worse than this (coordinator.robust).
        self._scores: dict[str, float] = {}
        self._scored_after: int | None = None
        # The first round each client was flagged for each kind of reason (`_say_flagged`).
        self._flagged_first: dict[tuple[str, str], int] = {}
        self.records: list[RoundRecord] = []
        self._detailed = True  # the records keep their per-client parts (`_keep`)
        self._restored = False
        # Bytes moved by earlier incarnations of this run (from the checkpoint): the run's
        # totals are these plus this fleet's.
        self._bytes_before = (0, 0)

    def _say_flagged(self, r: int, cid: str, why: str) -> None:
        """A flagged client in the log: at WARNING the first time it is flagged for a kind of
        reason, at INFO when it is again (`flagged_before`). Each round's flags stay in its
        record (results.json) either way."""
        first = flagged_before(self._flagged_first, r, cid, why)
        if first is None:
            log.warning("round %d: %s flagged: %s", r, cid, why)
        else:
            log.info(
                "round %d: %s flagged again: %s (first in round %d; at INFO from now on, every "
                "round's in results.json)",
                r,
                cid,
                why,
                first,
            )

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> Coordinator:
        """Get the fleet ready to admit clients (before they register); idempotent."""
        self.fleet.open(self.info)
        return self

    def run(self) -> RunResult:
        """Register the clients (or, from a checkpoint, wait for them to come back), run the
        remaining rounds, finalize. Raises `Interrupted` after `stop()`."""
        self.open()
        t0 = time.perf_counter()
        finished: bool | None = False  # None: ended for good, the clients already told
        try:
            if self.checkpoint_path is not None and not self._restored:
                self.restore()
            if self._restored:
                self.fleet.rejoin(self.info, self.rc.register_timeout_s)
            else:
                self.fleet.gather(self.rc.register_timeout_s, self.rc.min_clients)
                self._new_strategy().setup()
                self._first_scores()
            strategy = self._strategy()
            for r in range(len(self.records) + 1, self.rounds + 1):
                rec = self._run_round(r)
                self._keep(rec)
                self._save_checkpoint()
                if self.on_round is not None:
                    self.on_round(rec)
            finals = self._finalize()
            archive = strategy.late_joiner_models()
            if archive:
                self.fleet.publish_archive(archive)
            finished = True
            spec = strategy.global_spec
            return RunResult(
                algorithm=self.algorithm,
                rounds=list(self.records),
                clients=finals,
                wall_seconds=time.perf_counter() - t0,
                global_spec=spec.model_dump() if spec else None,
                bytes_out=self._bytes_before[0] + self.fleet.bytes_out,
                bytes_in=self._bytes_before[1] + self.fleet.bytes_in,
                extra=strategy.results(),
                population=len(self.clients) if len(finals) < len(self.clients) else None,
            )
        except BrokerUnfit as exc:  # no coordinator coming back would fix it: tell them why
            self.fleet.finish(f"run stopped: {exc}")
            finished = None
            raise
        finally:
            if finished:
                self.fleet.finish("run finished")
            elif finished is not None:  # interrupted or failed: the clients wait for a
                self.fleet.pause()  # coordinator to come back

    def _keep(self, rec: RoundRecord) -> None:
        """Record a round: whole while the fleet's per-client history stays within
        `round.client_history` client-rounds, compact beyond (the earlier rounds too, once)."""
        if len(self.clients) * self.rounds > self.rc.client_history:
            if self._detailed:
                log.info(
                    "%d clients × %d rounds exceed round.client_history (%d): rounds keep "
                    "counts and accuracy percentiles, not each client's part",
                    len(self.clients),
                    self.rounds,
                    self.rc.client_history,
                )
                self.records = [r.compact() for r in self.records]
                self._detailed = False
            rec = rec.compact()
        self.records.append(rec)

    def stop(self) -> None:
        """Abandon the current phase and return from `run()` by raising `Interrupted`; the
        last checkpoint holds every completed round (call from a signal handler or a thread)."""
        self.fleet.stop()

    def _new_strategy(self) -> Strategy:
        self.strategy = self.strategy_cls(
            self.config,
            clients=self.clients,
            global_spec=self._global_spec(),
            rounds=self.rounds,
            clients_per_round=self.clients_per_round,
            seed=self.seed,
            server_data=self.server_data,
            robust=self.robust,
        )
        self.strategy.history_limit = self.rc.client_history
        return self.strategy

    def _global_spec(self) -> ArchSpec | None:
        infos = list(self.clients.values())
        shapes = {c.spec.input_shape for c in infos}
        if len(shapes) > 1:
            raise CoordinatorError(f"clients disagree on the input shape: {sorted(shapes)}")
        family = self.global_model
        if family is None:  # one architecture everywhere: that is the global one
            distinct = {c.spec.to_json() for c in infos}
            return infos[0].spec if len(distinct) == 1 else None
        return ArchSpec(
            family=family,
            num_classes=max(c.capabilities.num_classes for c in infos),
            input_shape=infos[0].spec.input_shape,
            kwargs=self.model_kwargs.get(family, {}),
        )

    # -- rounds ----------------------------------------------------------------------------
    def _run_round(self, r: int) -> RoundRecord:
        strategy = self._strategy()
        t0 = time.perf_counter()
        self._round = r
        valid: dict[str, FitReply] = {}
        kept_before = self._kept
        evaluate = r % self.rc.eval_every == 0 or r == self.rounds
        # The state to go back to, when this round's evaluation can judge it (the last one
        # evaluated the state it starts from): references, as aggregation builds new tensors.
        undo = (
            strategy.state_dict()
            if evaluate and strategy.aggregates and self._scored_after == kept_before
            else None
        )
        for attempt in range(self.rc.retries + 1):
            if attempt:
                log.warning("round %d: attempt %d of %d", r, attempt + 1, self.rc.retries + 1)
                self.fleet.await_back(self.rc.deadline_s)
            strategy.available = self.fleet.online()
            strategy.flags, strategy.cohort = {}, {}
            trained: set[str] = set()
            for step in strategy.steps:  # one, or several with a barrier after each
                plan = strategy.configure_step(r, step)
                trained |= set(plan)
                replies = self._run_phase(r, "fit", plan, step=step)
                valid = {cid: rep for cid, rep in sorted(replies.items()) if rep is not None}
                counted = strategy.quorum_clients(plan)  # whose replies aggregation needs
                got = sum(cid in valid for cid in counted)
                need = max(1, math.ceil(self.rc.quorum * len(counted)))  # never over nobody
                failed = got < need
                if failed:
                    log.error(
                        "round %d%s: %d of %d valid replies, quorum needs %d; state unchanged",
                        r,
                        f" {step}" if step else "",
                        got,
                        len(counted),
                        need,
                    )
                    break
                try:
                    strategy.aggregate_step(r, step, valid)
                except (StrategyError, ValueError) as exc:  # bad replies cost the round only
                    failed = True
                    log.error("round %d: aggregation refused the replies: %s", r, exc)
                    break
            if not failed:
                self._kept = r
                break
        flagged = dict(strategy.flags)
        for cid, why in sorted(flagged.items()):
            self._say_flagged(r, cid, why)
        personal = glob = None
        per_client: dict[str, tuple[float | None, float | None]] = {}
        blamed: list[str] = []
        back = False
        if evaluate:
            scores = self._run_phase(r, "evaluate", self._eval_plan(strategy.configure_evaluate(r)))
            personal, glob, per_client = accuracies(scores)
            now = {cid: client_score(per_client.get(cid)) for cid in scores}
            worse = rolled_back(self._scores, now, self.robust) if undo is not None else None
            if worse is not None and not failed:
                blamed = suspects(strategy.cohort, flagged)
                why = self._not_theirs(strategy.cohort, blamed)
                if why:
                    log.warning(
                        "round %d left %d of %d clients much worse than the last evaluation "
                        "(%s), but %s: kept, since undoing it would only repeat it. Training "
                        "itself dropped: a learning rate or local epochs too large for this data "
                        "do this",
                        r,
                        len(worse),
                        len(set(self._scores) & set(now)),
                        ", ".join(worse),
                        why,
                    )
                    worse, blamed = None, []
            if worse is not None and not failed:
                assert undo is not None
                drawn = strategy.rng.bit_generator.state  # the next round samples anew
                strategy.load_state_dict(undo)
                strategy.rng.bit_generator.state = drawn
                self._kept, failed, back = kept_before, True, True
                log.error(
                    "round %d rolled back: its models left %d of %d clients much worse than "
                    "the last evaluation (%s); suspects: %s",
                    r,
                    len(worse),
                    len(set(self._scores) & set(now)),
                    ", ".join(worse),
                    ", ".join(blamed) or "none",
                )
            else:
                self._scores = {cid: v for cid, v in now.items() if v is not None}
                self._scored_after = self._kept
        strategy.cohort = {}
        online = self.fleet.online()
        seconds = time.perf_counter() - t0
        self.stats.round_seconds.append(seconds)
        if failed:
            self.stats.rounds_failed += 1
        else:
            self.stats.rounds_completed += 1
        return RoundRecord(
            round=r,
            seconds=seconds,
            mean_personal_acc=personal,
            global_acc=glob,
            trained=sorted(trained),
            replied=sorted(valid),
            failed=failed,
            train_metrics=mean_metrics(valid),
            client_details={cid: v.details for cid, v in valid.items() if v.details},
            client_acc={cid: p for cid, (p, _) in sorted(per_client.items())},
            online=len(online),
            offline=sorted(set(self.clients) - online),
            flagged=flagged,
            rolled_back=back,
            suspects=blamed,
        )

    def _not_theirs(self, cohort: Mapping[str, Sequence[Contribution]], blamed: list[str]) -> str:
        """Why a round that left most clients much worse is no client's doing, in words; empty
        when its suspects may have caused it. Undoing a drop nobody caused would only repeat it:
        the same clients train again from the same state, every round."""
        if not standing_out(cohort):
            return "no client's update stands out from the others'"
        moved = moved_by(cohort, blamed, self.robust)
        if moved >= MOVED_MIN:
            return ""
        return (
            f"its suspects' updates ({', '.join(blamed)}) were bounded: leaving them out moves "
            f"the aggregate by {100 * moved:.2g}% of the round's update"
        )

    def _first_scores(self) -> None:
        """Evaluate the initial models (as round 0) when every round is evaluated and may be
        rolled back, so that the first round is judged too."""
        strategy = self._strategy()
        if not (self.robust.rollback and strategy.aggregates and self.rc.eval_every == 1):
            return
        scores = self._run_phase(0, "evaluate", self._eval_plan(strategy.configure_evaluate(0)))
        _, _, per_client = accuracies(scores)
        now = {cid: client_score(per_client.get(cid)) for cid in scores}
        self._scores = {cid: v for cid, v in now.items() if v is not None}
        self._scored_after = 0

    def _eval_plan(
        self, plan: Mapping[str, Mapping[str, WireModel]]
    ) -> Mapping[str, Mapping[str, WireModel]]:
        """`plan` for the clients `round.eval_clients` samples (all of them without it). The
        sample is drawn once, from the clients registered then (or restored), by `eval_sample`."""
        k = self.rc.eval_clients
        if k is None or k >= len(self.clients):
            return plan
        if self._evaluated is None:
            families = self.eval_families or {}
            self._evaluated = eval_sample(
                {cid: families.get(cid, c.spec.family) for cid, c in self.clients.items()},
                k,
                self.seed,
            )
        return {cid: models for cid, models in plan.items() if cid in self._evaluated}

    def _unsampled(self, cid: str) -> bool:
        """Whether the finalize leaves `cid` out: a simulation's client outside the sample."""
        return self.finalize_sample and self._evaluated is not None and cid not in self._evaluated

    def _finalize(self) -> list[ClientResult]:
        plan: Mapping[str, Mapping[str, WireModel]] = self._strategy().configure_finalize()
        if self.finalize_sample:
            plan = self._eval_plan(plan)
        scores = self._run_phase(self.rounds, "finalize", plan)
        _, _, per_client = accuracies(scores)
        out = []
        for cid, info in sorted(self.clients.items()):
            if self._unsampled(cid):
                continue
            p, g = per_client.get(cid, (None, None))
            reply = scores.get(cid)
            out.append(
                ClientResult(
                    id=cid,
                    arch=info.spec.family,
                    spec=info.spec.model_dump(),
                    n_train=info.capabilities.n_train,
                    dataset=info.capabilities.dataset,
                    device=info.capabilities.device,
                    precision=info.capabilities.precision,
                    personal_acc=p,
                    global_acc=g,
                    error=None if reply else "no valid finalize reply",
                    details=reply.details if reply else {},
                )
            )
        return out

    def _run_phase(
        self, r: int, phase: Phase, plan: Mapping[str, Mapping[str, WireModel]], step: str = ""
    ) -> dict[str, FitReply | None]:
        """One task per planned client that is online; each one's valid reply or None."""
        strategy = self._strategy()
        online = self.fleet.online()
        gone = sorted(set(plan) - online)
        if gone:
            log.warning("round %d %s: %s offline; no task for them", r, phase, gone)
            plan = {cid: models for cid, models in plan.items() if cid in online}
        limit = self.rc.deadline_s
        if phase == "finalize" and self.rc.finalize_deadline_s is not None:
            limit = self.rc.finalize_deadline_s
        request = PhaseRequest(
            round=r,
            phase=phase,
            plan=plan,
            deadline_s=limit,
            step=step,
            params={cid: strategy.task_params(r, step, cid) for cid in plan}
            if phase == "fit"
            else {},
            partial=strategy.partial_models,
            kept_round=self._kept,
        )
        replies = self.fleet.run_phase(request, self._validator(phase))
        return {cid: replies.get(cid) for cid in plan}

    def _validator(self, phase: Phase) -> Validator:
        strategy = self._strategy()

        def validate(cid: str, reply: FitReply) -> None:
            expected = strategy.expected_models(cid) if phase == "fit" else None
            check_reply(reply, self.clients[cid].capabilities, expected)

        return validate


def eval_sample(families: Mapping[str, str], k: int, seed: int) -> frozenset[str]:
    """`k` of the clients (`families`: client id -> the architecture it counts under), drawn
    with `seed` alone, so that runs with the same clients draw the same: each architecture gets
    seats in proportion to its clients (at least one each, when `k` allows), seat by seat to
    the architecture furthest below its share, and its seats go to clients drawn uniformly."""
    if k >= len(families):
        return frozenset(families)
    groups: defaultdict[str, list[str]] = defaultdict(list)
    for cid in sorted(families):
        groups[families[cid]].append(cid)
    names = sorted(groups)
    seats = dict.fromkeys(names, 0)
    if k >= len(names):
        seats = dict.fromkeys(names, 1)
    for _ in range(k - sum(seats.values())):
        room = [f for f in names if seats[f] < len(groups[f])]
        f = max(room, key=lambda f: k * len(groups[f]) / len(families) - seats[f])
        seats[f] += 1
    rng = np.random.default_rng([seed, 0x65766C])  # its own stream: training's stays the same
    return frozenset(
        cid for f in names for cid in rng.choice(groups[f], size=seats[f], replace=False).tolist()
    )


def new_incarnation() -> int:
    """A coordinator start's number: the clock's milliseconds, then 20 random bits. It grows
    from start to start (clients take a smaller one for an earlier coordinator's) and no two
    starts share one, so every message bound to it (edge_sdk.protocol) belongs to one start:
    nothing signed in an earlier run counts in a later one."""
    return (time.time_ns() // 1_000_000) << 20 | secrets.randbits(20)
