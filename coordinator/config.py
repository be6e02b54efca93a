"""One typed config for a whole run, loadable from TOML, every field overridable.

Precedence, written once here: field defaults < TOML file < environment variables `EDGEFL_*`
(pydantic-settings; `__` separates nested fields: `EDGEFL_FML__ALPHA=0.3`,
`EDGEFL_BROKER__PASSWORD=...`) < CLI flags < `--set key=value` overrides (dotted keys for nested
fields, e.g. `fml.alpha=0.3`, `data.partition_params.alpha=0.1`; values parse as JSON when they
can, e.g. `models=["mlp","lenet5"]`, else as strings). The broker password may come only from the
environment or `broker.password_file`: never from a flag (it would show in `ps`) or a TOML file.
The simulator, the coordinator daemon and `edgefl client` all read this one config.
Every algorithm registered in `edge_sdk.algorithms` gets a section named after it, holding its
config with the defaults from algorithms.md; adding an algorithm adds its section by itself
(one registered by a plugin too, when the plugin is loaded before the config).

Typos are caught: an unknown key (`--set fml.alpah=0.3`, a TOML key, `EDGEFL_ROUNDZ=1`) is
refused or, for environment variables, warned about, naming the valid keys nearest to it.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import os
import tomllib
import types
import typing
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from edge_sdk.auth import AuthSettings
from edge_sdk.budget import DeployBudget
from edge_sdk.transport.settings import BrokerSettings

if TYPE_CHECKING:
    from edge_sdk.algorithms import BaseAlgorithmConfig

__all__ = [
    "ENV_PREFIX",
    "ClientConfig",
    "ConfigError",
    "DataConfig",
    "DeployConfig",
    "RobustConfig",
    "RoundConfig",
    "RunConfig",
    "load_config",
    "parse_overrides",
    "run_config_model",
    "setting_field",
    "setting_keys",
    "unknown_env_settings",
    "write_config",
]

ENV_PREFIX = "EDGEFL_"
# EDGEFL_* variables that are not settings: read elsewhere, never warned about.
ENV_NOT_SETTINGS = frozenset({"EDGEFL_PLUGINS"})

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config file or override that does not validate; the message names the field."""


class RoundConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # Defaults for a small fleet: a phase waits up to two minutes for a client that is online
    # but slow (one whose connection drops, `reconnect_grace_s`), and a round counts with half
    # of its replies, so one dead client never stalls or fails a round.
    deadline_s: float = Field(
        120.0, gt=0, description="seconds a round's phase waits for the clients' replies"
    )
    finalize_deadline_s: float | None = Field(
        None,
        gt=0,
        description="seconds the finalize phase (fine-tuning, distillation, ONNX export and its "
        "verification) waits, which may take longer than a round's phases; none: deadline_s",
    )
    quorum: float = Field(
        0.5, gt=0, le=1, description="the fraction of a round's tasks that must reply validly"
    )
    reconnect_grace_s: float = Field(
        10.0,
        ge=0,
        description="seconds a client whose connection dropped is still given tasks and waited "
        "for: a flaky network or a broker restart costs no reply, a dead client one such wait",
    )
    register_timeout_s: float = Field(
        600.0,
        gt=0,
        description="seconds the coordinator waits for its clients to register (clients started "
        "by hand, or slow to import torch, take minutes)",
    )
    eval_every: int = Field(
        1, ge=1, description="evaluate on every client every N rounds (and after the last)"
    )
    min_clients: int | None = Field(
        None,
        ge=1,
        description="start with this many registered clients if the others do not come within "
        "register_timeout_s; none: all",
    )
    retries: int = Field(
        1,
        ge=0,
        description="how often a round that misses its quorum runs again (new sampling, from "
        "where the clients were before it) before it is recorded as failed, state unchanged",
    )
    client_history: int = Field(
        100_000,
        ge=0,
        description="the most client-rounds (registered clients x rounds) whose per-client parts "
        "the run keeps in memory, its checkpoint and results.json; a larger fleet keeps counts, "
        "means and spreads per round (rounds.jsonl always has every client's line)",
    )


