import dataclasses

import pytest
from helpers import run_cli

from recscale.config import Config, ConfigError, config_to_toml, load_config, preset_names
from recscale.config.loader import preset_dir


def test_presets_exist_and_load():
    for name in ("debug", "default", "criteo_kaggle", "criteo_kaggle_reference", "criteo_terabyte"):
        assert name in preset_names()
        cfg = load_config(name)
        assert len(cfg.model.table_sizes) == 26
    tb = load_config("criteo_terabyte")
    assert tb.model.embedding_dim == 128 and tb.model.top_mlp == [1024, 1024, 512, 256, 1]
    kg = load_config("criteo_kaggle")
    assert kg.model.bottom_mlp == [512, 256, 64, 16] and kg.model.table_sizes[2] == 10131227
    ref = load_config("criteo_kaggle_reference")  # same model, the reference DLRM's recipe
    assert ref.model == kg.model and (ref.embedding.optimizer, ref.embedding.lr) == ("sgd", 0.1)
    assert kg.embedding.optimizer == "rowwise_adagrad"


def test_default_preset_equals_dataclass_defaults():
    assert load_config("default") == Config()


def test_toml_round_trip(tmp_path):
    cfg = load_config(
        "debug", ["--model.embedding_dim=4", "--model.bottom_mlp=16,4", "--train.steps", "7"]
    )
    path = tmp_path / "c.toml"
    path.write_text(config_to_toml(cfg))
    assert load_config(str(path)) == cfg
    assert cfg.train.steps == 7 and cfg.model.bottom_mlp == [16, 4]


def test_strings_with_control_characters_round_trip(tmp_path):
    """TOML forbids raw control characters in a string: a path holding ESC or DEL was
    written raw, and the run's config.toml could not be read back by `eval` or
    `--resume`."""
    odd = 'd\x1b[31m\x7f\x00\t\n\r"q"\\\x85\u00e9'
    ssd = ["--embedding.placement=ssd", f"--embedding.ssd_dir=/tmp/{odd}"]
    cfg = load_config("debug", [*ssd, f"--data.path={odd}"])
    path = tmp_path / "c.toml"
    path.write_text(config_to_toml(cfg))
    assert load_config(str(path)) == cfg
    assert cfg.embedding.ssd_dir == f"/tmp/{odd}"


def test_a_string_of_bytes_that_are_not_utf8_names_the_key():
    """A path of Latin-1 bytes arrives from argv as lone surrogates, which config.toml
    (UTF-8) cannot hold: the run trained, then failed writing it with a traceback."""
    with pytest.raises(ConfigError, match="not UTF-8") as e:
        load_config("debug", ["--embedding.ssd_dir=/tmp/caf\udce9"])
    assert e.value.key == "embedding.ssd_dir"


def test_override_types():
    cfg = load_config(
        None,
        [
            "--train.progress=false",
            "--embedding.lr=1e-2",
            "--model.table_dims=",
            "--data.zipf_alpha=1",
        ],
    )
    assert cfg.train.progress is False and cfg.embedding.lr == 0.01 and cfg.model.table_dims == []
    assert cfg.data.zipf_alpha == 1.0 and isinstance(cfg.data.zipf_alpha, float)


def test_integers_in_scientific_notation_and_lists_in_brackets():
    """Bytes and rows as "9e9" (whole numbers only) and lists as the TOML file writes
    them, on the command line and in a file."""
    cfg = load_config(
        None,
        [
            "--embedding.placement=ssd",
            "--embedding.cache_bytes=9e9",
            "--model.bottom_mlp=[512, 256, 64, 16]",
        ],
    )
    assert cfg.embedding.cache_bytes == 9_000_000_000 and isinstance(cfg.embedding.cache_bytes, int)
    assert cfg.model.bottom_mlp == [512, 256, 64, 16]
    for bad in ("2.5", "1e-3", "inf", "nan", "1e30"):
        with pytest.raises(ConfigError, match="expected an integer"):
            load_config(None, [f"--train.batch_size={bad}"])


def test_a_toml_float_that_is_whole_is_an_integer(tmp_path):
    p = tmp_path / "x.toml"
    p.write_text(
        '[embedding]\nplacement = "host"\ncache_bytes = 2e9\n[train]\nbatch_size = 512.0\n'
    )
    cfg = load_config(str(p))
    assert cfg.embedding.cache_bytes == 2_000_000_000 and cfg.train.batch_size == 512
    p.write_text("[train]\nbatch_size = 512.5\n")
    with pytest.raises(ConfigError, match="train.batch_size"):
        load_config(str(p))


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["--model.embeding_dim=8"], "model.embeding_dim"),  # unknown key
        (["--modle.embedding_dim=8"], "modle.embedding_dim"),  # unknown section
        (["--model.embedding_dim=big"], "model.embedding_dim"),  # wrong type
        (["--train.progress=maybe"], "train.progress"),
        (["--model.table_sizes=10,-5"], "model.table_sizes"),  # negative size
        (["--model.table_sizes="], "model.table_sizes"),  # zero tables
        (["--model.embedding_dim=0"], "model.embedding_dim"),
        (["--train.batch_size=-1"], "train.batch_size"),
        (
            ["--model.embedding_dim=32"],
            "model.bottom_mlp",
        ),  # dot interaction needs bottom to end at 32
        (
            ["--model.table_dims=" + ",".join(["8"] * 25 + ["4"])],
            "model.table_dims",
        ),  # mixed dims + dot
        (["--model.top_mlp=64,2"], "model.top_mlp"),
        (["--embedding.optimizer=adamw"], "embedding.optimizer"),
        (["--train.steps"], "train.steps"),  # missing value
        (["--data.seed=-5"], "data.seed"),  # was numpy's traceback from the data thread
        (["--model.bottom_mlp=64,,16"], "model.bottom_mlp"),  # was [64, 16], a valid MLP
        (["--embedding.table_compression=C1=qr,C1=tt"], "embedding.table_compression"),
        (["--train.steps=10", "--train.epochs=-1"], "train.epochs"),  # was dropped unread
        # a float32 tensor cannot hold it: torch's overflow traceback at the model's build
        (["--embedding.initial_accumulator=1e308"], "embedding.initial_accumulator"),
        (["--embedding.optimizer=adam", "--embedding.lr=1e308"], "embedding.lr"),  # its step
    ],
)
def test_bad_values_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert e.value.key == key
    assert f"'{key}'" in str(e.value)


