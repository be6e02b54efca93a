"""FEMNIST and Shakespeare from LEAF's json files.

LEAF writes `<root>/train/*.json` and `<root>/test/*.json`, each file
`{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}`. A user's
train and test samples are pooled (train first) and the user becomes the sample's natural owner
(`Dataset.groups`): the `natural` partition scheme turns each owner into one client.

Users are numbered in order of first appearance, reading the files sorted by name, train files
before test files; `max_users` keeps the first that many users in that order.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from .base import Dataset, DatasetError, DatasetNotFound, stratified_indices

__all__ = [
    "FEMNIST_CLASSES",
    "SHAKESPEARE_SEQ_LEN",
    "SHAKESPEARE_VOCAB",
    "load_femnist",
    "load_shakespeare",
    "read_leaf",
]

logger = logging.getLogger(__name__)

FEMNIST_CLASSES = [
    *(str(d) for d in range(10)),
    *(chr(c) for c in range(ord("A"), ord("Z") + 1)),
    *(chr(c) for c in range(ord("a"), ord("z") + 1)),
]
# LEAF's character set for Shakespeare (its `ALL_LETTERS`): 80 characters, id = position.
SHAKESPEARE_VOCAB = (
    "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
)
SHAKESPEARE_SEQ_LEN = 80
_CHAR_ID = {c: i for i, c in enumerate(SHAKESPEARE_VOCAB)}


def _leaf_files(name: str, root: Path, hint: str) -> list[Path]:
    files: list[Path] = []
    for split in ("train", "test"):
        found = sorted((root / split).glob("*.json"))
        if not found:
            logger.warning("%s: no json files in %s", name, root / split)
        files += found
    if not files:
        raise DatasetNotFound(name, ["train/*.json", "test/*.json"], [root], hint)
    return files


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with path.open("r", encoding="utf-8") as f:
            obj = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: not valid LEAF json ({exc})") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("user_data"), dict):
        raise DatasetError(f"{path}: expected an object with a 'user_data' mapping (LEAF format)")
    users = obj.get("users", list(obj["user_data"]))
    if not isinstance(users, list):
        raise DatasetError(f"{path}: 'users' must be a list")
    return {"users": users, "user_data": obj["user_data"], "num_samples": obj.get("num_samples")}


def read_leaf(
    files: list[Path], max_users: int | None = None
) -> Iterator[tuple[int, str, list[Any], list[Any]]]:
    """Yield (owner index, user id, xs, ys) for every user block in `files`, in reading order."""
    if max_users is not None and max_users <= 0:
        raise DatasetError(f"max_users must be a positive integer or None, got {max_users}")
    owner: dict[str, int] = {}
    for path in files:
        obj = _read_json(path)
        counts = obj["num_samples"]
        for pos, user in enumerate(obj["users"]):
            if user not in owner:
                if max_users is not None and len(owner) >= max_users:
                    continue
                owner[user] = len(owner)
            block = obj["user_data"].get(user)
            if not isinstance(block, dict) or "x" not in block or "y" not in block:
                raise DatasetError(f"{path}: user {user!r} has no 'x'/'y' lists in user_data")
            xs, ys = block["x"], block["y"]
            if len(xs) != len(ys):
                raise DatasetError(f"{path}: user {user!r} has {len(xs)} x but {len(ys)} y")
            if isinstance(counts, list) and pos < len(counts) and counts[pos] != len(ys):
                raise DatasetError(
                    f"{path}: num_samples says {counts[pos]} for user {user!r} but it has {len(ys)}"
                )
            yield owner[user], str(user), xs, ys


def _finish(
    name: str,
    x: torch.Tensor,
    y: np.ndarray,
    groups: np.ndarray,
    classes: list[str],
    max_samples: int | None,
    seed: int,
) -> Dataset:
    if len(y) == 0:
        raise DatasetError(f"{name}: the json files hold no samples")
    keep = stratified_indices(y, max_samples, seed)
    if len(keep) < len(y):
        x, y, groups = x[torch.from_numpy(keep)], y[keep], groups[keep]
    logger.info("loaded %s: %d samples from %d users", name, len(y), len(np.unique(groups)))
    return Dataset(
        name=name,
        x=x,
        y=torch.from_numpy(y.astype(np.int64)),
        classes=list(classes),
        input_shape=tuple(x.shape[1:]),
        normalization=None,
        groups=groups.astype(np.int64),
    )


def load_femnist(
    root: str | Path,
    *,
    max_users: int | None = None,
    max_samples: int | None = None,
    seed: int = 0,
) -> Dataset:
    """FEMNIST: 28x28 handwritten characters, (N, 1, 28, 28) float32, 62 classes, one owner per
    writer. Pixel values are kept as LEAF stores them (floats in [0, 1], 1.0 = white
    background); `normalization` is None."""
    root = Path(root)
    hint = (
        "Nothing is downloaded: run LEAF's femnist preprocessing and copy its data/train and "
        f"data/test folders of .json files to {root}/train and {root}/test."
    )
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    gs: list[np.ndarray] = []
    for owner, user, x_list, y_list in read_leaf(_leaf_files("femnist", root, hint), max_users):
        if not y_list:
            continue
        try:
            x = np.asarray(x_list, dtype=np.float32)
            y = np.asarray(y_list, dtype=np.int64)
        except (ValueError, TypeError) as exc:
            raise DatasetError(f"femnist: user {user!r} has non-numeric x or y ({exc})") from exc
        if x.ndim != 2 or x.shape[1] != 784:
            raise DatasetError(
                f"femnist: user {user!r} samples must be flat lists of 784 pixels, got {x.shape}"
            )
        if y.min() < 0 or y.max() >= len(FEMNIST_CLASSES):
            raise DatasetError(f"femnist: user {user!r} has labels outside 0..61")
        xs.append(x.reshape(-1, 1, 28, 28))
        ys.append(y)
        gs.append(np.full(len(y), owner, dtype=np.int64))
    if not ys:
        raise DatasetError(f"femnist: the json files under {root} hold no samples")
    return _finish(
        "femnist",
        torch.from_numpy(np.concatenate(xs)),
        np.concatenate(ys),
        np.concatenate(gs),
        FEMNIST_CLASSES,
        max_samples,
        seed,
    )


def _encoder(on_unknown: str) -> Callable[[str], list[int] | None]:
    def encode(text: str) -> list[int] | None:
        ids = [_CHAR_ID.get(c, -1) for c in text]
        if -1 in ids:
            if on_unknown == "drop":
                return None
            bad = sorted({c for c in text if c not in _CHAR_ID})
            raise DatasetError(
                f"shakespeare: characters {bad!r} are not in LEAF's 80-character vocabulary; "
                "pass on_unknown='drop' to skip such samples"
            )
        return ids

    return encode


def load_shakespeare(
    root: str | Path,
    *,
    max_users: int | None = None,
    max_samples: int | None = None,
    seed: int = 0,
    on_unknown: Literal["drop", "error"] = "drop",
) -> Dataset:
    """Shakespeare next-character prediction: x int64 (N, 80) character ids, y the id of the
    next character, 80 classes (the vocabulary characters), one owner per speaking role.

    Characters outside LEAF's vocabulary are not given a reserved id (that would make the token
    range exceed the 80 classes a model is built for): the sample holding one is dropped and
    counted in a warning (`on_unknown="drop"`, default) or the load fails
    (`on_unknown="error"`).
    """
    if on_unknown not in ("drop", "error"):
        raise DatasetError(f"shakespeare: on_unknown must be 'drop' or 'error', got {on_unknown!r}")
    root = Path(root)
    hint = (
        "Nothing is downloaded: run LEAF's shakespeare preprocessing and copy its data/train "
        f"and data/test folders of .json files to {root}/train and {root}/test."
    )
    encode = _encoder(on_unknown)
    rows: list[list[int]] = []
    labels: list[int] = []
    owners: list[int] = []
    dropped = 0
    for owner, user, x_list, y_list in read_leaf(_leaf_files("shakespeare", root, hint), max_users):
        for text, target in zip(x_list, y_list, strict=True):
            if not isinstance(text, str) or not isinstance(target, str) or len(target) != 1:
                raise DatasetError(
                    f"shakespeare: user {user!r} sample must be (string, one character), got "
                    f"({type(text).__name__}, {target!r})"
                )
            if len(text) != SHAKESPEARE_SEQ_LEN:
                raise DatasetError(
                    f"shakespeare: user {user!r} has a {len(text)}-character input; LEAF inputs "
                    f"are {SHAKESPEARE_SEQ_LEN} characters"
                )
            ids = encode(text + target)
            if ids is None:
                dropped += 1
                continue
            rows.append(ids[:-1])
            labels.append(ids[-1])
            owners.append(owner)
    if dropped:
        logger.warning("shakespeare: dropped %d samples with out-of-vocabulary characters", dropped)
    if not labels:
        raise DatasetError(f"shakespeare: the json files under {root} hold no usable samples")
    x = torch.tensor(rows, dtype=torch.int64).reshape(-1, SHAKESPEARE_SEQ_LEN)
    return _finish(
        "shakespeare",
        x,
        np.asarray(labels, dtype=np.int64),
        np.asarray(owners, dtype=np.int64),
        list(SHAKESPEARE_VOCAB),
        max_samples,
        seed,
    )
