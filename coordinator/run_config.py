"""RunConfig: every setting of a run, typed, its sections included, with one section per
registered algorithm (`run_config_model`). Loading it from files, the environment and flags is
`coordinator.config`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from coordinator.config_sections import (
    ClientConfig,
    DataConfig,
    DeployConfig,
    RobustConfig,
    RoundConfig,
)
from edge_sdk.auth import AuthSettings
from edge_sdk.transport.settings import BrokerSettings

if TYPE_CHECKING:
    from edge_sdk.algorithms import BaseAlgorithmConfig

__all__ = ["CohortMode", "RunConfig", "cohort_mode", "run_config_model"]


CohortMode = Literal["auto", "always", "never"]


def cohort_mode(value: CohortMode | bool) -> CohortMode:
    """The mode a `cohort` setting names. Before "auto", the setting was a switch: true stacked
    every group (now "auto", stacking where it pays), false none ("never")."""
    if isinstance(value, bool):
        return "auto" if value else "never"
    return value


class RunConfig(BaseModel):
    """Everything a run needs. `load_config` returns it with a validated section per algorithm.

    Every setting's `description` is its help: `edgefl COMMAND --help` shows it for the flag
    that sets it (coordinator.cli_settings), and the settings reference beside its key."""

    model_config = ConfigDict(extra="forbid")

    algorithm: str = Field(
        "fml", description="the algorithm: fml, pfml, fedavg, ... (`edgefl zoo`)"
    )
    seed: int = Field(
        0, description="one seed for the data, the models' initialisation and sampling"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where training computes: auto (CUDA if there is one), cpu, cuda"
    )
    rounds: int = Field(5, ge=1, description="communication rounds")
    clients: int = Field(
        10,
        ge=1,
        description="number of clients: the data is split among them, the coordinator waits for "
        "them to register",
    )
    clients_per_round: int | None = Field(
        None, ge=1, description="clients sampled per round; none: all"
    )
    models: list[str] = Field(
        ["lenet5"],
        description="architecture families: one for every client, or several assigned round-robin",
    )
    global_model: str | None = Field(
        None, description="the global (meme) architecture family; none: the first of models"
    )
    model_kwargs: dict[str, dict[str, Any]] = Field(
        {}, description='keyword arguments per family, e.g. {"vgg11": {"width": 0.25}}'
    )
    data: DataConfig = DataConfig()
    round: RoundConfig = RoundConfig()
    robust: RobustConfig = RobustConfig()  # what aggregation bounds (docs/security.md)
    baselines: list[str] = Field(
        [],
        description="algorithms also run on the same split and budget, for the comparison and "
        "the metrics: local, fedavg, fedavg_ft, ...",
    )
    out: str | None = Field(None, description="output directory")
    export_onnx: bool = Field(
        False,
        description="write OUT/onnx/<client>.onnx, and keep each client's state in OUT/state for "
        "`edgefl export`",
    )
    onnx_exporter: Literal["auto", "dynamo", "legacy"] = Field(
        "auto",
        description="the torch exporter of every ONNX file a run writes (a client's model after "
        "the run, export_onnx, --onnx-int8, `edgefl export`): auto (torch.export's, and "
        "TorchScript's where it fails), dynamo or legacy (TorchScript's: deprecated in torch "
        "2.14, but 0.1 s where torch.export's takes 3 s in a fresh process, and 35-110x faster "
        "after: the docs' ONNX export benchmark)",
    )
    broker: BrokerSettings = BrokerSettings()  # with a url: over this MQTT broker, not in memory
    # This participant's signing key and the run's public keys (edgefl keys), or open mode.
    auth: AuthSettings = AuthSettings()
    broadcast: bool = Field(
        True,
        description="send a model many tasks share once, on the broadcast topic; false: a copy "
        "with each task (for ACLs that cannot let clients read the broadcast topic)",
    )
    fp16_upload: bool = Field(
        False, description="clients send their models in fp16: half the upload bytes"
    )
    allow: list[str] | None = Field(
        None, description="the client ids the coordinator admits; none: any, up to clients"
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="the coordinator serves Prometheus metrics on this port; none: off",
    )
    client: ClientConfig = ClientConfig()
    # What each client may deploy (what its device can run): a model of its own architecture
    # unless this allows more (edge_sdk.budget).
    deploy: DeployConfig = DeployConfig()
    parallel: int | None = Field(
        None, ge=1, description="simulated clients that train at once; none: as many as threads"
    )
    fleet: Literal["local", "network"] = Field(
        "local",
        description="local: the simulated clients in this process; network: each an EdgeClient "
        "over the in-memory transport, as a deployment runs them (a broker url implies it)",
    )
    threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads to train with, shared by the simulated clients training at "
        "once; none: the cores this process may use",
    )
    cohort: CohortMode = Field(
        "auto",
        description="in-process clients of one architecture train each phase together as one "
        "stacked model where their algorithm can (every built-in one but FedeRiCo; a plugin's "
        "is checked once against one client alone). auto: where that pays (on a GPU, always; "
        "on the CPU, by the group's architecture and size, as measured); always; never: one "
        "by one. true means auto, false never",
    )
    idle_state: Literal["memory", "host", "disk"] = Field(
        "memory",
        description="where a simulated client's state waits between its tasks: memory (its live "
        "models), host or disk (a state file's bytes in memory or under idle_dir); host and disk "
        "run clients_per_round clients at a time, so memory follows the cohort, not the fleet",
    )
    idle_dir: str | None = Field(
        None, description="the folder of idle_state disk; none: a temporary folder"
    )
    checkpoint: bool = Field(
        False,
        description="simulate: keep a checkpoint in OUT/checkpoint (after every round and task); "
        "started again with the same settings, the run continues from it and ends as it would "
        "have",
    )
    run_id: str = Field("sim", description="the run's id (its topics are named after it)")

    @field_validator("cohort", mode="before")
    @classmethod
    def _cohort_of_bool(cls, value: Any) -> Any:
        return cohort_mode(value)  # (anything else: checked as the Literal)

    @model_validator(mode="after")
    def _check_names(self) -> RunConfig:
        from edge_sdk.algorithms import algorithm_names
        from model_zoo import families
        from model_zoo.data import dataset_names, partition_schemes

        known = algorithm_names()
        for name in [self.algorithm, *self.baselines]:
            if name not in known:
                raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(known)}")
        if not self.models:
            raise ValueError("models must name at least one architecture family")
        known_families = families()
        for family in [*self.models, *([self.global_model] if self.global_model else [])]:
            if family not in known_families:
                raise ValueError(
                    f"unknown architecture family {family!r}; known: {', '.join(known_families)}"
                )
        if self.data.dataset.lower().replace("-", "_") not in dataset_names():
            raise ValueError(
                f"unknown dataset {self.data.dataset!r}; known: {', '.join(dataset_names())}"
            )
        if self.data.partition not in partition_schemes():
            raise ValueError(
                f"unknown partition {self.data.partition!r}; "
                f"known: {', '.join(partition_schemes())}"
            )
        if self.clients_per_round is not None and self.clients_per_round > self.clients:
            raise ValueError(
                f"clients_per_round ({self.clients_per_round}) is more than clients "
                f"({self.clients}): a round cannot sample more clients than there are"
            )
        return self

    def algorithm_config(self, name: str | None = None) -> BaseAlgorithmConfig:
        """The config section of `name` (default: this run's algorithm)."""
        from edge_sdk.algorithms import algorithm_class

        name = name or self.algorithm
        section = getattr(self, name, None)
        return section if section is not None else algorithm_class(name).config_cls()

    @property
    def runs(self) -> list[str]:
        """What a simulation runs, in order: the algorithm, then each baseline that is not it."""
        return [self.algorithm, *[b for b in self.baselines if b != self.algorithm]]

    @property
    def global_family(self) -> str:
        return self.global_model or self.models[0]


_MODELS: dict[tuple[str, ...], type[RunConfig]] = {}


def run_config_model() -> type[RunConfig]:
    """The model load_config validates with: RunConfig plus one section per algorithm
    registered now (built again when a plugin has registered another since)."""
    from edge_sdk.algorithms import algorithm_class, algorithm_names

    names = tuple(algorithm_names())
    if names not in _MODELS:
        sections: dict[str, Any] = {}
        for name in names:
            cls = algorithm_class(name).config_cls
            sections[name] = (cls, Field(default_factory=cls))
        _MODELS[names] = create_model("RunConfig", __base__=RunConfig, **sections)
    return _MODELS[names]
