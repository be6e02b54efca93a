import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from edge_sdk.optim import SGD, Adam, restart

TESTS = Path(__file__).resolve().parents[1]


def _train(cls, steps=4, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 3, 3), torch.nn.Flatten(), torch.nn.Linear(3 * 6 * 6, 4)
    )
    opt = cls(model.parameters(), **kwargs)
    x, y = torch.randn(5, 1, 8, 8), torch.tensor([0, 1, 2, 3, 0])
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


def _fused_sgd(params, **kwargs):
    return torch.optim.SGD(params, fused=True, **kwargs)


@pytest.mark.parametrize(
    ("lean", "torchs", "kwargs"),
    [
        (SGD, _fused_sgd, {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}),
        (SGD, _fused_sgd, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
        (SGD, _fused_sgd, {"lr": 0.1, "momentum": 0.5, "dampening": 0.3}),
        (SGD, _fused_sgd, {"lr": 0.1, "weight_decay": 1e-2}),
        (
            partial(SGD, foreach=False),
            partial(torch.optim.SGD, foreach=False),
            {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4},
        ),
        (Adam, torch.optim.Adam, {"lr": 0.01, "betas": (0.9, 0.999), "weight_decay": 5e-4}),
    ],
)
def test_optim_steps_exactly_as_torchs_own_optimizer(lean, torchs, kwargs):
    # Prepare / Execute: the same model, data and seed under ours and under torch's class.
    ours, ours_opt = _train(lean, **kwargs)
    theirs, their_opt = _train(torchs, **kwargs)

    # Assert: the same parameters bit for bit, the same state, still a torch optimizer.
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    a, b = ours_opt.state_dict(), their_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for k in b["state"]:
        assert a["state"][k].keys() == b["state"][k].keys()
        assert all(torch.equal(a["state"][k][n], b["state"][k][n]) for n in b["state"][k])
    assert isinstance(ours_opt, torch.optim.Optimizer)
    their_opt.load_state_dict(a)  # each loads the other's state
    ours_opt.load_state_dict(b)


def test_sgd_on_the_cpu_runs_torchs_fused_kernel_unless_told_otherwise():
    params = [torch.nn.Parameter(torch.randn(3, 2))]

    assert SGD(params, lr=0.1).param_groups[0]["fused"] is True
    assert SGD([{"params": params}], lr=0.1).param_groups[0]["fused"] is True
    assert not SGD(params, lr=0.1, foreach=True).param_groups[0]["fused"]
    assert not SGD(params, lr=0.1, fused=False).param_groups[0]["fused"]
    assert not SGD(params, lr=0.1, differentiable=True).param_groups[0]["fused"]
    meta = [torch.nn.Parameter(torch.randn(3, 2, device="meta"))]
    assert not SGD(meta, lr=0.1).param_groups[0]["fused"]


def test_param_groups_given_as_generators_keep_their_parameters_and_settings():
    # Prepare: groups as torch takes them, their parameters a module's generator (read once)
    torch.manual_seed(0)
    body, head = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)

    # Execute
    groups = [{"params": body.parameters()}, {"params": head.weight, "lr": 0.5}]
    opt = SGD(groups, lr=0.1, momentum=0.9)

    # Assert: every parameter in its group, with its group's settings, as torch's SGD has them
    theirs = torch.optim.SGD(
        [{"params": body.parameters()}, {"params": head.weight, "lr": 0.5}],
        lr=0.1,
        momentum=0.9,
        fused=True,
    )
    assert [g["params"] for g in opt.param_groups] == [g["params"] for g in theirs.param_groups]
    assert [g["params"] for g in opt.param_groups] == [list(body.parameters()), [head.weight]]
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]
    assert all(g["fused"] is True for g in opt.param_groups)


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_fused_sgd_steps_transposed_parameters_as_torchs_fused_kernel_steps_contiguous_ones(
    momentum,
):
    # Prepare: stacked weights held transposed (coordinator.stacking), a contiguous bias and a
    # parameter with gaps in its memory under ours; their values, contiguous, under torch's
    # fused SGD.
    torch.manual_seed(0)
    values = [
        torch.randn(4, 6, 5).transpose(1, 2),
        torch.randn(4, 5),
        torch.randn(3, 7).t(),
        torch.randn(4, 10)[:, ::2],
    ]

    def laid_out_as(t):
        return torch.empty_strided(t.shape, t.stride())

    ours = [torch.nn.Parameter(laid_out_as(v).copy_(v)) for v in values]
    theirs = [torch.nn.Parameter(v.contiguous()) for v in values]
    kwargs = {"lr": 0.1, "momentum": momentum, "weight_decay": 1e-2, "nesterov": momentum > 0}
    a, b = SGD(ours, **kwargs), torch.optim.SGD(theirs, fused=True, **kwargs)
    gen = torch.Generator().manual_seed(1)

    # Execute: the same gradients for both (each laid out as its parameter), three steps
    for _ in range(3):
        for p, q in zip(ours, theirs, strict=True):
            q.grad = torch.randn(q.shape, generator=gen)
            p.grad = laid_out_as(p).copy_(q.grad)
        a.step()
        b.step()

    # Assert: the same parameters and momentum (to float rounding: the kernel's vector code
    # and its scalar tail can round apart, and the layouts put elements in other places);
    # the parameters still laid out as they were, a transposed one's buffer as it is
    for p, q in zip(ours, theirs, strict=True):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)
        if momentum:
            m, n = a.state[p]["momentum_buffer"], b.state[q]["momentum_buffer"]
            assert torch.allclose(m, n, rtol=1e-6, atol=1e-7)
    assert ours[0].stride() == (30, 1, 5) and ours[3].stride() == (10, 2)
    if momentum:
        assert a.state[ours[0]]["momentum_buffer"].stride() == (30, 1, 5)


