import textwrap

import pytest

from hybrid_runtime.config import GEOMETRIES, ConfigError, config_from_dict, load_config, parse_override


def test_defaults_match_design():
    cfg = config_from_dict({})
    assert (cfg.kv_cache.sink, cfg.kv_cache.local, cfg.kv_cache.page_size) == (64, 256, 16)
    assert cfg.kv_cache.block_sizes == (16, 32, 64, 128)
    assert (cfg.policy.block_size, cfg.policy.budget) == (16, 0.05)


def test_keys_that_would_do_nothing_are_refused():
    # The error bound tau arrives with the predictor that reads it; executors are chosen by the
    # runtime (numba on the CPU, UVA on CUDA, the torch reference without CUDA), not by config.
    with pytest.raises(ConfigError, match="tau"):
        config_from_dict({"policy": {"tau": 0.1}})
    with pytest.raises(ConfigError, match="executors"):
        config_from_dict({"executors": {"cpu": "numba"}})


def test_reference_geometry_by_name():
    assert config_from_dict({"geometry": "qwen2.5-7b"}).geometry == GEOMETRIES["qwen2.5-7b"]
    assert config_from_dict({"geometry": {"name": "smollm2-135m"}}).geometry.group_size == 3


def test_config_is_frozen():
    cfg = config_from_dict({})
    with pytest.raises(Exception):
        cfg.kv_cache.sink = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "data, where, allowed",
    [
        ({"kv_cache": {"snk": 64}}, "kv_cache.snk", "sink, local"),
        ({"bogus": 1}, "bogus", "geometry, kv_cache"),
        ({"kv_cache": {"sink": -1}}, "kv_cache.sink", "0 <= value"),
        ({"kv_cache": {"sink": "many"}}, "kv_cache.sink", "integer"),
        ({"kv_cache": {"dtype": "fp16"}}, "kv_cache.dtype", "'bf16', 'fp32'"),
        ({"kv_cache": {"block_sizes": [16, 48]}}, "kv_cache.block_sizes", "[16, 32, 64, 128]"),
        ({"kv_cache": {"local": 250}}, "kv_cache", "multiples of the page size"),
        ({"policy": {"budget": 1.5}}, "policy.budget", "value <= 1.0"),
        ({"scheduler": {"policy": "greedy"}}, "scheduler.policy", "'fluxion'"),
        ({"scheduler": {"pin_cores": "yes"}}, "scheduler.pin_cores", "true or false"),
        ({"geometry": "gpt-5"}, "geometry.name", "llama-3.1-8b"),
        ({"geometry": {"layers": 2, "q_heads": 9, "kv_heads": 2, "head_dim": 64}}, "geometry.q_heads", "multiple"),
        ({"policy": {"streaming_heads": {40: [0]}}}, "policy.streaming_heads.40", "0..31"),
        ({"policy": {"block_size": 64}, "kv_cache": {"block_sizes": [16, 32]}}, "policy.block_size", "[16, 32]"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(data, where, allowed):
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    msg = str(info.value)
    assert msg.startswith(where), msg
    assert allowed in msg, msg


def test_yaml_file_and_overrides(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(
        textwrap.dedent(
            """
            geometry: llama-3.1-8b
            kv_cache: {sink: 32, dtype: fp32}
            scheduler: {policy: cpu_only}
            """
        )
    )
    cfg = load_config(path, dict([parse_override("scheduler.cpu_workers=3"), parse_override("policy.budget=0.02")]))
    assert cfg.kv_cache.sink == 32 and cfg.kv_cache.dtype == "fp32"
    assert cfg.scheduler.cpu_workers == 3 and cfg.policy.budget == pytest.approx(0.02)
    assert cfg.to_dict()["kv_cache"]["block_sizes"] == [16, 32, 64, 128]


def test_bad_yaml_and_bad_override(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("kv_cache: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("scheduler.cpu_workers")
