"""What a client deploys: the guard around its algorithm.

An algorithm trains (`train_round`, `finish`) and names the models it could deploy
(`guard_candidates`, `finetune_base`, `finetune_optim`); it knows nothing of the guard. A
`Deployment` wraps it: after every round it shows the guard those candidates; after the last it
adds the federation's final model, fine-tuned and mixed, and a student of the device's own
architecture distilled from a model outside its budget, and deploys the guard's choice (or, with
the guard off, the algorithm's final model) within the device's budget. The reply's details say
what was deployed, its size and why, and how many training samples the client processed.

A finalize task may carry inputs of the coordinator's own (`UNLABELED`, FedMe's unlabeled set):
the students then learn the teacher on them too, beside the device's training images. It may
carry the last round's trained copies of the global model (`peer_name`, with `guard_peers`):
those that do best on the device's validation split, mixed, are one more candidate (`PEERS`).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from edge_sdk.algorithms.candidates import FINETUNED, PEERS, PERSONAL, Candidate, blend, mixed
from edge_sdk.algorithms.context import FitResult
from edge_sdk.algorithms.guard import Distil, Guard
from edge_sdk.algorithms.guard_config import GuardConfig
from edge_sdk.budget import arch_name, footprint
from edge_sdk.client_data import laid_out
from edge_sdk.codec import WireModel
from edge_sdk.losses import distillation_loss
from edge_sdk.trainer import Score
from model_zoo import ArchSpec
from model_zoo.models.inputs import INPUTS, inputs_spec

if TYPE_CHECKING:
    from edge_sdk.algorithms.base import ClientAlgorithm

__all__ = ["PEER_PREFIX", "UNLABELED", "Deployment", "Final", "peer_name", "unlabeled_model"]

# The name, in a finalize task's models, of the inputs the guard's students also learn on
# (an `inputs` model: model_zoo.models.inputs).
UNLABELED = "unlabeled"
# Client `c`'s trained copy of the global model in a finalize task's models: PEER_PREFIX + c.
PEER_PREFIX = "peer@"

# What the guard chooses among after the last round, the default first, and the mixture's weight
# of the personalized model where the default is a weighed mixture (`Deployment.final_candidates`).
Final = tuple[dict[str, Candidate], float | None]

log = logging.getLogger(__name__)


def peer_name(client_id: str) -> str:
    """The name under which a finalize task carries client `client_id`'s trained copy of the
    global model (`guard_peers`)."""
    return f"{PEER_PREFIX}{client_id}"


def unlabeled_model(x: torch.Tensor, num_classes: int) -> WireModel:
    """Inputs `x` (n, *input_shape) as the model a finalize task carries under `UNLABELED`."""
    return WireModel(inputs_spec(x, num_classes), {"inputs": x})


class Deployment:
    """The guard around one client's `algorithm` (edge_sdk.algorithms.guard), and the model the
    client deploys. An algorithm whose config lacks the guard's fields deploys its own final
    model, within the budget all the same."""

    def __init__(self, algorithm: ClientAlgorithm) -> None:
        # (a proxy: the algorithm owns its deployment, and a stack built for one round is let
        # go with its tensors when the round ends, not at the next garbage collection)
        self.algorithm = cast("ClientAlgorithm", weakref.proxy(algorithm))
        ctx, config = algorithm.ctx, algorithm.config
        # (an algorithm without the guard's fields never consults it: its z is the default)
        settings = config if isinstance(config, GuardConfig) else GuardConfig()
        self.guard = Guard(ctx.trainer, ctx.data, settings.guard_z, ctx.budget, ctx.spec)
        self._built: tuple[Any, nn.Module] | None = None  # the guard's pick, built once
        self.unlabeled_kept = 0  # the students that kept the unlabeled inputs (`either`)
        # The finalize task's inputs as `unlabeled` took them in, for the wire model they came
        # as: a stack's students ask before the member's own finalize (read, and said, once)
        self._taken: tuple[WireModel, torch.Tensor | None] | None = None
        self._peers: list[str] = []  # the clients whose copies `peers` mixed, for the reply

    @property
    def guarded(self) -> bool:
        config = self.algorithm.config
        return isinstance(config, GuardConfig) and config.guard

    def after_fit(self, round_: int, scores: Mapping[str, Score] | None = None) -> None:
        """The guard keeps the best candidate so far (a cohort calls it per member, with the
        `scores` it computed for the whole stack)."""
        if self.guarded:
            self.guard.observe(round_, self.algorithm.guard_candidates(), scores)

    def after_finish(
        self,
        rounds: int,
        models: Mapping[str, WireModel],
        result: FitResult,
        final: Final | None = None,
        students: Sequence[Candidate] = (),
    ) -> FitResult:
        """The choice of the model to deploy, after the algorithm's `finish` (a cohort calls it
        per member): the guard's where the config has it on, else the algorithm's final model,
        within the device's budget either way. The reply's details say what it deployed
        (architecture, parameters, size) and why, and how many training samples this client
        processed. `final`: the candidates (`final_candidates`, with this client's fine-tuned
        final model), and `students`: the first students the guard asks for (`first_student`),
        where a stack of clients trained theirs at once (coordinator.stacking); otherwise they
        are made here."""
        algo = self.algorithm
        unlabeled = self.unlabeled(models)
        distil = self._distiller(rounds, unlabeled)
        # (how many inputs its students learn on: None where they learn on none)
        carried = len(unlabeled) if distil is not None and unlabeled is not None else None
        if self.guarded:
            candidates, w = final if final is not None else self.final_candidates(rounds, models)
            if w is not None:
                result.details["guard_mix_weight"] = w
            result.details |= self.guard.decide(rounds, candidates, _served(students, distil))
            m = result.metrics
            if m.get("personal_total"):  # the algorithm's own model on the test split, for reports
                result.details["guard_unguarded_acc"] = m["personal_correct"] / m["personal_total"]
        else:
            why = "the guard is off" if isinstance(algo.config, GuardConfig) else "no guard"
            result.details |= self.guard.deploy_first(algo.guard_candidates(), distil, why)
        if self.guard.deployed is not None:
            result.metrics |= algo._scores("personal", self.model()[1])
        result.details |= self.details()
        if carried is not None:
            result.details["guard_distill_unlabeled"] = carried
            result.details["guard_distill_unlabeled_kept"] = self.unlabeled_kept
        if self._peers:
            result.details["guard_peers"] = ", ".join(self._peers)
        self.unlabeled_kept, self._taken, self._peers = 0, None, []
        result.details["samples_processed"] = algo.ctx.trainer.samples
        return result

    def final_candidates(
        self, rounds: int, models: Mapping[str, WireModel], tuned: Candidate | None = None
    ) -> Final:
        """What the guard chooses among after the last round, the default first: the
        algorithm's candidates, the final global model, the mixture of the trained copies of it
        the task carries (`peers`), the fine-tuned one (trained here unless given: `tuned`)
        and, with the mixture default, the personalized and the fine-tuned model mixed at the
        weight `Guard.weigh` chooses (returned, else None)."""
        algo = self.algorithm
        final = algo.guard_candidates()
        glob = algo._full_global(models)
        if glob is not None:
            final.setdefault("global", (glob.spec, algo.ctx.materialize(glob)))
        peers = self.peers(models)
        if peers is not None:
            final[PEERS] = peers
        if tuned is None and self.finetunes:
            try:
                tuned = self.finetune(rounds, models)
            except FloatingPointError as exc:  # not a candidate; the others remain
                log.warning("%s: the guard's fine-tuning diverged (%s)", algo.ctx.client_id, exc)
        if tuned is None:
            return final, None
        final[FINETUNED] = tuned
        cfg = algo.config
        assert isinstance(cfg, GuardConfig)
        if cfg.guard_default != "mixture" or PERSONAL not in final:
            return final, None
        weights = cfg.guard_mix_weights
        if cfg.guard_mix_weights_other_arch is not None and final[PERSONAL][0] != tuned[0]:
            weights = cfg.guard_mix_weights_other_arch
        w, name, default = self.guard.weigh(final[PERSONAL], tuned, weights)
        if peers is not None:
            # The best trained copies join the default, half of it: under label skew they hold
            # what the device's labels have in common across the federation.
            name, default = f"{name}+{PEERS}", blend(default, peers, 0.5)
        return {name: default, **final}, w  # first: the default

    def peers(self, models: Mapping[str, WireModel]) -> Candidate | None:
        """The equal mixture of the `guard_peers` trained copies of the global model in
        `models` (`peer_name`) with the lowest loss on this client's validation split (on equal
        losses, the first by name); None where the config takes none, the task carries none or
        the client has no validation data. A copy this client cannot build, or whose loss is
        not finite, is left out (said in the log): one bad peer costs the device nothing."""
        algo = self.algorithm
        cfg = algo.config
        if not isinstance(cfg, GuardConfig) or cfg.guard_peers == 0 or not self.guard.active:
            return None
        x, y = algo.ctx.data.x_val, algo.ctx.data.y_val
        scored: list[tuple[float, str, Candidate]] = []
        for name in sorted(n for n in models if n.startswith(PEER_PREFIX)):
            wire = models[name]
            try:
                model = algo.ctx.materialize(wire)
                loss = float(F.cross_entropy(algo.ctx.trainer.logits(model, x), y))
            except (RuntimeError, ValueError, KeyError, IndexError) as exc:
                log.warning(
                    "%s: the finalize task's %r is left out (%s)", algo.ctx.client_id, name, exc
                )
                continue
            if not math.isfinite(loss):
                log.warning(
                    "%s: the finalize task's %r is left out (its validation loss is %s)",
                    algo.ctx.client_id,
                    name,
                    loss,
                )
                continue
            scored.append((loss, name, (wire.spec, model)))
        best = sorted(scored, key=lambda t: (t[0], t[1]))[: cfg.guard_peers]
        if not best:
            return None
        self._peers = [name.removeprefix(PEER_PREFIX) for _, name, _ in best]
        return mixed([cand for _, _, cand in best])

    def first_student(
        self, rounds: int, final: Mapping[str, Candidate]
    ) -> tuple[Candidate, Candidate | None] | None:
        """The teacher and start of the first student the guard makes after the last round,
        among `final` (`Guard.first_student`); None where it makes none (the guard off, or no
        students in the config)."""
        if not self.guarded or self._distiller(rounds) is None:
            return None
        return self.guard.first_student(rounds, final)

    def model(self) -> tuple[ArchSpec, nn.Module]:
        """The model this client deploys (and exports to ONNX): the guard's choice after the
        last round, else the algorithm's own (`trained_model`)."""
        pick = self.guard.deployed
        if pick is None:
            return self.algorithm.trained_model()
        if self._built is None or self._built[0] is not pick:
            assert pick.model is not None  # a deployed pick is kept
            self._built = (pick, self.algorithm.ctx.materialize(pick.model))
        return pick.spec, self._built[1]

    def details(self) -> dict[str, Any]:
        """The deployed model's architecture ("mixture of mlr+mlp" for several), parameters and
        size (KiB of its weights), beside the device's own architecture's parameters."""
        spec, model = self.model()
        ctx = self.algorithm.ctx
        own = ctx.build_model(ctx.spec, salt=0) if spec != ctx.spec else model
        size = footprint(model)
        return {
            "deployed_arch": arch_name(spec),
            "deployed_params": size.params,
            "deployed_kib": round(size.kib, 1),
            "own_params": footprint(own).params,
        }

    @property
    def finetunes(self) -> bool:
        """Whether the guard fine-tunes the federation's final model after the last round: it is
        on, `guard_ft_epochs` > 0, and the client has validation data to judge the result by."""
        cfg = self.algorithm.config
        return (
            isinstance(cfg, GuardConfig)
            and cfg.guard
            and cfg.guard_ft_epochs > 0
            and self.guard.active
            and self.algorithm.finetune_optim() is not None
        )

    def finetune(self, rounds: int, models: Mapping[str, WireModel]) -> Candidate | None:
        """The guard's candidate: the algorithm's `finetune_base` trained for `guard_ft_epochs`
        on the training split (its samples count as processed); None without a base or optimizer
        settings. FloatingPointError when the training diverges."""
        algo = self.algorithm
        assert isinstance(algo.config, GuardConfig)
        base = algo.finetune_base(models)
        if base is None:
            return None
        spec, model = base
        cfg = algo.finetune_optim()
        if cfg is None:
            return None
        trainer = algo.ctx.trainer
        opt = trainer.optimizer(model.parameters(), cfg, lr=cfg.lr_at(rounds, rounds))
        trainer.train_epochs(
            model, algo.ctx.data, cfg, optimizer=opt, epochs=algo.config.guard_ft_epochs
        )
        return spec, model

    def _distiller(self, rounds: int, unlabeled: torch.Tensor | None = None) -> Distil | None:
        """What the guard distils a model outside the device's budget with (`distil`, at the
        last round's rate); None where the config makes no student. It learns on the training
        split, and on the `unlabeled` inputs its finalize task carried as `learns_on` says:
        where the guard chooses on validation, two students from the same random state, one
        without the inputs and one with them (`distillation_set`), and `either` keeps one."""
        cfg = self.algorithm.config
        if not isinstance(cfg, GuardConfig) or cfg.guard_distill_epochs == 0:
            return None
        if self.algorithm.finetune_optim() is None:
            return None

        def on(inputs: torch.Tensor | None) -> Distil:
            return lambda teacher, start: self.distil(
                rounds, teacher, start, self.distillation_set(teacher, inputs)
            )

        sets = self.learns_on(unlabeled)
        if len(sets) == 1:
            return on(sets[0])
        alone, taught = on(None), on(unlabeled)
        trainer = self.algorithm.ctx.trainer

        def either(teacher: Candidate, start: Candidate | None) -> Candidate | None:
            state = trainer.rng_state()
            first = alone(teacher, start)
            trainer.set_rng_state(state)
            return self.either(first, taught(teacher, start))

        return either

    def learns_on(self, unlabeled: torch.Tensor | None) -> list[torch.Tensor | None]:
        """What the guard's students learn on besides the training split, one student each:
        nothing (None); the `unlabeled` inputs of the finalize task where the guard has no
        validation to choose by (it is off, or the client holds no validation data); with
        validation, a student without them and one with them, of which `either` keeps one."""
        if unlabeled is None:
            return [None]
        if not (self.guarded and self.guard.active):
            return [unlabeled]
        return [None, unlabeled]

    def either(self, alone: Candidate | None, taught: Candidate | None) -> Candidate | None:
        """Of two students from the same random state, one learnt on the training split `alone`
        and one `taught` on the finalize task's unlabeled inputs too: the latter only where it
        does better on validation (`Guard.better`). Labelled by a teacher that is still weak,
        the inputs teach its mistakes (at the quick size of benchmarks/personalization.py,
        students that always learnt on them lost on 7 of the 10 splits); they must earn their
        place on each device. Where one student diverged (None), the other."""
        if alone is None or taught is None:
            chosen = alone if taught is None else taught
        else:
            chosen = taught if self.guard.better(taught, alone) else alone
        if chosen is not None and chosen is taught:
            self.unlabeled_kept += 1
        return chosen

    def unlabeled(self, models: Mapping[str, WireModel]) -> torch.Tensor | None:
        """The inputs a finalize task carries for the students (`UNLABELED`), on this client's
        device; None where it carries none, or inputs of another shape or kind than this
        client's training images (said in the log: the students learn without them). Asked
        again for the same inputs in one finalize, it answers as it did, without a word."""
        wire = models.get(UNLABELED)
        if wire is None:
            return None
        if self._taken is not None and self._taken[0] is wire:
            return self._taken[1]
        self._taken = (wire, self._take(wire))
        return self._taken[1]

    def _take(self, wire: WireModel) -> torch.Tensor | None:
        ctx = self.algorithm.ctx
        x = ctx.data.x_train
        u = wire.weights.get("inputs")
        if wire.spec.family != INPUTS or u is None or not x.is_floating_point():
            log.warning(
                "%s: the finalize task's %r is not a set of inputs this client's students can "
                "learn on (%s); they learn on its training split alone",
                ctx.client_id,
                UNLABELED,
                wire.spec,
            )
            return None
        if tuple(u.shape[1:]) != tuple(x.shape[1:]):
            log.warning(
                "%s: the finalize task's unlabeled inputs are of shape %s, this client's of %s; "
                "its students learn on its training split alone",
                ctx.client_id,
                tuple(u.shape[1:]),
                tuple(x.shape[1:]),
            )
            return None
        return laid_out(u.to(x.device, x.dtype))

    def distillation_set(
        self, teacher: Candidate, unlabeled: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a student of `teacher` learns on: the training split, and after it the
        `unlabeled` inputs, each labelled with the teacher's class for it (the label term of
        the student's loss; the KL term reads the teacher's logits as for any image)."""
        d, trainer = self.algorithm.ctx.data, self.algorithm.ctx.trainer
        if unlabeled is None or not len(unlabeled):
            return d.x_train, d.y_train
        labels = trainer.logits(teacher[1], unlabeled).argmax(1).to(d.y_train.dtype)
        return torch.cat([d.x_train, unlabeled]), torch.cat([d.y_train, labels])

    def distil(
        self,
        rounds: int,
        teacher: Candidate,
        start: Candidate | None,
        inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
        epochs: int | None = None,
    ) -> Candidate | None:
        """A student of this device's own architecture, starting from `start`'s weights (a
        fresh one without), trained for `epochs` (default: `distil_epochs` of them) on `inputs`
        (images, labels; default: the training split; `distillation_set`) with
        (1 − λ)·CE + λ·T²·KL(teacher ‖ student) and the algorithm's optimizer settings at the
        last round's rate (`finetune_optim`); None where its training diverges. Its samples
        count as processed.

        With `guard_distill_shift` > 0, images (inputs of shape (n, c, h, w)) are shifted by up
        to that many pixels each way, afresh every batch, and the teacher labels each shifted
        batch: a few dozen images alone show the student too little of what the teacher knows.
        With `guard_distill_mix`, each image of a view is also mixed with another of its batch
        (`edge_sdk.client_data.mixed`). Each epoch then shows `guard_distill_views` such views of
        every image, a pass each."""
        algo = self.algorithm
        cfg, optim = algo.config, algo.finetune_optim()
        assert isinstance(cfg, GuardConfig) and optim is not None
        trainer, d = algo.ctx.trainer, algo.ctx.data
        x, y = (d.x_train, d.y_train) if inputs is None else inputs
        epochs = self.distil_epochs(len(y)) if epochs is None else epochs
        student = algo.ctx.build_model(algo.ctx.spec, salt=3)
        if start is not None:
            student.load_state_dict(start[1].state_dict())
        opt = trainer.optimizer(student.parameters(), optim, lr=optim.lr_at(rounds, rounds))
        lam, temperature = cfg.guard_distill_lambda, cfg.guard_distill_temperature
        student.train()

        def step(x: torch.Tensor, y: torch.Tensor, z_t: torch.Tensor) -> tuple[torch.Tensor]:
            with trainer.autocast():
                z_s = student(x)
            loss = distillation_loss("kl", z_s, z_t, y, lam, temperature)
            return (trainer.step(loss, [opt]),)

        batches = trainer.distillation_batches(
            teacher[1],
            x,
            y,
            optim.batch_size,
            epochs,
            shift=cfg.guard_distill_shift,
            views=cfg.guard_distill_views,
            mix=cfg.guard_distill_mix,
        )
        try:
            trainer.run(step, batches)
        except FloatingPointError as exc:
            log.warning("%s: the guard's distillation diverged (%s)", algo.ctx.client_id, exc)
            return None
        return algo.ctx.spec, student

    def distil_epochs(self, n: int) -> int:
        """The epochs of a student that learns on `n` samples (the training split's, and the
        inputs it learns on besides): `guard_distill_epochs`, fewer (at least one) where their
        passes, `guard_distill_views` an epoch for images it moves, would exceed
        `guard_distill_samples` samples."""
        algo = self.algorithm
        cfg = algo.config
        assert isinstance(cfg, GuardConfig)
        views = algo.ctx.trainer.views_per_epoch(
            algo.ctx.data.x_train,
            cfg.guard_distill_shift,
            cfg.guard_distill_views,
            cfg.guard_distill_mix,
        )
        cap, epochs = cfg.guard_distill_samples, cfg.guard_distill_epochs
        if cap == 0 or epochs * views * n <= cap:
            return epochs
        return max(1, cap // (views * n))


def _served(made: Sequence[Candidate], distil: Distil | None) -> Distil | None:
    """`distil`, except that its first calls are answered with `made` (students trained
    already, in the order the guard asks for them)."""
    if not made:
        return distil
    queue = list(made)

    def served(teacher: Candidate, start: Candidate | None) -> Candidate | None:
        if queue:
            return queue.pop(0)
        return distil(teacher, start) if distil is not None else None

    return served
