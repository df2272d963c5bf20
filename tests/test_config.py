import dataclasses
import textwrap
from pathlib import Path

import pytest

from hybrid_runtime.config import PAGE_SIZE, GEOMETRIES, ConfigError, config_from_dict, load_config, parse_override, resolved


def test_defaults_match_design():
    cfg = config_from_dict({})
    assert (cfg.kv_cache.sink, cfg.kv_cache.local, PAGE_SIZE) == (64, 256, 16)
    assert cfg.kv_cache.block_sizes == (16, 32, 64, 128)
    assert (cfg.selection.block_size, cfg.selection.budget) == (16, 0.05)
    assert (cfg.scheduler.placement, cfg.scheduler.gpu_worker) == ("fluxion", "auto")


def test_keys_that_would_do_nothing_are_refused():
    # The error bound tau arrives with the predictor that reads it; executors are chosen by the
    # runtime (numba on the CPU, UVA on CUDA, the torch reference without CUDA), not by config.
    with pytest.raises(ConfigError, match="tau"):
        config_from_dict({"selection": {"tau": 0.1}})
    with pytest.raises(ConfigError, match="executors"):
        config_from_dict({"executors": {"cpu": "numba"}})
    with pytest.raises(ConfigError, match=r"kv_cache.page_size: removed; a page is 16 tokens"):
        config_from_dict({"kv_cache": {"page_size": 16}})
    with pytest.raises(ConfigError, match=r"sparda.foo: unknown key"):
        config_from_dict({"sparda": {"foo": 1}})
    with pytest.raises(ConfigError, match=r"policy: replaced by selection .*name fixed / full / streaming / predicted / "
                                          r"nosa / asynctls / sparda / evosparse"):
        config_from_dict({"policy": {"name": "fixed"}})


def test_reference_geometry_by_name():
    assert config_from_dict({"geometry": "qwen2.5-7b"}).geometry == GEOMETRIES["qwen2.5-7b"]
    assert config_from_dict({"geometry": {"name": "smollm2-135m"}}).geometry.group_size == 3
    # A reference model's first layers: the runtime (and the resolved config) has exactly those.
    first4 = config_from_dict({"geometry": {"name": "qwen2.5-7b", "layers": 4}}).geometry
    assert first4 == dataclasses.replace(GEOMETRIES["qwen2.5-7b"], layers=4)


def test_gpu_worker_auto_means_a_gpu_lane_only_with_cuda():
    auto = config_from_dict({}).scheduler
    assert auto.gpu_lane(cuda=True) and not auto.gpu_lane(cuda=False)
    on = config_from_dict({"scheduler": {"gpu_worker": True}}).scheduler
    assert on.gpu_lane(cuda=False)  # the torch reference lane on a host without CUDA
    assert not config_from_dict({"scheduler": {"gpu_worker": False}}).scheduler.gpu_lane(cuda=True)
    ran = resolved(config_from_dict({}), cuda=False)
    assert (ran.scheduler.gpu_worker, ran.kv_cache.device) == (False, "cpu")
    assert resolved(config_from_dict({}), cuda=True).scheduler.gpu_worker is True
    # The CUDA-only switches resolve to what they do: nothing on the host.
    sc, kv = ran.scheduler, ran.kv_cache
    assert (sc.cpu_lane_trails, sc.gate_trailing_claims, kv.window_graphs) == (False,) * 3
    on_cuda = resolved(config_from_dict({}), cuda=True)
    assert (on_cuda.scheduler.cpu_lane_trails, on_cuda.scheduler.gate_trailing_claims,
            on_cuda.kv_cache.window_graphs) == (True,) * 3
    assert on_cuda.scheduler.claim_launch == "direct"  # the default
    # How claims launch is the GPU lane's: without the lane the key keeps its default.
    graphs = {"scheduler": {"claim_launch": "graphs"}}
    assert resolved(config_from_dict(graphs), cuda=True).scheduler.claim_launch == "graphs"
    direct = config_from_dict({"scheduler": {"claim_launch": "direct"}})
    assert resolved(direct, cuda=True).scheduler.claim_launch == "direct"
    no_lane = resolved(config_from_dict({"scheduler": {"gpu_worker": False, "claim_launch": "plans"}}), cuda=True)
    assert no_lane.scheduler.claim_launch == "direct" and resolved(config_from_dict(graphs), cuda=False).scheduler.claim_launch == "direct"
    with pytest.raises(ConfigError, match=r"scheduler.claim_launch.*plans.*native.*graphs"):
        config_from_dict({"scheduler": {"claim_launch": "eager"}})
    with pytest.raises(ConfigError, match=r"scheduler.claim_graphs: replaced by scheduler.claim_launch"):
        config_from_dict({"scheduler": {"claim_graphs": True}})
    assert config_from_dict(ran.to_dict()) == ran and config_from_dict(on_cuda.to_dict()) == on_cuda