Aggregator = Literal["mean", "median", "trimmed_mean", "krum"]


class RobustConfig(BaseModel):
    """`[robust]` of a run config: how the coordinator bounds what one client can do."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    aggregator: Aggregator = Field(
        "mean",
        description="how the (clipped) updates combine: mean (weighted), median, trimmed_mean "
        "or krum",
    )
    trim: float = Field(
        0.2, ge=0, lt=0.5, description="trimmed_mean's share cut at each end (its beta)"
    )
    krum_f: int = Field(
        1, ge=0, description="krum's f: the attackers it tolerates (it needs 2f + 3 replies)"
    )
    # These defaults met the attack benchmark's goals at a measured cost to honest runs
    # (docs/security.md).
    clip: float = Field(
        3.0, ge=0, description="bound an update's norm at clip x the cohort's median (0: no bound)"
    )
    center_clip: float = Field(
        2.0,
        ge=0,
        description="pull a contribution farther than center_clip x the median distance from the "
        "coordinate-wise median of its aggregate's contributions in to that distance (0: never)",
    )
    weight_cap: float = Field(
        1.5,
        ge=0,
        description="cap a sample weight (weighting by_samples) at weight_cap x the round's "
        "median (0: no cap)",
    )
    max_samples: int | None = Field(
        None, ge=1, description="cap a sample weight at this many samples; none: no maximum"
    )
    max_abs: float = Field(
        1e6,
        gt=0,
        description="reject a fit reply with a weight (or buffer) larger than this in absolute "
        "value",
    )
    rollback: bool = Field(
        True,
        description="roll back a round whose evaluation shows more than rollback_share of the "
        "clients rollback_drop or more below the last evaluation",
    )
    rollback_drop: float = Field(
        0.1, gt=0, le=1, description="the accuracy drop (a fraction) that counts for rollback"
    )
    rollback_share: float = Field(
        0.5, ge=0, lt=1, description="the share of clients that must drop for a rollback"
    )


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset: str = Field(
        "digits", description="the dataset: digits, fashion_mnist, synthetic, ... (`edgefl zoo`)"
    )
    root: str | None = Field(
        None,
        description="directory of the dataset files (never downloaded); none: the dataset's own",
    )
    max_samples: int | None = Field(
        None, ge=1, description="a seeded subset of the pooled data, this many samples; none: all"
    )
    options: dict[str, Any] = Field(
        {}, description='the loader\'s keyword arguments, e.g. {"size": 8} for digits'
    )
    partition: str = Field(
        "dirichlet",
        description="how the data is split among the clients: iid, shards, dirichlet, "
        "ds1..ds4, ... (`edgefl zoo`)",
    )
    partition_params: dict[str, Any] = Field(
        {}, description='the partition\'s parameters, e.g. {"alpha": 0.5}'
    )
    split: tuple[float, float, float] = Field(
        (0.6, 0.2, 0.2), description="each client's train/val/test fractions [PersFL]"
    )
    seed: int | None = Field(
        None,
        description="the data side's seed (the subset, the split, a held-out set): fixed while "
        "seed varies, the clients keep their data and only training's randomness changes; "
        "none: the run's seed",
    )


class ClientConfig(BaseModel):
    """`edgefl client`: which client of the split this process is (its data, id, model)."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, description="this client's id; none: the split's, c<INDEX>")
    # No default: two clients started without it would both be client 0.
    index: int | None = Field(
        None,
        ge=0,
        description="which client of the split this process is, which decides its data "
        "(required by `edgefl client`)",
    )
    model: str | None = Field(
        None, description="this client's architecture family; none: models[INDEX]"
    )
    state_dir: str = Field(
        "edgefl-state",
        description="its state, its run config and, after the run, its ONNX model",
    )
    late: bool = Field(
        False,
        description="join a finished run: personalize from its archive (PersFL), without "
        "training in it",
    )


