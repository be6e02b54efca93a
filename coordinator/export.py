"""`edgefl export`: a trained client's personalized model as ONNX, from what its run left on disk.

A client's algorithm state (`<id>.state`, written after every task) holds its personalized
model. It is found in a device's state directory (`edgefl client --state-dir`), or anywhere
under a run's output: the demo's `devices/<id>/`, `simulate --export-onnx`'s `state/`. The run
config, needed to rebuild the client's data (for static int8 calibration and the accuracy
check), comes from `--config`, else from what the run wrote next to the state: `<id>.run.toml`
(`edgefl client`), `demo.toml` (the demo) or `results.json` (`simulate`), looked for from the
state's folder up to the source folder. `--set` overrides a setting of either.

Every format is checked against PyTorch on the client's own test split (`edge_sdk.variants`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from coordinator.config import ConfigError, load_config
from coordinator.federation import (
    Federation,
    client_seed,
    client_spec,
    config_family,
    prepare_federation,
)
from coordinator.run_config import RunConfig
from coordinator.strategies import by_what, count_clients
from edge_sdk.algorithms import ClientContext, algorithm_class
from edge_sdk.state import load_state
from edge_sdk.trainer import Trainer
from edge_sdk.variants import VariantReport, export_variants, unsupported

__all__ = [
    "CALIBRATION_SAMPLES",
    "RUN_CONFIG_SUFFIX",
    "ClientExport",
    "ExportError",
    "export_clients",
    "find_states",
]

log = logging.getLogger(__name__)

CALIBRATION_SAMPLES: Final[int] = 256  # training inputs a static int8 model is calibrated on
RUN_CONFIG_SUFFIX: Final[str] = ".run.toml"  # `edgefl client` writes STATE_DIR/<id>.run.toml


class ExportError(ValueError):
    """Nothing to export where asked, or not enough to rebuild a client; the message says why."""


@dataclass(frozen=True)
class ClientExport:
    client_id: str
    arch: str
    reports: list[VariantReport]
    skipped: dict[str, str]  # format -> why this model cannot take it


def find_states(source: Path) -> dict[str, Path]:
    """Client id -> state file, for a `.state` file or every one under the folder `source`
    (coordinator checkpoints excluded)."""
    if not source.exists():
        raise ExportError(f"{source} does not exist")
    if source.is_file():
        if source.suffix != ".state":
            raise ExportError(f"{source} is not a client state file (<id>.state)")
        return {source.stem: source}
    found: dict[str, Path] = {}
    for path in sorted(source.rglob("*.state")):
        if path.name.startswith("checkpoint-"):
            continue
        if path.stem in found:
            raise ExportError(
                f"two states of client {path.stem} under {source}: {found[path.stem]} and "
                f"{path}; pass the one you mean"
            )
        found[path.stem] = path
    if not found:
        raise ExportError(
            f"no client state (<id>.state) under {source}: export from a device's --state-dir, "
            "a demo's output, or a simulate output written with --export-onnx"
        )
    return found


def _config_near(
    state: Path, source: Path, overrides: Mapping[str, Any] | None = None
) -> RunConfig | None:
    """The run config the run wrote nearest to `state`, up to `source`, with `overrides`."""
    own = state.with_name(state.stem + RUN_CONFIG_SUFFIX)
    if own.is_file():
        return load_config(own, None, overrides)
    folder = state.parent
    stop = source if source.is_dir() else source.parent
    while True:
        if (folder / "demo.toml").is_file():
            return load_config(folder / "demo.toml", None, overrides)
        results = folder / "results.json"
        if results.is_file():
            tree = json.loads(results.read_text()).get("config")
            if isinstance(tree, dict):
                tree.pop("broker", None)  # not needed here, and never a password
                return load_config(results, None, overrides, written=tree)
        if folder == stop or folder.parent == folder or stop not in folder.parents:
            return None
        folder = folder.parent


def _index(cfg: RunConfig, fed: Federation, client_id: str) -> int:
    own = cfg.client.index
    if own is not None and (cfg.client.id or fed.client_ids[own]) == client_id:
        return own
    if client_id in fed.client_ids:
        return fed.client_ids.index(client_id)
    raise ExportError(
        f"cannot tell which client of the split {client_id} is (the split's clients are "
        f"{', '.join(fed.client_ids)}): pass --set client.index=I"
    )


def _personalized(
    cfg: RunConfig, fed: Federation, client_id: str, saved: Mapping[str, Any]
) -> tuple[Any, Any, int]:
    """(spec, model, index) of the client's personalized model, rebuilt from its state."""
    i = _index(cfg, fed, client_id)
    own = cfg.client.index == i and cfg.client.model is not None
    family = cfg.client.model if own else config_family(cfg, i)
    assert family is not None
    device = torch.device("cpu")
    seed = client_seed(cfg.seed, i)
    ctx = ClientContext(
        client_id=client_id,
        spec=client_spec(cfg, family, fed.dataset),
        data=fed.client_data[i],
        device=device,
        seed=seed,
        trainer=Trainer(device, seed=seed),
    )
    cls = algorithm_class(str(saved["algorithm"]))
    algo = cls(ctx, cls.config_cls.model_validate(json.loads(saved["config"])))
    algo.load_state_dict(saved["state"])
    spec, model = algo.personalized_model()
    return spec, model, i


