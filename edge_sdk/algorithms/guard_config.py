"""The guard's settings, fields of every algorithm's config it serves (`GuardConfig`), and its
`preset`: the algorithm exactly as published (its paper's values, the guard off), or with what
the federation may share with the devices for their students (`trusted`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

__all__ = ["SHARED", "GuardConfig", "MixingGuardConfig", "PatientGuardConfig"]

# The preset "trusted" of an algorithm whose finalize can carry the clients' trained copies of
# the global model and the coordinator's unlabeled inputs (FML, PFML, PersFL): the values with
# which their own-architecture models met local training + 5 on both long label-skew splits
# (docs/algorithms.md, "The clients' copies and the coordinator's inputs together").
SHARED: dict[str, Any] = {"guard_peers": 3, "guard_distill_unlabeled": 200}


class GuardConfig(BaseModel):
    """The config fields of every algorithm the guard serves, and its `preset`."""

    # The published algorithm for each algorithm config: every [ours] value at the paper's
    # (or its authors' code's), the guard off. A subclass lists its own values in `paper`.
    PAPER: ClassVar[dict[str, Any]] = {"guard": False}
    paper: ClassVar[dict[str, Any]] = {}
    # What the federation may share with the devices for the guard's students, for a
    # federation whose clients trust each other and the coordinator that far: those of
    # `guard_peers` and `guard_distill_unlabeled` the algorithm takes (`SHARED`; FedMe the
    # inputs alone; FedeRiCo neither: its defaults met the same targets).
    trusted: ClassVar[dict[str, Any]] = {}

    # "paper": the algorithm exactly as published (`paper`'s values and the guard off), for
    # every field not set explicitly; "edgefl": our defaults (docs/algorithms.md says which
    # differ and why); "trusted": our defaults and `trusted`'s values, for every field not set
    # explicitly. Off by default, what "trusted" shares leaves the coordinator: the clients'
    # trained copies go to other devices, its unlabeled inputs to every device (a deployment
    # names them in `unlabeled_path`).
    preset: Literal["edgefl", "paper", "trusted"] = "edgefl"
    # Deploy the best model seen on the validation split (see edge_sdk.algorithms.guard);
    # False deploys the algorithm's final personalized model, as the paper describes it (or,
    # where that model is outside the device's budget, a student of it of the device's own
    # architecture; with `guard_distill_epochs` = 0, its first model within the budget).
    guard: bool = True
    # [ours] How clear the evidence must be to deploy another model than the default:
    # b − c > guard_z·√(b + c) over the validation samples where the two disagree.
    guard_z: float = Field(2.0, ge=0)
    # [ours] After the last round, fine-tune a copy of the federation's final model (the global
    # model; FedMe: the aggregate it returns; FedeRiCo: the model of the client's architecture it
    # weighs most, its own or a peer's) for this many epochs on the training split, as one more
    # candidate: the step of the FedAvg+FT baseline, whose `ft_epochs` default is the same. 0:
    # no such candidate. Counted in samples_processed.
    guard_ft_epochs: int = Field(5, ge=0)
    # [ours] The candidate kept unless another is clearly better: "mixture", the personalized
    # and the fine-tuned model averaged (one `mixture` model: the device runs both), where the
    # device's budget allows mixtures; "personal", the algorithm's own model.
    guard_default: Literal["mixture", "personal"] = "mixture"
    # [ours] The weights w of the personalized model tried for the "mixture" default,
    # w·personal + (1 − w)·finetuned; each client keeps the one with the lowest validation
    # loss (the first of equal ones). 1: the personalized model alone, 0: the fine-tuned one,
    # [0.5]: the equal mixture of earlier versions, FedMe's default (FedMeConfig).
    guard_mix_weights: list[float] = Field(
        default_factory=lambda: [1.0, 0.75, 0.5, 0.25, 0.0], min_length=1
    )
    # [ours] The weights tried instead where the personalized model's architecture is not the
    # fine-tuned model's (for FML, PFML and PersFL: on a device of another architecture than
    # the global one); None: `guard_mix_weights`. Without 1, the default there is never the
    # personalized model alone: under a budget of its own architecture, a student of the mixture
    # (PersFL's default: [0.75, 0.5, 0.25, 0], PersFLConfig).
    guard_mix_weights_other_arch: list[float] | None = Field(None, min_length=1)
    # [ours] Where the default is outside the device's budget (a mixture, a global model of
    # another architecture), or a model outside it is clearly better on validation than what it
    # may deploy, a student of the device's own architecture learns from it for this many epochs
    # on the training split, starting from the device's best model of its architecture and
    # afresh: (1 − λ)·CE + λ·T²·KL(teacher ‖ student), PersFL's loss. A student of the default
    # is the default within the budget; another is deployed when it is clearly better than the
    # choice. 40: a fresh student needs local training's passes (10 left it behind;
    # docs/algorithms.md, "Defaults measured at two sizes"). 0: no student. Counted in
    # samples_processed.
    guard_distill_epochs: int = Field(40, ge=0)
    guard_distill_lambda: float = Field(0.5, ge=0, le=1)  # [ours] λ
    guard_distill_temperature: float = Field(2.0, gt=0)  # [ours] T
    # [ours] A student distilled on images sees each batch shifted by up to this many pixels
    # each way, at random, and labelled by the teacher as shifted; 0: the images as they are
    # (every algorithm with a guard takes 1, PatientGuardConfig, as measured for each). Other
    # inputs (features, sequences) are never shifted. At 2 (40 epochs) it gained on digits and
    # lost on most Fashion-MNIST splits (docs/algorithms.md, "Defaults measured at two sizes").
    guard_distill_shift: int = Field(0, ge=0)
    # [ours] With a shift (or mixing), each of a student's epochs shows it this many views of
    # every image, a pass each (counted in samples_processed); students of other inputs, with
    # nothing new to see, train `guard_distill_epochs` alone. 1; every algorithm with a guard:
    # 4 (PatientGuardConfig).
    guard_distill_views: int = Field(1, ge=1)
    # [ours] A student distilled on images sees each view mixed with another image of its batch,
    # λ·x + (1 − λ)·x', λ drawn uniformly in [0, 1] for each image, and labelled by the teacher
    # as mixed; its label term takes the label of the larger part. The mixtures show it what
    # the teacher says between the device's images, where a few dozen of them alone say little
    # (mixup, as in Beyer et al.'s patient and consistent distillation). Other inputs are never
    # mixed. False: the views as they are (FedeRiCo's and PFML's default: True,
    # MixingGuardConfig; it lost for FedMe and gained little for FML and PersFL:
    # docs/algorithms.md).
    guard_distill_mix: bool = False
    # [ours] The most samples one student learns on: its epochs × views × the images (and
    # inputs) it learns on; a student of a device with more trains fewer epochs, at least one.
    # 0: no bound, the default. The epochs and views above were measured on devices of 24 to
    # 147 images, where a student learns on at most 55,520 samples; a device of 4,300 images
    # (Fashion-MNIST shared by 10) learns on 688,000 a student, two students, and its finalize
    # takes many times its rounds. 64,000 on devices of about 1,000 images made the finalize
    # 2.3-3.0 times faster and cost FML 0.2 and PFML 0.8 points (benchmarks/student_bound.py),
    # so it is not the default: the simulator warns where students grow that large and names
    # this setting.
    guard_distill_samples: int = Field(0, ge=0)
    # [ours] FML, PFML and PersFL: the finalize task also carries the last round's trained
    # copies of the global model (each client's meme, local model or stage-1 model, as it
    # replied; at most `guard_peers_offered` of them, none that aggregation had to bound), and
    # the guard mixes the `guard_peers` of them with the lowest loss on the device's validation
    # split into one more candidate: under label skew, the copies of the clients that hold the
    # device's labels. Under an own-architecture budget it is a teacher for the guard's
    # students, as the fine-tuned global model is. 0: none (the finalize carries no copies).
    # The devices then receive other clients' trained models, which the coordinator alone
    # sees otherwise (docs/reference/security.md).
    guard_peers: int = Field(0, ge=0)
    # The most trained copies one finalize task carries (a draw seeded by the run's seed).
    guard_peers_offered: int = Field(20, ge=1)
    # [ours] The guard's students also learn the teacher on this many of the coordinator's
    # unlabeled inputs (`unlabeled_path`), one seeded draw of them, labelled by the teacher,
    # beside the device's training split, for `guard_distill_epochs` epochs of both. The
    # finalize task carries them to every device: the coordinator's inputs leave it (200
    # Fashion-MNIST images are 0.6 MB). Where the guard chooses on validation, each student is
    # made twice, without them and with them, and keeps them only where it does better there
    # (`Deployment.either`). 0: the training split alone, the default for each: it gained at
    # the long size of benchmarks/personalization.py and was level at the quick size
    # (docs/algorithms.md, "Defaults measured at two sizes").
    guard_distill_unlabeled: int = Field(0, ge=0)
    # Coordinator: a .npy or .safetensors file of the unlabeled inputs it holds (FedMe clusters
    # its models on them; the guard's students learn on `guard_distill_unlabeled` of them). A
    # simulation without one holds samples no client gets out of the dataset instead.
    unlabeled_path: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        # The preset's values under whatever is given explicitly.
        if not isinstance(data, Mapping):
            return data
        if data.get("preset") == "paper":
            return {**cls.PAPER, **cls.paper, **data}
        if data.get("preset") == "trusted":
            return {**cls.trusted, **data}
        return data

    @model_validator(mode="after")
    def _peers_need_the_guard(self) -> GuardConfig:
        if self.guard_peers and not self.guard:
            raise ValueError(
                "guard_peers gives the guard one more candidate, and the guard is off: set "
                "guard = true (the preset 'paper' turns it off) or guard_peers = 0"
            )
        return self

    @field_validator("guard_mix_weights", "guard_mix_weights_other_arch")
    @classmethod
    def _weights_in_0_1(cls, weights: list[float] | None) -> list[float] | None:
        if weights is not None and not all(0 <= w <= 1 for w in weights):
            raise ValueError(f"each weight of the personalized model is in [0, 1], got {weights}")
        return weights


class PatientGuardConfig(GuardConfig):
    """The guard of FML, PersFL, FedMe, FedeRiCo and PFML, whose students of images learn from
    more of them: each epoch, four views of every image, each shifted by up to a pixel its own
    way and labelled by the teacher as shifted (160 passes in 40 epochs), not the images as they
    are; FedeRiCo's and PFML's views are also mixed (`MixingGuardConfig`).

    Their students (on the devices of another architecture than the global one) ended 2-3
    points below the teacher they learnt from, at the long size of
    benchmarks/personalization.py: 24 images show a student little of what the teacher knows.
    These views closed part of that gap on digits and on Fashion-MNIST, at both sizes
    (docs/algorithms.md, "Defaults measured at two sizes"). Students of features or sequences
    train as before."""

    guard_distill_shift: int = Field(1, ge=0)  # [ours]
    guard_distill_views: int = Field(4, ge=1)  # [ours]


class MixingGuardConfig(PatientGuardConfig):
    """The guard of FedeRiCo and PFML, whose students' views are also mixed
    (`guard_distill_mix`). At the long size of benchmarks/personalization.py, 10 seeds, it
    lifted their own-architecture models on both label-skew splits (lg-digits, lg-fmnist):
    FedeRiCo 93.3 → 95.0 and 83.1 → 85.0, PFML 93.0 → 94.2 and 82.5 → 83.2, against the images
    as they are (and gained at the quick size: docs/algorithms.md, "Defaults measured at two
    sizes"). For FedMe it lost, and FML and PersFL gained a third of a point at 3 seeds: they
    keep PatientGuardConfig's views unmixed."""

    guard_distill_mix: bool = True  # [ours]