def test_gpu_metadata_resolves_to_where_the_uva_lane_reads_it():
    """`kv_cache.gpu_metadata` keeps the metadata copy only where the GPU lane is the UVA
    executor on CUDA; everywhere else the resolved config records that it does nothing."""
    assert config_from_dict({}).kv_cache.gpu_metadata is True
    assert resolved(config_from_dict({}), cuda=True).kv_cache.gpu_metadata is True
    assert resolved(config_from_dict({}), cuda=False).kv_cache.gpu_metadata is False
    for other in ({"kv_cache": {"gpu_metadata": False}}, {"scheduler": {"gpu_worker": False}},
                  {"kv_cache": {"device": "cpu"}}):
        assert resolved(config_from_dict(other), cuda=True).kv_cache.gpu_metadata is False, other
    asynctls = {"selection": {"name": "asynctls"}, "scheduler": {"placement": "gpu_only"}}
    assert resolved(config_from_dict(asynctls), cuda=True).kv_cache.gpu_metadata is False  # its own executor
    with pytest.raises(ConfigError, match="gpu_metadata"):
        config_from_dict({"kv_cache": {"gpu_metadata": "auto"}})


def test_shipped_configs_load():
    root = Path(__file__).resolve().parents[1] / "configs"
    quick = load_config(root / "quickstart.yaml")
    assert quick.geometry == dataclasses.replace(GEOMETRIES["llama-3.1-8b"], layers=4)
    hf = load_config(root / "hf_smollm2.yaml")
    assert hf.geometry == config_from_dict({}).geometry  # left unset: taken from the model


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
        ({"selection": {"budget": 1.5}}, "selection.budget", "value <= 1.0"),
        ({"scheduler": {"placement": "greedy"}}, "scheduler.placement", "'fluxion'"),
        ({"scheduler": {"gpu_worker": "yes"}}, "scheduler.gpu_worker", "'auto', true or false"),
        ({"scheduler": {"gpu_worker": 1}}, "scheduler.gpu_worker", "expected true/false or string"),
        ({"geometry": {"name": "qwen2.5-7b", "q_heads": 4}}, "geometry.q_heads", "only `layers`"),
        ({"geometry": {"name": "qwen2.5-7b", "layers": 0}}, "geometry.layers", "1 <= value"),
        ({"scheduler": {"pin_cores": "yes"}}, "scheduler.pin_cores", "true or false"),
        ({"geometry": "gpt-5"}, "geometry.name", "llama-3.1-8b"),
        ({"geometry": {"layers": 2, "q_heads": 9, "kv_heads": 2, "head_dim": 64}}, "geometry.q_heads", "multiple"),
        ({"selection": {"streaming_heads": {40: [0]}}}, "selection.streaming_heads.40", "0..31"),
        ({"selection": {"block_size": 64}, "kv_cache": {"block_sizes": [16, 32]}}, "selection.block_size", "[16, 32]"),
        # The names of before: the error names where each setting lives now.
        ({"policy": {"name": "full"}}, "policy: replaced by selection", "fixed / full / streaming"),
        ({"scheduler": {"policy": "cpu_only"}}, "scheduler.policy: replaced by scheduler.placement", "fluxion"),
        ({"workload": {"layers": 4}}, "workload.layers: replaced by geometry.layers", "layers: 4"),
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
            scheduler: {placement: cpu_only}
            """
        )
    )
    cfg = load_config(path, dict([parse_override("scheduler.cpu_workers=3"), parse_override("selection.budget=0.02")]))
    assert cfg.kv_cache.sink == 32 and cfg.kv_cache.dtype == "fp32"
    assert cfg.scheduler.cpu_workers == 3 and cfg.selection.budget == pytest.approx(0.02)
    assert cfg.to_dict()["kv_cache"]["block_sizes"] == [16, 32, 64, 128]


def test_bad_yaml_and_bad_override(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("kv_cache: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("scheduler.cpu_workers")


def test_selection_keys_that_only_predicted_reads_are_refused_elsewhere():
    """`checkpoint`, `block_sizes`, `streaming_threshold` and `skip_streaming` are read only by the
    predicted selection, `streaming_heads` by every other config selection: set where nothing reads
    them, they would do nothing. A variant's selection lays its keys over the top level's, so only
    what the variant itself sets is checked against the variant's name."""
    base = {"geometry": {"name": "llama-3.1-8b"}}
    for key, value in (("checkpoint", "predictor/checkpoints/smollm2_t8p8.pt"), ("block_sizes", [16, 32]),
                       ("streaming_threshold", 0.8), ("skip_streaming", False)):
        with pytest.raises(ConfigError, match=rf"selection.{key}: read only by selection.name 'predicted'"):
            config_from_dict({**base, "selection": {"name": "fixed", key: value}})
        variant = {"name": "v", "selection": {"name": "full", key: value}}
        with pytest.raises(ConfigError, match=rf"experiment.variants\[0\].selection.{key}: read only by"):
            config_from_dict({**base, "experiment": {"variants": [variant]}})
    assert config_from_dict({**base, "selection": {"name": "predicted", "streaming_threshold": 0.8}})
    with pytest.raises(ConfigError, match="selection.streaming_heads: not read by the 'predicted' selection"):
        config_from_dict({**base, "selection": {"name": "predicted", "streaming_heads": {0: [1]}}})
    # Inherited by a variant that reads them: allowed.
    cfg = config_from_dict({**base, "selection": {"name": "fixed", "streaming_heads": {0: [1]}},
                            "experiment": {"variants": [{"name": "full", "selection": {"name": "full"}}]}})
    assert cfg.experiment.variants[0].selection.streaming_heads == {0: (1,)}


