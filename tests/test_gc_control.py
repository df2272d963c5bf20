"""The runtime's collector freeze: objects alive at start leave the collector's walks until the
last runtime closes."""

import gc

from hybrid_runtime.gc_control import freeze_collector, thaw_collector
from tests.helpers import small_config


def test_freeze_is_counted_and_the_last_thaw_unfreezes():
    assert gc.get_freeze_count() == 0
    marker = [object()]  # a tracked container alive at the freeze
    assert freeze_collector() > 0
    assert gc.get_freeze_count() > 0 and not gc.is_finalized(marker)
    assert all(o is not marker for o in gc.get_objects(generation=2))  # frozen: not walked
    freeze_collector()
    thaw_collector()
    assert gc.get_freeze_count() > 0  # one holder left
    thaw_collector()
    assert gc.get_freeze_count() == 0
    thaw_collector()  # unpaired: no effect
    assert gc.get_freeze_count() == 0


def test_runtime_freezes_at_start_and_thaws_at_close():
    from hybrid_runtime.config import config_from_dict
    from hybrid_runtime.runtime import HybridRuntime

    cfg = small_config()
    with HybridRuntime(cfg) as rt:
        assert gc.get_freeze_count() > 0
        assert rt._froze_gc
    assert gc.get_freeze_count() == 0
    off = config_from_dict({**_as_dict(cfg), "scheduler": {"gc_freeze": False}})
    with HybridRuntime(off):
        assert gc.get_freeze_count() == 0


def _as_dict(cfg):
    import dataclasses

    d = dataclasses.asdict(cfg)
    return {"geometry": d["geometry"], "kv_cache": d["kv_cache"]}