def test_fused_sgd_steps_a_gradient_laid_out_unlike_its_parameter_correctly():
    # Prepare: a transposed parameter whose gradient is contiguous (torch's fused kernel
    # steps such a pair wrongly on the CPU), under ours and under torch's single-tensor SGD.
    torch.manual_seed(0)
    value, grad = torch.randn(3, 7).t(), torch.randn(7, 3)
    ours, theirs = (
        torch.nn.Parameter(value.clone(memory_format=torch.preserve_format)) for _ in "ab"
    )
    a = SGD([ours], lr=0.1, momentum=0.9, weight_decay=1e-2)
    b = torch.optim.SGD([theirs], lr=0.1, momentum=0.9, weight_decay=1e-2, foreach=False)

    # Execute
    for _ in range(2):
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        a.step()
        b.step()

    # Assert: the values the loop computes
    assert torch.equal(ours, theirs)
    assert torch.equal(a.state[ours]["momentum_buffer"], b.state[theirs]["momentum_buffer"])


_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from tests_helpers import tiny_config
from coordinator.federation import prepare_federation
from coordinator.simulator import run_federation
cfg = tiny_config(algorithm="fml", rounds=1, models=["mlr", "lenet5"], global_model="mlr",
                  local_epochs=1, **{"data.options": {"size": 28}})
res = run_federation(cfg, prepare_federation(cfg), "fml")
print(json.dumps({"ok": all(c.error is None for c in res.clients),
                  "dynamo": "torch._dynamo" in sys.modules}))
"""


def test_optim_a_simulated_federation_never_loads_torch_compile():
    # Prepare: a fresh interpreter (this one may have loaded torch._dynamo in other tests).
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}

    # Execute: one FML round (two optimizers per client, a convolutional client, evaluation).
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(TESTS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )

    # Assert: torch.compile's machinery (~150 MB resident) was never imported.
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"ok": True, "dynamo": False}


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3}),
        (SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
        (SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.5}),
        (Adam, {"lr": 0.01, "betas": (0.8, 0.99)}),
    ],
)
def test_restart_steps_on_as_a_new_optimizer_would(cls, kwargs):
    # Prepare: a model trained for a few steps, and its copy
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = cls(model.parameters(), **kwargs)
    x, y = torch.randn(7, 6), torch.tensor([0, 1, 2, 0, 1, 2, 0])

    def steps(model, opt, n=3):
        for _ in range(n):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    steps(model, opt)
    state = [t for entry in opt.state.values() for t in entry.values()]
    twin = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    twin.load_state_dict(model.state_dict())

    # Execute: the restarted optimizer and a new one over the copy take the same steps
    restart(opt)
    steps(model, opt)
    steps(twin, cls(twin.parameters(), **kwargs))

    # Assert: the same parameters, bit for bit; without dampening, in the same state tensors
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    if not kwargs.get("dampening"):
        kept = [t for entry in opt.state.values() for t in entry.values()]
        assert all(a is b for a, b in zip(kept, state, strict=True))
