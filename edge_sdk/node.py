"""ClientNode: one client's runtime without any network — a task in, a result out.

A ClientNode holds a client's id, architecture, data and device, and the algorithm state it
accumulates. It owns the algorithm's lifecycle: it creates the ClientAlgorithm on the first task
(and refuses a task whose config differs from the one it trained with), runs the phase, rolls a
redone round back to the state before it, persists the whole state after every task that changed
it (with a `state_dir`), and exports the personalized model to ONNX after the last phase.

Two runtimes drive nodes: `EdgeClient` (one node behind a transport: a device app, or a simulated
client over the network) and the simulator's `LocalFleet` (many nodes in one process, no
serialisation). A phase runs in three parts, so that a runtime holding many nodes can do each for
all of them before the next: `begin` (pick the algorithm, roll back, `before_fit`: FedeRiCo
publishes its model here, so every peer's model is out before any node reads one), `execute` (the
algorithm's phase; the simulator runs compatible tasks as one stacked model:
`coordinator.stacking`) and `end`
(persist; export after the finalize phase). `run` is the three in a row.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from edge_sdk import topics
from edge_sdk.algorithms import (
    AlgorithmError,
    BaseAlgorithmConfig,
    ClientAlgorithm,
    ClientContext,
    FitResult,
    TaskInfo,
    algorithm_class,
    algorithm_names,
)
from edge_sdk.budget import DeployBudget
from edge_sdk.client_data import ClientData
from edge_sdk.codec import WireModel
from edge_sdk.device import exclusive, precision
from edge_sdk.peers import Peers
from edge_sdk.protocol import Capabilities, Phase
from edge_sdk.state import StateError, load_state, save_state, state_bytes, state_from_bytes
from edge_sdk.trainer import Trainer
from model_zoo import ArchSpec

__all__ = ["ClientNode", "NodeTask"]

if TYPE_CHECKING:
    from edge_sdk.export import Exporter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeTask:
    """One client's share of a phase: what to run (algorithm, config, round, step, per-client
    parameters) and on which models."""

    round: int
    rounds: int
    phase: Phase
    algorithm: str
    config: Mapping[str, Any]
    models: Mapping[str, WireModel] = field(default_factory=dict)
    step: str = ""
    params: Mapping[str, Any] = field(default_factory=dict)
    # The last round whose training the coordinator kept (None: not said). A node whose last
    # trained round is later goes back to the state before it: a failed round changes nothing.
    kept_round: int | None = None

    def group_key(self) -> tuple[Any, ...]:
        """Tasks with equal keys may run together (LocalFleet groups a phase's tasks by it)."""
        config = json.dumps(dict(self.config), sort_keys=True, default=str)
        return (self.algorithm, config, self.round, self.phase, self.step)


class ClientNode:
    """One client: its id, architecture, private data, device and the algorithm state it keeps.

    `onnx_path`: where to export the personalized model (verified) after the finalize phase.
    `class_names`, `normalization`: written into the ONNX file's metadata for the app that runs
    it. `normalization` is what the app's data was normalised with: {"mean": [...], "std":
    [...]}, one value per input channel (or one for all); `OnnxPredictor.predict(raw,
    normalize=True)` then applies it to raw inputs on the device. A mapping with other keys is
    refused here, when the node is built. `device`: where it trains (`cpu`, `cuda`); `seed`:
    its randomness.
    `state_dir`: where to persist the whole algorithm state after every task; a node that finds
    a state of its own run and id there continues from it (`restore`). `peers`: the channel to
    other clients (decentralized algorithms), set by the runtime that hosts the node.
    `dataset`: the name of the data set it trains on (its registration reports it, with its
    device and precision, so a run's results say what the federation ran). `budget`: what the
    device may deploy (edge_sdk.budget; default: its own architecture only). `onnx_exporter`:
    the torch exporter `export_onnx` uses ("auto", "dynamo" or "legacy": edge_sdk.export).
    """

    def __init__(
        self,
        client_id: str,
        spec: ArchSpec,
        data: ClientData,
        *,
        run_id: str = "default",
        device: torch.device | str = "cpu",
        seed: int = 0,
        onnx_path: str | Path | None = None,
        class_names: list[str] | None = None,
        normalization: dict[str, list[float]] | None = None,
        state_dir: str | Path | None = None,
        peers: Peers | None = None,
        dataset: str | None = None,
        budget: DeployBudget | None = None,
        onnx_exporter: Exporter = "auto",
    ) -> None:
        self.client_id = topics.check_id(client_id, "client id")
        self.run_id = topics.check_id(run_id, "run id")
        shape = tuple(data.x_train.shape[1:])
        if shape != tuple(spec.input_shape) or spec.num_classes != data.num_classes:
            raise ValueError(
                f"{client_id}: the model {spec} does not fit the data: inputs {shape} with "
                f"{data.num_classes} classes"
            )
        self.spec = spec
        self.device = torch.device(device)
        self.data = data.to(self.device)  # moved to the device once
        self.seed = seed
        self.onnx_path = Path(onnx_path) if onnx_path else None
        if onnx_exporter != "auto":  # checked now, not after the last round (loads onnx: only then)
            from edge_sdk.export import EXPORTERS

            if onnx_exporter not in EXPORTERS:
                raise ValueError(
                    f"{client_id}: onnx_exporter must be one of {', '.join(EXPORTERS)}, got "
                    f"{onnx_exporter!r}"
                )
        self.onnx_exporter = onnx_exporter
        self.class_names = class_names
        # Checked now, not at the export after the last round: {"mean": [...], "std": [...]}.
        if normalization is not None:
            from edge_sdk.onnx_format import check_normalization  # loads onnx: only when asked

            normalization = check_normalization(spec, normalization)
        self.normalization = normalization
        self.peers = peers
        self.dataset = dataset
        self.budget = budget or DeployBudget()
        self.algorithm: ClientAlgorithm | None = None
        self._algo_key: tuple[str, str] | None = None
        self.exported: Path | None = None
        self.state_path = Path(state_dir) / f"{self.client_id}.state" if state_dir else None
        self.resumed_after: int | None = None  # the fit round a restored state had reached
        self._fit_round = 0  # the last round this client trained
        self._fit_steps: list[str] = []  # the steps of that round it has run
        self._before_fit: dict[str, Any] | None = None  # its state before that round
        # `_before_fit` holds the algorithm's own tensors, not copies, until a task runs here
        # (`execute` copies them first; a stacked round leaves them as they are).
        self._before_fit_shared = False
        # A finalize task has run here: its deployed model is the guard's choice (or, without a
        # guard, the algorithm's final one), not the model as the rounds left it.
        self.finalized = False
        # Its state between tasks while parked (`park`): the bytes, or the file holding them.
        self._parked: bytes | Path | None = None

    @property
    def trained_round(self) -> int:
        """The last round this node trained in (and kept, as far as it knows)."""
        return self._fit_round

    def capabilities(self) -> Capabilities:
        d = self.data
        return Capabilities(
            device=str(self.device),
            precision=precision(self.device),
            dataset=self.dataset,
            n_train=len(d.y_train),
            n_val=len(d.y_val),
            n_test=len(d.y_test),
            num_classes=d.num_classes,
            algorithms=algorithm_names(),
        )

    # -- one task ----------------------------------------------------------------------------
    def run(self, task: NodeTask) -> FitResult:
        """Run one task from start to end (holding a GPU it runs on: `device.exclusive`)."""
        with exclusive(self.device):
            self.begin(task)
            return self.end(task, self.execute(task))

    def begin(self, task: NodeTask) -> ClientAlgorithm:
        """Before the phase: the task's algorithm (created on the first task), its step and
        parameters, and for a fit task the state to start from (a step run again means the round
        is being redone: from the state before it); then the algorithm's `before_fit`."""
        algo = self.algorithm_for(task.algorithm, task.config)
        algo.ctx.task = TaskInfo(task.step, dict(task.params))
        self._undo_unkept(task, algo)
        if task.phase == "fit":
            # The next step of the same round (multi-step rounds) goes on from here.
            if task.round != self._fit_round or self._before_fit is None:
                # Not copied yet: a stacked round gives the members new tensors and leaves these
                # as they were (coordinator.stacking), and `execute` copies them before it trains.
                self._before_fit, self._fit_steps = algo.shared_state(), []
                self._before_fit_shared = True
            elif task.step in self._fit_steps:
                log.info("%s: round %d again: from the state before it", self.client_id, task.round)
                algo.load_state_dict(self._before_fit)
                self._fit_steps = []
            self._fit_round = task.round
            self._fit_steps.append(task.step)
            algo.before_fit(task.round, task.rounds)
        return algo

    def _undo_unkept(self, task: NodeTask, algo: ClientAlgorithm) -> None:
        """The rule for a round recorded as failed: it changes no state, the clients' included.
        A node whose last trained round is later than the last round the coordinator kept goes
        back to the state before that round (unless this task runs that round again: the step
        logic in `begin` decides then)."""
        kept = task.kept_round
        if kept is None or self._fit_round <= kept or self._before_fit is None:
            return
        if task.phase == "fit" and task.round == self._fit_round:
            return
        log.info(
            "%s: round %d was not kept: back to the state before it",
            self.client_id,
            self._fit_round,
        )
        algo.load_state_dict(self._before_fit)
        self._fit_round, self._before_fit, self._fit_steps = kept, None, []

    def execute(self, task: NodeTask) -> FitResult:
        """The algorithm's phase (after `begin`)."""
        algo = self.current()
        if self._before_fit_shared and self._before_fit is not None:  # it trains in place
            self._before_fit = algo.copied_state(self._before_fit)
        self._before_fit_shared = False
        if task.phase == "fit":
            return algo.fit(task.round, task.rounds, task.models)
        if task.phase == "evaluate":
            return FitResult(metrics=algo.evaluate(task.models))
        return algo.finalize(task.round, task.rounds, task.models)

    def end(self, task: NodeTask, result: FitResult) -> FitResult:
        """After the phase: persist what changed (a fit's training; an evaluation's only where
        its algorithm keeps something of it); after finalize, export the model if asked."""
        algo = self.algorithm
        if task.phase == "fit" or (
            task.phase == "evaluate" and algo is not None and type(algo).evaluation_keeps
        ):
            self._save()
        elif task.phase == "finalize":
            self._finalized()
        return result

    def join_late(
        self,
        algorithm: str,
        config: Mapping[str, Any],
        rounds: int,
        models: Mapping[str, WireModel],
    ) -> FitResult:
        """Personalize from a finished run's archived models (its finalize phase, as for a
        participant), then persist and export."""
        task = NodeTask(rounds, rounds, "finalize", algorithm, config, models)
        return self.run(task)

    def _finalized(self) -> None:
        self.finalized = True
        self._save()
        if self.onnx_path is not None:
            self.exported = self.export_onnx()
            log.info("%s: exported its personalized model to %s", self.client_id, self.exported)

    # -- the algorithm -----------------------------------------------------------------------
    def algorithm_for(self, name: str, config: Mapping[str, Any]) -> ClientAlgorithm:
        """This node's algorithm: created on first use; a different config is refused."""
        cls = algorithm_class(name)
        cfg: BaseAlgorithmConfig = cls.config_cls.model_validate(dict(config))
        key = (name, cfg.model_dump_json())
        if self.algorithm is None and self._parked is not None:
            self._unpark()
        if self.algorithm is None:
            return self._new_algorithm(name, cfg)
        if key != self._algo_key:
            # Never wipe what this device has learned because one task says otherwise.
            raise AlgorithmError(
                f"{self.client_id}: the task's {name} config differs from the one this client "
                "trained with in this run; its state is kept. Start a new run id to change it."
            )
        return self.algorithm

    def _new_algorithm(self, name: str, cfg: BaseAlgorithmConfig) -> ClientAlgorithm:
        ctx = ClientContext(
            client_id=self.client_id,
            spec=self.spec,
            data=self.data,
            device=self.device,
            seed=self.seed,
            trainer=Trainer(self.device, seed=self.seed),
            peers=self.peers,
            budget=self.budget,
        )
        self.algorithm = algorithm_class(name)(ctx, cfg)
        self._algo_key = (name, cfg.model_dump_json())
        return self.algorithm

    def current(self) -> ClientAlgorithm:
        """The algorithm of the task begun (`begin`)."""
        if self.algorithm is None:
            raise RuntimeError(f"{self.client_id}: no task has begun")
        return self.algorithm

    # -- persistence -------------------------------------------------------------------------
    def _snapshot(self) -> dict[str, Any]:
        """Everything this node keeps between tasks, as a state file holds it."""
        assert self.algorithm is not None and self._algo_key is not None
        return {
            "run": self.run_id,
            "client": self.client_id,
            "algorithm": self._algo_key[0],
            "config": self._algo_key[1],
            "fit_round": self._fit_round,
            "fit_steps": list(self._fit_steps),
            "before_fit": self._before_fit,
            "finalized": self.finalized,
            "state": self.algorithm.state_dict(),
        }

    def _resume(self, saved: Mapping[str, Any]) -> None:
        """Rebuild the algorithm and the round bookkeeping from a `_snapshot`."""
        cls = algorithm_class(saved["algorithm"])
        algo = self._new_algorithm(
            saved["algorithm"], cls.config_cls.model_validate(json.loads(saved["config"]))
        )
        algo.load_state_dict(saved["state"])
        self._fit_round, self._before_fit = int(saved["fit_round"]), saved["before_fit"]
        self._before_fit_shared = False  # read back: its own tensors
        self._fit_steps = [str(s) for s in saved.get("fit_steps", [""])]
        self.finalized = bool(saved.get("finalized", False))

    def _save(self) -> None:
        """Write the algorithm's whole state (atomically) before the reply goes out."""
        if self.state_path is None or self.algorithm is None or self._algo_key is None:
            return
        save_state(self.state_path, self._snapshot())

    def park(self, where: Path | None = None, *, changed: bool = True) -> None:
        """Between its tasks, keep this node's state as the bytes of a state file, in host
        memory (`where` None) or in the file `where`, and let go of its models, optimizers and
        the state before its round (a simulation of many more clients than a round trains
        holds only those a phase runs). `changed` False: nothing changed since the last park
        (an evaluation that keeps nothing), whose bytes stay. The next task brings it back."""
        if self.algorithm is None:
            return
        if changed or self._parked is None:
            data = state_bytes(self._snapshot())
            if where is None:
                self._parked = data
            else:
                where.write_bytes(data)  # scratch: a lost file is a lost simulation, no fsync
                self._parked = where
        self.algorithm = None
        self._before_fit = None
        self._before_fit_shared = False

    def _unpark(self) -> None:
        """Back from `park`. The bytes stay: parked again after a task that changed nothing,
        they still hold its state."""
        parked = self._parked
        assert parked is not None
        data = parked.read_bytes() if isinstance(parked, Path) else parked
        self._resume(state_from_bytes(data, f"{self.client_id}'s parked state"))

    def restore(self) -> bool:
        """Continue from a state this client saved in this run (a restarted device); True when
        there was one."""
        if self.state_path is None or not self.state_path.exists():
            return False
        try:
            saved = load_state(self.state_path)
            if (saved["run"], saved["client"]) != (self.run_id, self.client_id):
                log.warning(
                    "%s: %s belongs to %s/%s; starting fresh",
                    self.client_id,
                    self.state_path,
                    saved["run"],
                    saved["client"],
                )
                return False
            self._resume(saved)
        except (StateError, KeyError, ValueError) as exc:
            raise StateError(
                f"{self.client_id}: cannot resume from {self.state_path}: {exc}"
            ) from exc
        self.resumed_after = self._fit_round
        log.info(
            "%s: resumed from %s (trained up to round %d)",
            self.client_id,
            self.state_path,
            self._fit_round,
        )
        return True

    # -- export ------------------------------------------------------------------------------
    def export_onnx(self, path: str | Path | None = None) -> Path:
        """Export the personalized model to ONNX (verified against PyTorch)."""
        from edge_sdk.export import export_onnx

        if self.algorithm is None and self._parked is not None:
            self._unpark()
        if self.algorithm is None:
            raise RuntimeError(f"{self.client_id}: nothing trained yet, no model to export")
        target = Path(path) if path else self.onnx_path
        if target is None:
            raise ValueError(f"{self.client_id}: no ONNX path given")
        spec, model = self.algorithm.personalized_model()
        return export_onnx(
            model,
            spec,
            target,
            class_names=self.class_names,
            normalization=self.normalization,
            exporter=self.onnx_exporter,
            sample_inputs=self.data.x_test[:8].cpu() if len(self.data.x_test) else None,
        )
