import pytest

from coordinator.config import ConfigError, load_config, parse_overrides
from coordinator.strategies import strategy_class


def test_every_algorithm_has_a_section_with_the_documented_defaults():
    cfg = load_config()
    assert cfg.fml.alpha == 0.5 and cfg.fml.beta == 1.0 and cfg.fml.lr == 0.01
    assert cfg.fml.momentum == 0.9 and cfg.fml.weight_decay == 5e-4 and cfg.fml.batch_size == 128
    assert cfg.fml.local_epochs == 5 and cfg.fml.lr_schedule == "none"  # see FMLConfig
    assert cfg.fml.alpha_gate == "soft" and cfg.fml.guard and cfg.fml.guard_z == 2.0
    p = cfg.pfml
    assert (p.k_steps, p.beta, p.local_iterations) == (3, 2.0, 10)
    # ours, measured (see PFMLConfig): the paper's λ 20, η 0.01, D 200 are a setting away
    assert (p.lam, p.lr, p.batch_size, p.local_epochs) == (1.0, 0.05, 20, 5)
    assert p.aux_init == "persist" and p.participation == "sampled"
    assert cfg.persfl.distill_epochs is None  # the local budget: rounds × local_epochs
    assert (cfg.persfl.distill_lambdas, cfg.persfl.distill_temperatures) == ([0, 0.5, 0.75], [1, 4])
    assert cfg.fedprox.mu == 0.01 and cfg.fedavg.weighting == "by_samples"
    # ours, measured: the guard's students train 40 epochs and see four views of each image an
    # epoch, shifted by up to a pixel; FedeRiCo's and PFML's mixed too (see GuardConfig)
    for cfg_ in (cfg.fml, cfg.persfl, cfg.fedme, cfg.pfml, cfg.federico):
        assert cfg_.guard_distill_epochs == 40
        assert (cfg_.guard_distill_shift, cfg_.guard_distill_views) == (1, 4)
    assert cfg.federico.guard_distill_mix and cfg.pfml.guard_distill_mix
    assert not any(c.guard_distill_mix for c in (cfg.fml, cfg.persfl, cfg.fedme))
    # ours, measured: FedMe's guard fine-tunes its aggregate 20 epochs, the others' 5
    assert cfg.fedme.guard_ft_epochs == 20
    assert cfg.fml.guard_ft_epochs == cfg.pfml.guard_ft_epochs == 5
    assert cfg.persfl.guard_ft_epochs == cfg.federico.guard_ft_epochs == 5
    # ours, measured: FedMe's guard mixes its two models equally; the others weigh them per client
    assert cfg.fedme.guard_mix_weights == [0.5]
    for weighed in (cfg.fml, cfg.persfl, cfg.pfml, cfg.federico):
        assert weighed.guard_mix_weights == [1, 0.75, 0.5, 0.25, 0]
    # ours, measured: on a device of another architecture, PersFL's guard never defaults to
    # PersFL's student alone; the others weigh as everywhere
    assert cfg.persfl.guard_mix_weights_other_arch == [0.75, 0.5, 0.25, 0]
    for same in (cfg.fml, cfg.fedme, cfg.pfml, cfg.federico):
        assert same.guard_mix_weights_other_arch is None


def test_precedence_defaults_toml_flags_overrides(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        'algorithm = "fml"\nrounds = 7\nclients = 3\n[fml]\nalpha = 0.2\nbeta = 0.4\n'
        '[data]\ndataset = "synthetic"\n'
    )
    cfg = load_config(toml, {"rounds": 9, "clients": None}, parse_overrides(["fml.alpha=0.3"]))
    assert cfg.rounds == 9  # flag beats file
    assert cfg.clients == 3  # a flag left unset does not
    assert cfg.fml.alpha == 0.3  # --set beats everything
    assert cfg.fml.beta == 0.4  # file beats default
    assert cfg.data.dataset == "synthetic"


def test_common_training_flags_apply_to_the_algorithm_and_every_baseline():
    cfg = load_config(
        None, {"algorithm": "pfml", "baselines": ["local", "fedavg"]}, training={"lr": 0.05}
    )
    assert cfg.pfml.lr == cfg.local.lr == cfg.fedavg.lr == 0.05
    assert cfg.fml.lr == 0.01  # not part of this run


def test_overrides_parse_json_values_and_nested_keys():
    got = parse_overrides(['models=["mlp","lenet5"]', "data.partition_params.alpha=0.1", "x=abc"])
    assert got == {"models": ["mlp", "lenet5"], "data.partition_params.alpha": 0.1, "x": "abc"}
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["novalue"])


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"fml.alpha": 2.0}, "fml.alpha"),
        ({"fml.nonsense": 1}, "fml.nonsense"),
        ({"algorithm": "fedsgd"}, "unknown algorithm 'fedsgd'"),
        ({"rounds": 0}, "rounds"),
        ({"device": "tpu"}, "device"),
        ({"models": ["lenet5", "resnet"]}, "unknown architecture family 'resnet'"),
        ({"global_model": "vit"}, "unknown architecture family 'vit'"),
        ({"data.dataset": "imagenet"}, "unknown dataset 'imagenet'"),
        ({"data.partition": "zipf"}, "unknown partition 'zipf'"),
    ],
)
def test_invalid_values_name_the_field(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, None, overrides)


def test_bad_toml_and_missing_file_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = = 3")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