def test_bad_toml_file_names_the_key(tmp_path):
    p = tmp_path / "x.toml"
    p.write_text("[model]\nembedding_dim = 8\nlayers = 3\n")
    with pytest.raises(ConfigError, match="model.layers"):
        load_config(str(p))
    with pytest.raises(ConfigError, match="neither a file nor a preset"):
        load_config("no_such_preset")


def test_every_preset_file_only_uses_known_keys():
    # load_config raises on unknown keys; also check each preset sets something.
    for path in preset_dir().glob("*.toml"):
        assert path.read_text().strip()
        load_config(str(path))


def test_cli_bad_config_exits_2_and_names_key():
    r = run_cli("train", "--config", "debug", "--model.embedding_dim=-3")
    assert r.returncode == 2
    assert "model.embedding_dim" in r.stderr and "Traceback" not in r.stderr


def test_cli_config_prints_resolved_toml():
    r = run_cli("config", "--config", "debug", "--train.steps=11")
    assert r.returncode == 0, r.stderr
    assert "steps = 11" in r.stdout and "[model]" in r.stdout


def test_config_sections_are_dataclasses():
    for f in dataclasses.fields(Config):
        assert dataclasses.is_dataclass(f.default_factory())


def test_a_memory_budget_no_planner_reads_is_refused(capsys):
    """``embedding.memory_budget_gb`` is what ``placement=auto`` fits the tables into:
    with another placement (the default ``device``) it limited nothing, without a word,
    and so it did on several ranks, where each rank plans with
    ``distributed.memory_per_rank_gb``. Both are refused, naming the key."""
    from recscale.cli.main import main

    for placement in ("device", "ssd", "host"):
        with pytest.raises(ConfigError, match="embedding.memory_budget_gb.*placement=auto"):
            load_config(
                "debug", [f"--embedding.placement={placement}", "--embedding.memory_budget_gb=16"]
            )
    load_config("debug", ["--embedding.placement=auto", "--embedding.memory_budget_gb=16"])
    argv = ["bench", "pipeline", "--config", "debug", "--steps", "1", "--warmup", "0"]
    assert main([*argv, "--embedding.placement=auto", "--embedding.memory_budget_gb=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("recscale: error: config key 'embedding.memory_budget_gb'"), err
    assert "at 2 ranks each rank plans with distributed.memory_per_rank_gb" in err[-1]


@pytest.mark.parametrize(
    "override, needs",
    [
        ("--embedding.beta1=0.8", "embedding.optimizer=adam"),
        ("--embedding.initial_accumulator=0.1", "embedding.optimizer=rowwise_adagrad"),
        ("--model.dcn_rank=64", "model.interaction=dcnv2"),
        ("--model.interaction_self=true", "model.interaction=dot"),
        ("--embedding.ssd_dir=/tmp/rows", "embedding.placement=ssd, host or auto"),
        ("--embedding.cache_bytes=100000", "embedding.placement=ssd, host or auto"),
        ("--embedding.warm_start=false", "embedding.placement=ssd, host or auto"),
        ("--embedding.qr_buckets=8", "a table compressed by qr"),
        ("--embedding.tt_rank=4", "a table compressed by tt"),
        ("--embedding.hot_sample_rows=1000", "embedding.hot_fraction > 0"),
        ("--optimizer.decay_to=0.5", "optimizer.decay_steps > 0"),
    ],
)
def test_a_key_set_where_it_does_not_act_is_refused(override, needs):
    """A key that acts only under another's setting (Adam's betas, DCNv2's rank, a
    tier's cache, a compression's knob, the decay's floor) changed nothing without it,
    without a word.
    Set away from its default it is refused, naming what it needs; with that setting it
    loads, and every preset (their values at the defaults where they do not act) too."""
    key = override[2:].split("=")[0]
    elsewhere = ["--model.interaction=cat"] if key == "model.interaction_self" else []
    with pytest.raises(ConfigError, match=f"'{key}'.*acts only with {needs}"):
        load_config("debug", ["--embedding.optimizer=sgd", *elsewhere, override])
    enable = {
        "embedding.beta1": "--embedding.optimizer=adam",
        "embedding.initial_accumulator": "--embedding.optimizer=rowwise_adagrad",
        "model.dcn_rank": "--model.interaction=dcnv2",
        "model.interaction_self": "--model.interaction=dot",
        "embedding.ssd_dir": "--embedding.placement=ssd",
        "embedding.cache_bytes": "--embedding.placement=host",
        "embedding.warm_start": "--distributed.plan=plan.json",  # a plan file places tiers
        "embedding.qr_buckets": "--embedding.table_compression=C5=qr",
        "embedding.tt_rank": "--embedding.compression=tt",
        "embedding.hot_sample_rows": "--embedding.hot_fraction=0.1",
        "optimizer.decay_to": "--optimizer.decay_steps=10",
    }[key]
    over = [enable, override]
    if key == "embedding.hot_sample_rows":
        over.append("--embedding.compression=tt")  # hot rows are a compressed table's
    load_config("debug", over)
    for name in preset_names():
        load_config(name)
