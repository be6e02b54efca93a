from collections import OrderedDict

import pytest
import torch

import edge_sdk.trainer as trainer_mod
from edge_sdk.client_data import ClientData, IdentityCache
from edge_sdk.graphs import StepRunner, footprint
from edge_sdk.optim_config import OptimConfig
from edge_sdk.trainer import Trainer


def test_step_schedule_decays_every_third_of_the_run():
    cfg = OptimConfig(lr=1.0, lr_schedule="step", lr_gamma=0.1)
    # R = 9 → step 3: rounds 1-3 at 1.0, 4-6 at 0.1, 7-9 at 0.01
    assert [round(cfg.lr_at(r, 9), 6) for r in range(1, 10)] == [1, 1, 1, 0.1, 0.1, 0.1] + [
        0.01
    ] * 3
    assert OptimConfig(lr=0.3).lr_at(7, 9) == 0.3  # "none" keeps it constant


def test_epoch_visits_every_sample_once_and_is_seeded():
    t = Trainer(torch.device("cpu"), seed=3)
    batches = list(t.epoch(10, 4))
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(torch.cat(batches).tolist()) == list(range(10))
    again = list(Trainer(torch.device("cpu"), seed=3).epoch(10, 4))
    assert all(torch.equal(a, b) for a, b in zip(batches, again, strict=True))
    assert len(set(t.sample(10, 20).tolist())) == 10  # capped at n, distinct


def test_evaluate_counts_correct_predictions_and_sums_the_loss():
    model = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))
    x = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]])
    y = torch.tensor([0, 1, 1])
    r = Trainer(torch.device("cpu")).evaluate(model, x, y)
    assert (r.correct, r.total) == (2, 3)
    expected = torch.nn.functional.cross_entropy(model(x), y, reduction="sum").item()
    assert r.loss == pytest.approx(expected / 3)


def test_a_non_finite_loss_stops_training_with_a_clear_error():
    # Prepare: the second of three batches is NaN
    model = torch.nn.Linear(2, 2)
    t = Trainer(torch.device("cpu"))
    opt = t.optimizer(model.parameters(), OptimConfig())
    x = torch.ones(3, 1, 2)
    x[1] = float("nan")

    def step(xb):
        return (t.step(model(xb).sum(), [opt]),)

    # Execute / Assert: the loop ends, then its mean loss is found non-finite
    with pytest.raises(FloatingPointError, match="training loss became nan; lower the learning"):
        t.run(step, ((xb,) for xb in x))


def test_run_averages_each_value_of_the_step_on_the_device():
    # Prepare: a step that returns two values, each step's known in advance
    t = Trainer(torch.device("cpu"))
    seen = []

    def step(x, y):
        seen.append((x.clone(), y.clone()))
        return x.sum(), y.float().sum()

    batches = [
        (torch.tensor([1.0, 2.0]), torch.tensor([1])),
        (torch.tensor([5.0]), torch.tensor([4])),
    ]

    # Execute
    means = t.run(step, iter(batches), values=2)

    # Assert: each batch stepped once, in order; means (3 + 5) / 2 and (1 + 4) / 2
    assert [b[0].tolist() for b in seen] == [[1.0, 2.0], [5.0]]
    assert means == [4.0, 2.5]
    assert t.run(step, iter([]), values=2) == [pytest.approx(float("nan"), nan_ok=True)] * 2


def test_client_data_checks_lengths_and_needs_training_samples():
    x, y = torch.zeros(3, 2), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="train: 3 inputs but 2 labels"):
        ClientData(x, y[:2], x, y, x, y, num_classes=2)
    with pytest.raises(ValueError, match="at least one training sample"):
        ClientData(x[:0], y[:0], x, y, x, y, num_classes=2)


def test_adam_takes_momentum_as_beta1_and_the_weight_decay():
    params = [torch.nn.Parameter(torch.zeros(2))]
    cfg = OptimConfig(optimizer="adam", momentum=0.5, weight_decay=0.01, lr=0.2)
    group = Trainer(torch.device("cpu")).optimizer(params, cfg).param_groups[0]
    assert group["betas"] == (0.5, 0.999) and group["weight_decay"] == 0.01 and group["lr"] == 0.2