def test_budget_and_block_size_are_refused_where_no_selection_reads_them():
    base = {"geometry": {"name": "llama-3.1-8b"}}
    for name in ("full", "streaming", "predicted", "nosa", "evosparse"):
        with pytest.raises(ConfigError, match=r"selection.budget: read only by selection.name 'fixed'"):
            config_from_dict({**base, "selection": {"name": name, "budget": 0.1}})
    for name in ("streaming", "predicted"):
        with pytest.raises(ConfigError, match=r"selection.block_size: read only by selection.name 'fixed' or 'full'"):
            config_from_dict({**base, "selection": {"name": name, "block_size": 32}})
    assert config_from_dict({**base, "selection": {"name": "full", "block_size": 32}}).selection.block_size == 32
    # Read by one selection in use: allowed at the top level; a variant of another name may not set its own.
    cfg = config_from_dict({**base, "selection": {"name": "fixed", "budget": 0.1},
                            "experiment": {"variants": [{"name": "full", "selection": {"name": "full"}}]}})
    assert cfg.experiment.variants[0].selection.budget == 0.1
    with pytest.raises(ConfigError, match=r"experiment.variants\[0\].selection.budget: read only by selection.name 'fixed' "
                                          r"\(this variant's is 'streaming'\)"):
        config_from_dict({**base, "experiment": {"variants": [{"name": "s", "selection": {"name": "streaming",
                                                                                           "budget": 0.2}}]}})


def test_gpu_share_is_refused_where_no_static_placement_reads_it():
    base = {"geometry": {"name": "llama-3.1-8b"}}
    for placement in ("fluxion", "cpu_only", "gpu_only"):
        with pytest.raises(ConfigError, match=r"scheduler.gpu_share: 0.3 is read only by the static placements "
                                              r"'uniform' or 'length'"):
            config_from_dict({**base, "scheduler": {"placement": placement, "gpu_share": 0.3}})
    assert config_from_dict({**base, "scheduler": {"placement": "length", "gpu_share": 0.3}}).scheduler.gpu_share == 0.3
    # A variant with a static placement reads the top-level share.
    cfg = config_from_dict({**base, "scheduler": {"placement": "fluxion", "gpu_share": 0.3},
                            "experiment": {"variants": [{"name": "u", "placement": "uniform"}]}})
    assert cfg.scheduler.gpu_share == 0.3


def test_a_variant_cannot_switch_to_an_executor_of_its_own():
    """NOSA and EvoSparse select in the GPU lane's executor for the whole runtime: a variant naming
    one under another top-level selection would run the config planner under that label."""
    for name in ("nosa", "evosparse"):
        with pytest.raises(ConfigError, match=rf"experiment.variants\[0\].selection.name: '{name}' selects"):
            config_from_dict({"geometry": {"name": "llama-3.1-8b"},
                              "experiment": {"variants": [{"name": "v", "selection": {"name": name}}]}})
