"""What a device may deploy: its deployment budget.

A device owns its architecture because of what it can run: the microcontroller an MLR, the phone
a CNN, the gateway a VGG. So by default it deploys a model of **its own architecture** and
nothing else. The federation's knowledge still reaches it: through the algorithm (a meme, a
teacher, a peer it learns from) and, where a model it may not run is clearly better, through
distillation into its own architecture (`edge_sdk.algorithms.guard`).

A device that can run more says so with a `DeployBudget`:

    DeployBudget()                                   # its own architecture only (the default)
    DeployBudget(allow=["own", "lenet5"])            # or any LeNet-5
    DeployBudget(allow=["own", "mixture"])           # or a mixture of models of its own
                                                     # architecture (the device runs several)
    DeployBudget(allow=["any"], max_params=200_000)  # any model up to 200k parameters

`allow` names what it may deploy: `own` (its own architecture, always allowed), architecture
families (`lenet5`, `mlp`...: any model of that family), `mixture` (a mixture of allowed
models: it runs each of them on every input) or `any` (any architecture, mixtures included).
`max_params` bounds the deployed model's parameters (a mixture's: all its members'). The
device's own architecture is always within budget, whatever `max_params` says: it was chosen
for the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:  # (a config names a budget without loading torch: `edgefl --help`)
    from torch import nn

    from model_zoo import ArchSpec

__all__ = [
    "ANY",
    "MIXTURE",
    "OWN",
    "DeployBudget",
    "Footprint",
    "arch_name",
    "footprint",
    "members_of",
]

OWN = "own"
MIXTURE = "mixture"
ANY = "any"


class DeployBudget(BaseModel):
    """What a device may deploy (see the module's docstring). Default: its own architecture."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    allow: tuple[str, ...] = Field(
        (OWN,),
        min_length=1,
        description="what a client may deploy, by what its edge device can run: own (its own "
        "architecture), any, architecture families (lenet5) and mixture",
    )
    # The device's own architecture is within budget whatever this says.
    max_params: int | None = Field(
        None,
        ge=1,
        description="the most parameters a deployed model other than the client's own "
        "architecture may hold (a mixture: all its members'); none: no bound",
    )

    @field_validator("allow", mode="before")
    @classmethod
    def _words(cls, value: object) -> object:
        # "own", "any" or "mlr,lenet5" as one string (a CLI flag, an environment variable)
        if isinstance(value, str):
            return tuple(w.strip() for w in value.split(",") if w.strip())
        return value

    @field_validator("allow")
    @classmethod
    def _known(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        named = [w for w in value if w not in (OWN, ANY, MIXTURE)]
        if not named:  # (the default needs no registry: `edgefl --help` loads no torch)
            return value
        from model_zoo import families  # (registered families, plugins' included)

        bad = [w for w in named if w not in families()]
        if bad:
            raise ValueError(
                f"cannot allow {', '.join(map(repr, bad))}: a budget allows 'own', 'any', "
                f"'mixture' or architecture families ({', '.join(sorted(families()))})"
            )
        return value

    @property
    def anything(self) -> bool:
        return ANY in self.allow and self.max_params is None

    def refusal(self, spec: ArchSpec, own: ArchSpec, params: int) -> str | None:
        """Why a model of `spec` with `params` parameters is outside this budget for a device
        whose own architecture is `own`, as the end of a sentence ("it is a mixture..."); None
        when it is within."""
        if spec == own:
            return None
        members = members_of(spec)
        if len(members) > 1 and not ({MIXTURE, ANY} & set(self.allow)):
            names = ", ".join(m.family for m in members)
            return f"it is a mixture of {len(members)} models ({names}) and this device runs one"
        if ANY not in self.allow:
            others = [m.family for m in members if m != own and m.family not in self.allow]
            if others:
                refused = sorted(set(others))
                what = "is not an architecture" if len(refused) == 1 else "are not architectures"
                return f"{_listed(refused)} {what} this device runs"
        if self.max_params is not None and params > self.max_params:
            return f"its {params:,} parameters exceed this device's {self.max_params:,}"
        return None


def _listed(words: Sequence[str]) -> str:
    if len(words) <= 1:
        return "".join(words)
    return f"{', '.join(words[:-1])} and {words[-1]}"


def arch_name(spec: ArchSpec) -> str:
    """An architecture as results and reasons name it: its family, or a mixture by its
    members ("mixture of mlr+mlp")."""
    if spec.family != "mixture":
        return spec.family
    return "mixture of " + "+".join(m.family for m in members_of(spec))


def members_of(spec: ArchSpec) -> list[ArchSpec]:
    """The models a device runs for `spec`: a mixture's members, or the model itself."""
    if spec.family != "mixture":
        return [spec]
    return [type(spec).model_validate(m) for m in spec.kwargs["members"]]


@dataclass(frozen=True)
class Footprint:
    """How big a model is on the device: its parameters and the bytes of its weights."""

    params: int
    bytes: int

    @property
    def kib(self) -> float:
        return self.bytes / 1024


def footprint(model: nn.Module) -> Footprint:
    """`model`'s parameter count and the bytes of its state (parameters and buffers) as held."""
    params = sum(p.numel() for p in model.parameters())
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return Footprint(params, size)