def test_fresh_index_draws_are_distinct_seeded_uniform_and_counted():
    t = Trainer(torch.device("cpu"), seed=5)
    (rows,) = t.index_draws(10, 3, 4000)
    assert rows.shape == (4000, 3) and t.samples == 12000
    assert all(len(set(r)) == 3 for r in rows.tolist())  # distinct within a batch
    assert rows.min() >= 0 and rows.max() < 10
    # every sample as likely, in any position of the batch: 4000 draws, 400 expected per
    # index in the first position (sd 19) and 1200 anywhere (sd 29)
    first, anywhere = torch.bincount(rows[:, 0], minlength=10), torch.bincount(rows.flatten())
    assert first.min() > 330 and first.max() < 470, first
    assert anywhere.min() > 1090 and anywhere.max() < 1310, anywhere
    (again,) = Trainer(torch.device("cpu"), seed=5).index_draws(10, 3, 4000)
    assert torch.equal(rows, again)
    assert Trainer(torch.device("cpu")).sample(4, 9).sort().values.tolist() == [0, 1, 2, 3]


def test_fresh_batches_draw_at_most_the_keys_one_draw_holds(monkeypatch):
    monkeypatch.setattr("edge_sdk.trainer._DRAW_KEYS", 25)  # two batches over 10 samples a draw
    t = Trainer(torch.device("cpu"), seed=1)
    draws = list(t.index_draws(10, 4, 5))
    assert [d.shape for d in draws] == [(2, 4), (2, 4), (1, 4)] and t.samples == 20

    x, y = torch.arange(10.0).view(10, 1) * 2, torch.arange(10)
    t = Trainer(torch.device("cpu"), seed=1)
    batches = list(t.fresh_batches(x, y, 4, 5))
    assert len(batches) == 5
    for (bx, by), idx in zip(batches, torch.cat(draws), strict=True):
        assert torch.equal(by, idx) and torch.equal(bx[:, 0], 2 * idx.float())


def test_an_identity_cache_finds_the_same_tensors_only_and_forgets_with_them():
    import gc

    a, b, c = torch.ones(3), torch.ones(3), torch.zeros(2)  # a and b equal, not the same
    cache: IdentityCache[str] = IdentityCache(limit=2)
    assert cache.put([a, c], "ac") == "ac"
    assert cache.get([a, c]) == "ac" and cache.get([b, c]) is None and cache.get([c, a]) is None
    cache.put([b], "b")
    cache.get([a, c])  # used last: b is now the least recently used
    cache.put([c], "c")
    assert cache.get([b]) is None and cache.get([a, c]) == "ac" and cache.get([c]) == "c"
    del a
    gc.collect()
    assert len(cache) == 1 and cache.get([c]) == "c"  # the entry holding a went with it


def test_clients_moved_to_a_device_one_by_one_share_one_copy_of_the_data_they_slice():
    # Prepare: a simulation's clients are row slices of one client-major data set; "meta" is a
    # device other than the data's, as CUDA is (the path that found a tensor already moved
    # used to compare tensors with ==: "Boolean value of Tensor ... is ambiguous")
    x, y = torch.arange(30.0).reshape(10, 3).clone(), torch.arange(10)
    meta = torch.device("meta")

    # Execute: the second client moved after the first, and the first again
    first = ClientData(x[:4], y[:4], x[4:5], y[4:5], x[5:6], y[5:6], num_classes=10).to(meta)
    second = ClientData(x[6:9], y[6:9], x[9:], y[9:], x[:0], y[:0], num_classes=10).to(meta)
    again = ClientData(x[:4], y[:4], x[4:5], y[4:5], x[5:6], y[5:6], num_classes=10).to(meta)

    # Assert: every split a view of one copy of x (and of y), at its own rows
    splits = [first.x_train, first.x_val, second.x_train, second.x_val, again.x_train]
    assert all(t.device == meta and t._base is first.x_train._base for t in splits)
    assert first.x_train._base.shape == (10, 3)
    assert [t.storage_offset() for t in splits] == [0, 12, 18, 27, 0]
    assert [len(t) for t in splits] == [4, 1, 3, 1, 4]
    assert second.y_train._base is first.y_train._base and second.y_train.storage_offset() == 6


