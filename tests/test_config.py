"""Configuration: sizes with units, frozen models, and errors that name the field, value and rule."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specter.config import DraftConfig, EngineConfig, GenerationConfig, parse_bytes
from specter.errors import ConfigError


@pytest.mark.parametrize("text, expected", [("24GiB", 24 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("4194304", 4 * 2**20), (123, 123)])
def test_budget_units(text, expected):
    assert EngineConfig(budget=text).budget == expected


@given(st.integers(min_value=1, max_value=2**40), st.sampled_from(["KiB", "MiB", "GiB"]))
def test_parse_bytes_scales_by_unit(number, unit):
    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    assert parse_bytes(f"{number}{unit}") == number * scale


@pytest.mark.parametrize("bad", ["24 parsecs", "-1GiB", "0", "GiB", "", "24", "4096"])
def test_bad_budget_names_field_and_value(bad):
    with pytest.raises(ConfigError) as info:
        EngineConfig.build(budget=bad)
    assert "EngineConfig.budget" in str(info.value) and repr(bad) in str(info.value)


@pytest.mark.parametrize("text", ["24", "16.5", "1048575"])
def test_a_bare_number_below_a_mib_asks_for_its_unit(text):
    """`--budget 24` meant 24GiB: as 24 bytes it skipped every bench cell with nothing on the command line."""
    with pytest.raises(ValueError, match=rf"{text}GiB"):
        parse_bytes(text)


@pytest.mark.parametrize("field, value, rule", [
    ("max_new_tokens", 0, "greater than or equal to 1"),
    ("temperature", -0.5, "greater than or equal to 0"),
    ("top_p", 1.5, "less than or equal to 1"),
    ("top_p", 0.0, "greater than 0"),
    ("top_k", 0, "greater than or equal to 1"),
])
def test_generation_errors(field, value, rule):
    with pytest.raises(ConfigError) as info:
        GenerationConfig.build(**{field: value})
    message = str(info.value)
    assert f"GenerationConfig.{field}" in message and repr(value) in message and rule in message


@pytest.mark.parametrize("stops", [("",), ("\n", "")])
def test_an_empty_stop_string_is_refused_not_dropped(stops):
    """An empty stop string is found before any text, so it names no place to stop; the detokenizer dropped it and the
    request ran on as if none had been given."""
    with pytest.raises(ConfigError) as info:
        GenerationConfig.build(stop_strings=stops)
    message = str(info.value)
    assert "GenerationConfig.stop_strings" in message and f"stop string {len(stops) - 1} is empty" in message, message
    assert "leave it out" in message


def test_unknown_field_and_device():
    with pytest.raises(ConfigError, match="budgett"):
        EngineConfig.build(budgett="1GiB")
    with pytest.raises(ConfigError, match="device"):
        EngineConfig.build(device="tpu")


def test_budget_and_residents_are_exclusive():
    with pytest.raises(ConfigError, match="either budget or residents"):
        EngineConfig.build(budget="1GiB", residents=4)


def test_frozen_and_described():
    """Setting a field was pydantic's multi-line ValidationError, which named no way out (the README itself showed
    `EngineConfig.tuning.kernels.static_mla = False`); a positional value was a TypeError about __init__."""
    config = EngineConfig()
    with pytest.raises(ConfigError, match=r"^EngineConfig is immutable: exact cannot be set on it; build one with the "
                                          r"value instead, e\.g\. EngineConfig\(") as caught:
        config.exact = False  # type: ignore[misc]
    assert "\n" not in str(caught.value) and "EngineConfig(**{**old.model_dump(), 'exact': value})" in str(caught.value)
    assert config.exact is EngineConfig().exact  # unchanged
    with pytest.raises(ConfigError, match="GenerationConfig is immutable: max_new_tokens"):
        GenerationConfig().max_new_tokens = 5  # type: ignore[misc]
    with pytest.raises(ConfigError, match="KernelTuning is immutable: static_mla cannot be set on it; give it when the "
                                          "EngineConfig is built"):
        config.tuning.kernels.static_mla = False  # type: ignore[misc]
    assert config.tuning.kernels.static_mla == EngineConfig().tuning.kernels.static_mla
    built = EngineConfig(tuning={"kernels": {"static_mla": False}})  # the way the error names
    assert built.tuning.kernels.static_mla is False
    with pytest.raises(ConfigError, match=r"EngineConfig takes its fields by name, e\.g\. EngineConfig\(residents=4"):
        EngineConfig(6)  # type: ignore[misc]
    assert EngineConfig(**{**config.model_dump(), "residents": 3}).residents == 3
    with pytest.raises(ConfigError, match="^EngineConfig has no field 'resident'; its fields: device, "):
        config.resident = 4  # type: ignore[attr-defined]  # a typo: no advice to build one with a field that is not
    with pytest.raises(ConfigError, match="EngineConfig is immutable: residents cannot be deleted"):
        del config.residents
    import copy
    import pickle

    assert pickle.loads(pickle.dumps(config)) == config and copy.deepcopy(config) == config  # neither sets attributes
    for model in (EngineConfig, GenerationConfig):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_static_verify_defaults_to_on_where_cuda_graphs_run():
    from specter.config import EngineConfig

    assert EngineConfig().static_verify is None
    assert EngineConfig(cuda_graphs=True).verify_is_static("cuda")
    assert not EngineConfig(cuda_graphs=False).verify_is_static("cuda")
    assert not EngineConfig().verify_is_static("cpu")
    assert EngineConfig(static_verify=True).verify_is_static("cpu")
    assert not EngineConfig(static_verify=False, cuda_graphs=True).verify_is_static("cuda")


def test_scout_needs_a_draft_depth():
    with pytest.raises(ConfigError, match="scout needs a draft"):
        EngineConfig.build(draft={"scout": True, "k_max": 0})
    assert EngineConfig.build(draft={"scout": True, "k": 0}).draft.scout


def test_an_unknown_link_is_refused_when_the_config_is_built():
    """Before any weight loads: the transfer engine that reads it is built only after the whole pool is pinned."""
    with pytest.raises(ConfigError, match="EngineConfig.link = 'gen9'.*not a link preset"):
        EngineConfig.build(link="gen9", residents=2)
    assert EngineConfig.build(link="gen4").link == "gen4" and EngineConfig.build(link="12.5").link == "12.5"


@pytest.mark.parametrize("bad", ["1" + "0" * 308 + ".5GB", 0.5, float("inf"), float("nan")])
def test_a_budget_that_overflows_or_truncates_to_nothing_is_a_config_error(bad):
    """An OverflowError traceback (a float past its range), or 0.5 bytes accepted as a budget of 0."""
    with pytest.raises(ConfigError, match="EngineConfig.budget"):
        EngineConfig.build(budget=bad)


def test_a_whole_number_of_bytes_stays_exact():
    assert parse_bytes(str(2**53 + 1)) == 2**53 + 1  # through a float it was 2**53
    assert parse_bytes("1.5GiB") == 3 * 2**29


def test_a_thread_count_past_what_openmp_can_start_is_refused():
    """torch.set_num_threads(4096) ended the process in a segfault (20000: libgomp's "Thread creation failed" first)."""
    with pytest.raises(ConfigError) as info:
        EngineConfig.build(threads=4096)
    assert "EngineConfig.threads" in str(info.value) and "less than or equal to 1024" in str(info.value)
    assert EngineConfig.build(threads=1024).threads == 1024


@pytest.mark.parametrize(("values", "said"), [
    ({"residents": 6.5}, "EngineConfig.residents = 6.5: Input should be a valid integer"),
    ({"budget": -5}, "EngineConfig.budget = -5: a byte count must be a whole number of bytes from 1"),
    ({"foo": 1}, "EngineConfig.foo = 1: Extra inputs are not permitted"),
    ({"draft": {"k": -1}}, "EngineConfig.draft.k = -1"),
    ({"tuning": {"cache": {"roll_hot_window": -1}}}, "EngineConfig.tuning.cache.roll_hot_window = -1"),
])
def test_a_configuration_constructor_raises_a_config_error_naming_the_field(values, said):
    """The constructors the README shows raised pydantic's ValidationError (several lines and a link, no SpecterError:
    a caller catching SpecterError missed it); a nested configuration's error keeps its path."""
    with pytest.raises(ConfigError) as caught:
        EngineConfig(**values)
    assert said in str(caught.value) and "errors.pydantic.dev" not in str(caught.value), str(caught.value)
    with pytest.raises(ConfigError, match="DraftConfig.k = -1"):
        DraftConfig(k=-1)


@pytest.mark.parametrize("field", ["max_new_tokens", "top_k", "seed"])
def test_an_integer_generation_field_refuses_a_float_however_whole(field):
    """3.0 was read as 3 for these, while a token id of 1.0 is refused: one rule, an integer is an integer."""
    import numpy as np

    with pytest.raises(ConfigError, match=f"GenerationConfig.{field} = 3.0: must be an integer, not float"):
        GenerationConfig.build(**{field: 3.0})
    assert getattr(GenerationConfig.build(**{field: np.int64(3)}), field) == 3


@pytest.mark.parametrize("values", [dict(residents=True), dict(max_context=False), dict(draft={"k_max": True}),
                                    dict(placement_overlap=True), dict(tuning={"cache": {"roll_hot_window": True}})])
def test_a_bool_is_no_number(values):
    """pydantic's lax mode took True as 1: EngineConfig(residents=True) loaded with one slot a layer."""
    with pytest.raises(ConfigError, match=r"= (True|False): must be a number, not bool (True|False)"):
        EngineConfig(**values)
    assert EngineConfig(recalibrate=True).recalibrate is True  # a bool field takes one
