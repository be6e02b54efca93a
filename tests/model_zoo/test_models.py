"""The model zoo's families: shapes, trainability, parameter counts, errors, determinism."""

from __future__ import annotations

import pytest
import torch
from tests_helpers import CHAR_SPEC, IMAGE
from tests_helpers import ZOO_SPECS as SPECS
from tests_helpers import spec_id as _ids
from torch import nn

from model_zoo.models import example_input
from model_zoo.models.inputs import inputs_spec
from model_zoo.spec import (
    ArchSpec,
    InvalidInputShape,
    ModelZooError,
    UnknownArchitecture,
    build,
    families,
    input_dtype,
    is_network,
    register,
)


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_all_expected_families_registered():
    assert set(families()) >= {
        "mlr",
        "mlp",
        "lenet5",
        "cnn1",
        "cnn2",
        "vgg11",
        "vgg13",
        "vgg16",
        "vgg19",
        "lstm",
    }


@pytest.mark.parametrize("spec", SPECS, ids=_ids)
def test_family_shapes_and_memorises_a_tiny_batch(spec: ArchSpec):
    torch.manual_seed(0)
    model = build(spec)
    g = torch.Generator().manual_seed(1)
    x = example_input(spec, 8, g)
    y = torch.randint(0, spec.num_classes, (8,), generator=g)

    model.eval()
    with torch.no_grad():
        assert model(x[:1]).shape == (1, spec.num_classes)
        assert model(x).shape == (8, spec.num_classes)

    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize(
    ("family", "kwargs", "expected"),
    [
        # 784*10 + 10
        ("mlr", {}, 7_850),
        # 784*100 + 100 + 100*10 + 10
        ("mlp", {}, 79_510),
        # 784*20 + 20 + 20*10 + 10
        ("mlp", {"hidden": [20]}, 15_910),
        # conv 1*6*25+6, conv 6*16*25+16, fc 400*120+120, 120*84+84, 84*10+10
        ("lenet5", {}, 156 + 2_416 + 48_120 + 10_164 + 850),
        # conv 1*6*9+6, conv 6*16*9+16, fc 16*7*7*120+120, 120*10+10
        ("cnn1", {}, 60 + 880 + 94_200 + 1_210),
        # conv 1*128*9+128, 2x conv 128*128*9+128, fc 128*3*3*10+10
        ("cnn2", {}, 1_280 + 2 * 147_584 + 11_530),
        # LSTM 4*(64*28 + 64*64 + 2*64), fc 64*10+10
        ("lstm", {}, 24_064 + 650),
    ],
)
def test_exact_parameter_counts(family: str, kwargs: dict, expected: int):
    spec = ArchSpec(family=family, num_classes=10, input_shape=IMAGE, kwargs=kwargs)
    assert _n_params(build(spec)) == expected


def test_parameter_count_bounds():
    counts = {
        f: _n_params(build(ArchSpec(family=f, num_classes=10, input_shape=(3, 32, 32))))
        for f in ("vgg11", "vgg13", "vgg16", "vgg19")
    }
    # Deeper variants only add convolutions; width 0.25 keeps all of them small.
    assert counts["vgg11"] < counts["vgg13"] < counts["vgg16"] < counts["vgg19"]
    assert counts["vgg11"] > 100_000 and counts["vgg19"] < 2_000_000
    full_spec = ArchSpec(
        family="vgg16", num_classes=10, input_shape=(3, 32, 32), kwargs={"width": 1.0}
    )
    full = _n_params(build(full_spec))
    assert 14_000_000 < full < 16_000_000  # 14.7M convs + a 512-512-10 head
    no_bn = _n_params(
        build(
            ArchSpec(
                family="vgg11",
                num_classes=10,
                input_shape=(3, 32, 32),
                kwargs={"batch_norm": False},
            )
        )
    )
    assert no_bn < counts["vgg11"]
    char_default = ArchSpec(
        family="lstm", num_classes=80, input_shape=(80,), kwargs={"mode": "char"}
    )
    # embedding 80*8, LSTM 4*(256*8+256*256+512) + 4*(2*256*256+512), fc 256*80+80
    assert _n_params(build(char_default)) == 640 + 272_384 + 526_336 + 20_560


def test_no_dropout_anywhere():
    for spec in SPECS:
        assert not any(isinstance(m, nn.Dropout) for m in build(spec).modules()), spec


def test_other_input_sizes_and_channels():
    cases = [
        ("lenet5", (3, 32, 32)),
        ("lenet5", (1, 12, 12)),
        ("cnn1", (3, 32, 32)),
        ("cnn2", (1, 8, 8)),
        ("vgg11", (3, 16, 16)),
        ("vgg11", (3, 32, 40)),
        ("lstm", (3, 32, 32)),
        ("lstm", (20, 60)),
        ("mlr", (60,)),
        ("mlp", (60,)),
    ]
    for family, shape in cases:
        spec = ArchSpec(family=family, num_classes=4, input_shape=shape)
        out = build(spec).eval()(example_input(spec, 2))
        assert out.shape == (2, 4), (family, shape)