def test_fresh_optimizer_keeps_an_optimizer_of_the_same_kind_over_the_same_parameters():
    # Prepare: an SGD with momentum state over a model
    trainer = Trainer(torch.device("cpu"))
    model, other = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    cfg = OptimConfig(lr=0.1, momentum=0.9, weight_decay=1e-3)
    kept = trainer.optimizer(model.parameters(), cfg)
    model(torch.randn(4, 3)).sum().backward()
    kept.step()

    # Execute / Assert: kept, restarted, at the new learning rate
    assert trainer.fresh_optimizer(kept, model.parameters(), cfg, lr=0.05) is kept
    assert kept.param_groups[0]["lr"] == 0.05
    assert all(not b.any() for s in kept.state.values() for b in s.values())
    # a new one for other parameters, another kind, other settings, or nothing kept
    changed = [
        (kept, other.parameters(), cfg),
        (kept, model.parameters(), cfg.model_copy(update={"optimizer": "adam"})),
        (kept, model.parameters(), cfg.model_copy(update={"momentum": 0.5})),
        (kept, model.parameters(), cfg.model_copy(update={"weight_decay": 0.0})),
        (None, model.parameters(), cfg),
    ]
    for k, params, c in changed:
        params = list(params)
        new = trainer.fresh_optimizer(k, params, c)
        group = new.param_groups[0]
        assert new is not kept and all(a is b for a, b in zip(group["params"], params, strict=True))
        assert group["weight_decay"] == c.weight_decay and not new.state


def test_kept_steps_are_found_by_footprint_and_bounded_per_trainer_and_per_process(monkeypatch):
    # Prepare: six trainers looking up kept steps as on CUDA (nothing here captures), each
    # keeping a step for three values of a setting, one trainer after another
    monkeypatch.setattr(trainer_mod, "_KEPT_ORDER", OrderedDict())
    trainers = [Trainer(torch.device("cpu")) for _ in range(6)]
    model = torch.nn.Linear(2, 2)
    runners = {}
    for i, t in enumerate(trainers):
        t.graphs = True
        for value in (1.0, 2.0, 3.0):
            runners[i, value] = StepRunner(lambda: (), capture=True)
            t._keep(footprint(model, value), runners[i, value])

    # Assert: two kept per trainer (its last), eight in the process (the last kept)
    kept = {
        (i, v) for (i, v), r in runners.items() if trainers[i]._kept.get(footprint(model, v)) is r
    }
    assert kept == {(i, v) for i in range(2, 6) for v in (2.0, 3.0)}
    # a loop reading the same finds its step, once; one whose parameter moved does not
    found, key = trainers[5]._runner(lambda: (), [model, 3.0])
    assert found is runners[5, 3.0] and key == footprint(model, 3.0)
    assert trainers[5]._runner(lambda: (), [model, 3.0])[0] is not found
    model.weight.data = model.weight.data.clone()
    assert trainers[4]._runner(lambda: (), [model, 2.0])[0] is not runners[4, 2.0]
    # a trainer that does not capture keeps nothing
    trainers[0].graphs = False
    assert trainers[0]._runner(lambda: (), [model, 2.0])[1] is None


def test_held_values_are_written_into_the_tensor_a_captured_step_reads():
    trainer = Trainer(torch.device("cpu"))
    # A number is taken as it is
    assert trainer.held("alpha", 0.5) == 0.5
    # A tensor: held the first time, then rewritten in place where it fits
    first = torch.tensor([0.1, 0.2])
    assert trainer.held("alpha", first) is first
    again = trainer.held("alpha", torch.tensor([0.3, 0.4]))
    assert again is first and torch.equal(first, torch.tensor([0.3, 0.4]))
    # Another shape or dtype, or another name: a tensor of its own
    other = torch.tensor([0.5, 0.6, 0.7])
    assert trainer.held("alpha", other) is other
    assert trainer.held("beta", torch.tensor([0.3, 0.4])) is not other
    half = torch.tensor([0.5, 0.6, 0.7], dtype=torch.float64)
    assert trainer.held("alpha", half) is half and other.dtype == torch.float32