class DeployConfig(DeployBudget):
    """What the clients may deploy, by what their devices can run (edge_sdk.budget): `allow`
    and `max_params` for every client, and `clients` for those with budgets of their own, by
    id. Default: every client deploys a model of its own architecture only."""

    clients: dict[str, DeployBudget] = Field(
        default_factory=dict,
        description='budgets of their own, by client id (e.g. {"c3": {"allow": ["any"]}})',
    )

    def for_client(self, client_id: str) -> DeployBudget:
        """`client_id`'s budget: its own where `clients` names it, else the common one."""
        own = self.clients.get(client_id)
        if own is not None:
            return own
        return DeployBudget(allow=self.allow, max_params=self.max_params)


class RunConfig(BaseModel):
    """Everything a run needs. `load_config` returns it with a validated section per algorithm.

    Every setting's `description` is its help: `edgefl COMMAND --help` shows it for the flag
    that sets it (coordinator.cli_common), and the settings reference beside its key."""

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
    cohort: bool = Field(
        True,
        description="in-process clients of one architecture train each phase together as one "
        "stacked model where their algorithm can (every built-in one but FedeRiCo; a plugin's "
        "is checked once against one client alone); false: one by one",
    )
    cohort_auto: bool = Field(
        True,
        description="time each group's fits both ways, stacked and one by one, and train it the "
        "faster way (the same results to float rounding); false: always stacked, so that two "
        "runs take the same path to the bit",
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


# -- keys, and the nearest valid ones to a typo ---------------------------------------------------
def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (through `X | None`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _section_model(arg)
            if found is not None:
                return found
    return None


def _model_at(model: type[BaseModel], path: Sequence[str]) -> type[BaseModel] | None:
    for part in path:
        field = model.model_fields.get(part)
        inner = _section_model(field.annotation) if field is not None else None
        if inner is None:
            return None
        model = inner
    return model


def _keys(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, field in model.model_fields.items():
        inner = _section_model(field.annotation)
        if inner is None:
            yield prefix + name
        else:
            yield from _keys(inner, f"{prefix}{name}.")


def setting_field(key: str) -> FieldInfo:
    """The field of the dotted setting `key` (`rounds`, `round.deadline_s`) in `RunConfig`,
    whose `description` is the setting's help. The algorithms' sections are not there (they
    need torch): a KeyError names what is."""
    model: type[BaseModel] | None = RunConfig
    *path, leaf = key.split(".")
    for i, part in enumerate(path):
        field = model.model_fields.get(part) if model is not None else None
        model = _section_model(field.annotation) if field is not None else None
        if model is None:
            raise KeyError(f"{'.'.join(path[: i + 1])} is not a section of RunConfig")
    assert model is not None
    field = model.model_fields.get(leaf)
    if field is None or _section_model(field.annotation) is not None:
        raise KeyError(f"{key} is not a setting of RunConfig")
    return field


def setting_keys() -> list[str]:
    """Every setting's dotted key (`rounds`, `fml.alpha`, `round.deadline_s`...), sorted."""
    return sorted(_keys(run_config_model()))


def _nearest(typo: str) -> list[str]:
    """The valid dotted keys nearest to `typo`: close ones in its own section first, else close
    ones anywhere, and keys of the same name in other sections (`alpha` -> `fml.alpha`)."""
    keys = setting_keys()
    section = typo.rpartition(".")[0]
    siblings = [k for k in keys if k.startswith(section + ".")] if section else keys
    near = difflib.get_close_matches(typo, siblings, n=3, cutoff=0.6)
    if not near:
        near = difflib.get_close_matches(typo, keys, n=3, cutoff=0.6)
    leaf = typo.rpartition(".")[2]
    return near + [k for k in keys if k.rpartition(".")[2] == leaf and k not in near][:3]


def _hint(typo: str, near: Sequence[str]) -> str:
    if near:
        return "did you mean " + " or ".join(near) + "?"
    path = typo.split(".")[:-1]
    model = _model_at(run_config_model(), path)
    valid = sorted(model.model_fields) if model is not None else []
    where = ".".join(path) or "the top level"
    return f"valid keys in {where}: {', '.join(valid)}" if valid else "no such setting"


def _error_text(err: Mapping[str, Any]) -> str:
    """One pydantic error as a user reads it: the key, then what is wrong, without pydantic's
    `Value error,` prefix; an unknown key comes with the nearest valid ones."""
    loc = [str(x) for x in err["loc"]]
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        return f"{key}: unknown setting; {_hint(key, _nearest(key))}"
    msg = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
    return f"{key}: {msg}" if key else msg


def unknown_env_settings(environ: Mapping[str, str] | None = None) -> list[str]:
    """A warning for each `EDGEFL_*` variable that names no setting (it would be ignored)."""
    env = os.environ if environ is None else environ
    model = run_config_model()
    warnings = []
    for var in sorted(env):
        upper = var.upper()
        if not upper.startswith(ENV_PREFIX) or upper in ENV_NOT_SETTINGS:
            continue
        path = upper[len(ENV_PREFIX) :].lower().split("__")
        node: type[BaseModel] | None = model
        for i, part in enumerate(path):
            assert node is not None
            field = node.model_fields.get(part)
            if field is None:
                typo = ".".join(path[: i + 1])
                near = [ENV_PREFIX + k.upper().replace(".", "__") for k in _nearest(typo)]
                warnings.append(f"{var} is not a setting and is ignored; {_hint(typo, near)}")
                break
            node = _section_model(field.annotation)
            if node is None:  # a value (or a dict of them): whatever follows is its content
                break
    return warnings


def parse_overrides(pairs: Iterable[str]) -> dict[str, Any]:
    """`["fml.alpha=0.3", "models=[\\"mlp\\"]"]` → {"fml.alpha": 0.3, "models": ["mlp"]}."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {pair!r} is not of the form key=value")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out[key.strip()] = value
    return out


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.get(p)
        if not isinstance(child, dict):
            child = node[p] = {} if child is None else _as_dict(child, dotted)
        node = child
    node[parts[-1]] = value


def _as_dict(value: Any, dotted: str) -> dict[str, Any]:
    if isinstance(value, BaseModel):
        return value.model_dump()
    raise ConfigError(f"cannot set {dotted!r}: {value!r} is not a section")


def _apply_training(tree: dict[str, Any], algorithms: list[str], key: str, value: Any) -> None:
    """Set one common training flag on every algorithm of the run whose config has it."""
    from edge_sdk.algorithms import algorithm_class, algorithm_names

    known = set(algorithm_names())
    takers = [
        n for n in algorithms if n in known and key in algorithm_class(n).config_cls.model_fields
    ]
    if not takers and any(n in known for n in algorithms):
        raise ConfigError(
            f"--{key.replace('_', '-')}: no algorithm of this run ({', '.join(algorithms)}) has a "
            f"{key!r} setting (federico takes one gradient step per round: give it more rounds)"
        )
    skipped = [n for n in algorithms if n in known and n not in takers]
    if skipped:
        log.warning("%s=%s applies to %s, not to %s", key, value, takers, skipped)
    for name in takers:
        _set_dotted(tree, f"{name}.{key}", value)


def _env_tree() -> dict[str, Any]:
    """What the environment says (`EDGEFL_*`), as a nested dict of raw values; variables that
    name no setting are left out (`unknown_env_settings` warns about them)."""

    class _FromEnv(BaseSettings, run_config_model()):  # type: ignore[misc]
        model_config = SettingsConfigDict(
            env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid"
        )

    return _known(dict(EnvSettingsSource(_FromEnv)()), run_config_model())


def _known(tree: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    """`tree` without the keys `model` has no field for (recursively, through sections)."""
    out = {}
    for key, value in tree.items():
        field = model.model_fields.get(key)
        if field is None:
            continue
        inner = _section_model(field.annotation)
        out[key] = _known(value, inner) if inner and isinstance(value, dict) else value
    return out


def _deep_merge(tree: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(tree.get(key), dict):
            _deep_merge(tree[key], value)
        else:
            tree[key] = value


def _refuse_secrets(tree: Mapping[str, Any], source: str) -> None:
    broker = tree.get("broker")
    if isinstance(broker, Mapping):
        url = str(broker.get("url") or "")
        if "password" in broker or ("@" in url and ":" in url.split("@")[0].split("//")[-1]):
            raise ConfigError(
                f"the broker password cannot come from {source}: set {ENV_PREFIX}BROKER__PASSWORD "
                "or broker.password_file (a file readable only by you)"
            )


def load_config(
    path: str | Path | None = None,
    flags: Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    training: Mapping[str, Any] | None = None,
    environ: bool = True,
) -> RunConfig:
    """Defaults < TOML at `path` < `EDGEFL_*` environment < `flags` (dotted keys, None = not
    given) < `overrides`.

    `training` holds the common local-training flags (local_epochs, batch_size, lr): each
    applies to the run's algorithm and to every baseline whose config has that field, so all are
    compared on the same budget. They resolve against the final algorithm and baselines, after
    `overrides` (e.g. `--set algorithm=pfml --lr 0.05` sets pfml.lr), and an override of the
    same field in a section (`--set pfml.lr=0.02`) still wins. A flag that no algorithm of the
    run takes is an error (federico takes one gradient step per round, not epochs).
    """
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            tree = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: invalid TOML: {exc}") from exc
        _refuse_secrets(tree, f"the config file {p}")
    file_tree = copy.deepcopy(tree)
    if environ:
        for warning in unknown_env_settings():
            log.warning(warning)
        _deep_merge(tree, _env_tree())
    given: dict[str, Any] = {}
    for key, value in (flags or {}).items():
        if value is not None:
            _set_dotted(given, key, value)
    for key, value in (overrides or {}).items():
        _set_dotted(given, key, value)
    _refuse_secrets(given, "a command-line flag (it would show in ps)")
    for key, value in (flags or {}).items():
        if value is not None:
            _set_dotted(tree, key, value)
    final = copy.deepcopy(tree)  # where the overrides leave the algorithm and the baselines
    for key, value in (overrides or {}).items():
        _set_dotted(final, key, value)
    algorithms = [final.get("algorithm", RunConfig.model_fields["algorithm"].default)]
    algorithms += [b for b in final.get("baselines", []) if b not in algorithms]
    for key, value in (training or {}).items():
        if value is not None:
            _apply_training(tree, algorithms, key, value)
    for key, value in (overrides or {}).items():
        _set_dotted(tree, key, value)
    try:
        return run_config_model().model_validate(tree)
    except ValidationError as exc:
        # A bad value that came from the file (nothing later set that key) names the file.
        later = set(_dotted(_env_tree() if environ else {})) | set(_dotted(given))
        from_file = set(_dotted(file_tree)) - later
        msgs = "; ".join(
            f"{path}: {text}" if ".".join(map(str, e["loc"])) in from_file else text
            for e in exc.errors()
            for text in [_error_text(e)]
        )
        raise ConfigError(f"invalid config: {msgs}") from exc


def _dotted(tree: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Every key of a nested dict, dotted (`data.partition`), sections included."""
    for key, value in tree.items():
        yield prefix + key
        if isinstance(value, Mapping):
            yield from _dotted(value, f"{prefix}{key}.")


def _without_nulls(value: Any) -> Any:
    """TOML has no null: drop None fields (their defaults are None) recursively."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def write_config(cfg: RunConfig, path: str | Path, header: str = "") -> Path:
    """`cfg` as TOML that `load_config` reads back to the same config (never the password);
    `header` lines go first, as comments."""
    import tomli_w

    from model_zoo.files import write_atomic

    tree = _without_nulls(cfg.model_dump(mode="json", exclude={"broker": {"password"}}))
    comments = "".join(f"# {line}\n" for line in header.splitlines())
    return write_atomic(path, comments + tomli_w.dumps(tree))


def __getattr__(name: str) -> Any:
    # Names kept for code written before the vocabulary was settled (client: the participant;
    # device: where tensors compute).
    if name == "DeviceConfig":
        warnings.warn(
            "coordinator.config.DeviceConfig is deprecated: it is ClientConfig",
            DeprecationWarning,
            stacklevel=2,
        )
        return ClientConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