def test_unknown_family_names_known_ones():
    with pytest.raises(UnknownArchitecture) as info:
        build(ArchSpec(family="resnet50", num_classes=10, input_shape=IMAGE))
    message = str(info.value)
    assert "resnet50" in message
    for f in ("mlp", "lenet5", "vgg16", "lstm"):
        assert f in message


@pytest.mark.parametrize(
    ("family", "shape", "kwargs", "needle"),
    [
        ("lenet5", (60,), {}, "(C, H, W)"),
        ("lenet5", (1, 8, 8), {}, ">= 12"),
        ("cnn1", (1, 3, 3), {}, ">= 4"),
        ("cnn2", (1, 4, 4), {}, ">= 8"),
        ("vgg11", (1, 4, 4), {}, ">= 16"),
        ("vgg19", (60,), {}, "(C, H, W)"),
        ("lstm", (60,), {}, "(T, F)"),
        ("lstm", (1, 28, 28), {"mode": "char"}, "(T,)"),
    ],
)
def test_impossible_input_shapes(family: str, shape: tuple, kwargs: dict, needle: str):
    with pytest.raises(InvalidInputShape) as info:
        build(ArchSpec(family=family, num_classes=10, input_shape=shape, kwargs=kwargs))
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("family", "kwargs"),
    [
        ("mlp", {"hidden": 100}),
        ("mlp", {"hidden": [0]}),
        ("cnn2", {"width": 0}),
        ("vgg11", {"width": -1.0}),
        ("vgg11", {"batch_norm": "yes"}),
        ("lstm", {"mode": "audio"}),
        ("lstm", {"hidden": 0}),
        ("lenet5", {"depth": 3}),
    ],
)
def test_bad_kwargs(family: str, kwargs: dict):
    with pytest.raises(ModelZooError):
        build(ArchSpec(family=family, num_classes=10, input_shape=IMAGE, kwargs=kwargs))


def test_arch_spec_json_round_trip():
    for spec in [
        *SPECS,
        ArchSpec(family="mlp", num_classes=10, input_shape=(60,), kwargs={"hidden": [20]}),
    ]:
        again = ArchSpec.from_json(spec.to_json())
        assert again == spec
        assert _n_params(build(again)) == _n_params(build(spec))


def test_registry_refuses_duplicate_name():
    def builder(input_shape: tuple, num_classes: int) -> nn.Module:
        return nn.Linear(1, num_classes)

    with pytest.raises(ValueError, match="already registered"):
        register("mlp")(builder)
    assert build(ArchSpec(family="mlp", num_classes=3, input_shape=(5,))).layers[0].in_features == 5


def test_build_is_deterministic_under_manual_seed():
    for spec in SPECS:
        torch.manual_seed(123)
        a = build(spec).state_dict()
        torch.manual_seed(123)
        b = build(spec).state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), spec


def test_input_dtype_and_example_input():
    assert input_dtype(CHAR_SPEC) == torch.int64
    tokens = example_input(CHAR_SPEC, 5, torch.Generator().manual_seed(0))
    assert tokens.dtype == torch.int64 and tokens.shape == (5, 12)
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 20
    image_spec = ArchSpec(family="lstm", num_classes=10, input_shape=IMAGE)
    assert input_dtype(image_spec) == torch.float32
    x1 = example_input(image_spec, 3, torch.Generator().manual_seed(7))
    x2 = example_input(image_spec, 3, torch.Generator().manual_seed(7))
    assert x1.dtype == torch.float32 and x1.shape == (3, *IMAGE) and torch.equal(x1, x2)
    with pytest.raises(ValueError, match="batch"):
        example_input(image_spec, 0)


def test_a_set_of_inputs_travels_as_a_model_but_is_no_architecture_a_client_runs():
    # Prepare: 3 images as the spec of a set of inputs
    x = torch.rand(3, 1, 8, 8)
    spec = inputs_spec(x, num_classes=10)

    # Execute
    module = build(spec)

    # Assert: one buffer of the inputs' shape, no parameters, no forward pass; not a family a
    # client can pick (nor a network), unlike a mixture, which `composite` lists
    assert spec == ArchSpec(
        family="inputs", num_classes=10, input_shape=(1, 8, 8), kwargs={"count": 3}
    )
    assert {k: tuple(v.shape) for k, v in module.state_dict().items()} == {"inputs": (3, 1, 8, 8)}
    assert _n_params(module) == 0
    with pytest.raises(NotImplementedError):
        module(x)
    assert "inputs" not in families() and "inputs" not in families(composite=True)
    assert "mixture" in families(composite=True)
    assert not is_network(spec) and is_network(
        ArchSpec(family="mlr", num_classes=2, input_shape=(3,))
    )
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ModelZooError, match="at least one"):
            build(spec.with_(kwargs={"count": bad}))