def export_clients(
    source: Path,
    formats: Sequence[str],
    *,
    out: Path | None = None,
    clients: Sequence[str] | None = None,
    config: RunConfig | None = None,
    overrides: Mapping[str, Any] | None = None,
    calibration_samples: int = CALIBRATION_SAMPLES,
    on_client: Callable[[ClientExport], None] | None = None,
    keep_fp32: bool = False,
) -> list[ClientExport]:
    """Export the personalized model of every client state under `source` (or of `clients`)
    in `formats`, each checked against PyTorch on the client's own test split. Files go to
    `out/<id>.onnx` (and `<id>.<format>.onnx`), by default next to each state file. A format a
    client's model cannot take is skipped for that client, with the reason in `skipped`.
    Without `config`, each client's run config is the one its run wrote nearest to its state,
    with `overrides` (dotted keys, as `--set` gives them) set. `keep_fp32`: an fp32 file of the
    client's model already there (the run's own, just written) is kept (`export_variants`)."""
    states = find_states(source)
    if clients:
        missing = [c for c in clients if c not in states]
        if missing:
            raise ExportError(
                f"no state for {', '.join(missing)} under {source}; found: {', '.join(states)}"
            )
        states = {c: states[c] for c in clients}
    feds: dict[str, Federation] = {}  # one split per distinct config
    done = []
    unfinalized: dict[str, object] = {}  # found, not named, never finalized: their algorithm
    for cid, path in states.items():
        saved = load_state(path)
        if saved.get("client") != cid:
            raise ConfigError(f"{path} holds the state of {saved.get('client')!r}, not {cid!r}")
        # False: no finalize task ran there (a run that ended before it, or a simulation that
        # finalized a sample without it); a state written before the flag has none.
        if saved.get("finalized") is False:
            if not clients:
                unfinalized[cid] = saved.get("algorithm")
                continue
            log.warning(
                "%s was never finalized: its model is %s's as the rounds left it, which no "
                "guard chose (no finalize task ran there)",
                cid,
                saved.get("algorithm"),
            )
        cfg = config or _config_near(path, source, overrides)
        if cfg is None:
            raise ExportError(
                f"no run config for {cid} near {path} (<id>{RUN_CONFIG_SUFFIX}, demo.toml or "
                "results.json): pass the one the run used with --config"
            )
        key = cfg.model_dump_json(exclude={"client"})
        if key not in feds:
            feds[key] = prepare_federation(cfg)
        fed = feds[key]
        spec, model, i = _personalized(cfg, fed, cid, saved)
        data = fed.client_data[i]
        skipped = {f: why for f in formats if (why := unsupported(model, f)) is not None}
        reports = export_variants(
            model,
            spec,
            (out or path.parent) / f"{cid}.onnx",
            [f for f in formats if f not in skipped],
            eval_inputs=data.x_test,
            eval_labels=data.y_test,
            calibration_inputs=data.x_train[:calibration_samples],
            class_names=fed.dataset.classes,
            normalization=fed.dataset.normalization,
            exporter=cfg.onnx_exporter,
            keep_fp32=keep_fp32,
        )
        result = ClientExport(cid, spec.family, reports, skipped)
        if on_client is not None:
            on_client(result)
        done.append(result)
    if unfinalized:
        said = (
            f"{count_clients(unfinalized)} under {source} never finalized "
            f"({by_what(unfinalized)}): "
            "no finalize task ran there (the run ended before it, or a simulation finalized "
            "a sample without them: round.eval_clients), so their models are the algorithm's "
            "as the rounds left them, which no guard chose. Name one with --client to export "
            "it anyway"
        )
        if not done:
            raise ExportError(f"nothing exported: {said}")
        log.warning("not exported: %s", said)
    return done