def test_training_flags_resolve_against_the_algorithm_set_by_an_override():
    # `--set algorithm=pfml --lr 0.05`: the override names the algorithm the flag belongs to.
    cfg = load_config(None, {}, {"algorithm": "pfml"}, training={"lr": 0.05})
    assert cfg.algorithm == "pfml" and cfg.pfml.lr == 0.05
    assert cfg.fml.lr == 0.01  # the default algorithm is not part of this run
    cfg = load_config(None, {}, {"baselines": ["fedavg"]}, training={"batch_size": 16})
    assert cfg.fedavg.batch_size == 16


def test_a_section_override_beats_the_common_training_flag():
    cfg = load_config(None, {"algorithm": "pfml"}, {"pfml.lr": 0.02}, training={"lr": 0.05})
    assert cfg.pfml.lr == 0.02


def test_local_epochs_lands_on_pfml_as_epochs_and_leaves_its_iterations_alone():
    cfg = load_config(
        None, {"algorithm": "pfml", "baselines": ["local"]}, training={"local_epochs": 3}
    )
    assert cfg.local.local_epochs == 3 and cfg.pfml.local_epochs == 3
    assert cfg.pfml.local_iterations == 10
    assert (
        load_config(None, {"algorithm": "pfml"}, {"pfml.local_iterations": 4}).pfml.local_epochs
        is None
    )


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("momentum", 0.9, "no momentum"),
        ("weight_decay", 1e-4, "proximal term"),
        ("optimizer", "adam", "plain gradient steps"),
        ("lr_schedule", "step", "constant"),
    ],
)
def test_pfml_refuses_settings_it_would_ignore(field, value, needle):
    with pytest.raises(ConfigError, match=rf"pfml.*{field}.*{needle}"):
        load_config(None, {"algorithm": "pfml"}, {f"pfml.{field}": value})


def test_lr_gamma_without_a_step_schedule_is_refused():
    with pytest.raises(ConfigError, match=r"lr_gamma.*lr_schedule"):
        load_config(None, None, {"fml.lr_gamma": 0.5})
    assert load_config(None, None, {"fml.lr_gamma": 0.5, "fml.lr_schedule": "step"}).fml.lr_gamma


# The published algorithms, written out from the papers (docs/algorithms.md's preset table).
PAPER = {
    "fml": {"guard": False, "alpha_gate": "off", "beta": 0.5, "lr_schedule": "step"},
    "pfml": {
        "guard": False,
        "local_epochs": None,
        "local_iterations": 10,
        "batch_size": 200,
        "lr": 0.01,
        "lam": 20.0,
        "aux_init": "persist",
    },
    "persfl": {"guard": False},
    "fedme": {"guard": False, "kl_gate": "off"},
    "federico": {"guard": False, "lr": 0.001, "batch_size": 50},
}


def _with_preset(name: str, preset: str) -> tuple[dict, dict, set[str]]:
    """The algorithm's section under `preset`, its defaults, and the fields that differ."""
    cfg = load_config(None, None, {f"{name}.preset": preset})
    section = cfg.algorithm_config(name).model_dump()
    default = cfg.algorithm_config(name).model_validate({}).model_dump()
    return section, default, {k for k in section if section[k] != default[k]} - {"preset"}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_the_paper_preset_is_the_published_algorithm(name):
    section, default, changed = _with_preset(name, "paper")
    # exactly the published values, and nothing else moved
    assert {k: section[k] for k in PAPER[name]} == PAPER[name]
    assert changed == {k for k, v in PAPER[name].items() if default[k] != v}


# What the preset "trusted" shares, written out from docs/algorithms.md ("The clients' copies
# and the coordinator's inputs together"): the settings with which each algorithm's
# own-architecture models met local training + 5 on both long label-skew splits.
TRUSTED = {
    "fml": {"guard_peers": 3, "guard_distill_unlabeled": 200},
    "pfml": {"guard_peers": 3, "guard_distill_unlabeled": 200},
    "persfl": {"guard_peers": 3, "guard_distill_unlabeled": 200},
    "fedme": {"guard_distill_unlabeled": 200},
    "federico": {},
}


@pytest.mark.parametrize("name", sorted(TRUSTED))
def test_the_trusted_preset_shares_what_the_algorithm_can_and_moves_nothing_else(name):
    section, _, changed = _with_preset(name, "trusted")
    assert changed == set(TRUSTED[name])
    assert {k: section[k] for k in TRUSTED[name]} == TRUSTED[name]
    # only what the algorithm's coordinator can send: a setting it cannot is refused at its start
    strategy = strategy_class(name)
    assert "guard_peers" not in TRUSTED[name] or strategy.offers_peers
    assert "guard_distill_unlabeled" not in TRUSTED[name] or strategy.carries_unlabeled


def test_a_setting_given_with_the_trusted_preset_wins_over_it():
    cfg = load_config(None, None, {"pfml.preset": "trusted", "pfml.guard_distill_unlabeled": 0})
    assert (cfg.pfml.guard_peers, cfg.pfml.guard_distill_unlabeled) == (3, 0)
    assert type(cfg.pfml).model_validate(cfg.pfml.model_dump()) == cfg.pfml


def test_a_setting_given_with_the_paper_preset_wins_over_it():
    cfg = load_config(None, None, {"fml.preset": "paper", "fml.beta": 0.7, "fml.guard": True})
    assert (cfg.fml.beta, cfg.fml.guard, cfg.fml.alpha_gate) == (0.7, True, "off")
    # a config written out whole and read back is the same config
    assert type(cfg.fml).model_validate(cfg.fml.model_dump()) == cfg.fml
