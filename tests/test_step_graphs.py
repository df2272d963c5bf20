"""Bookkeeping of the graphs of whole GPU-only steps (hybrid_runtime/step_graphs.py) on fakes: when a
step goes through a graph, and when a graph is dropped. Capturing and replaying them runs on CUDA
only (tests/test_asynctls.py::test_express_steps_give_the_general_paths_outputs, `gpu` marker)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hybrid_runtime.step_graphs import StepGraphs, _StepGraph


class FakeWindows:
    def __init__(self):
        self.entries: dict = {}

    def entry(self, layer, b):
        return self.entries.get((layer, b))


def graphs(max_graphs: int = 2) -> tuple[StepGraphs, FakeWindows]:
    windows = FakeWindows()
    return StepGraphs(windows, merge=None, device=torch.device("cpu"), max_graphs=max_graphs, max_tasks=4), windows


def test_a_task_set_goes_through_a_graph_from_its_second_step_once_its_window_is_captured():
    sg, windows = graphs()
    packed = object()
    key = sg.key(0, 2, packed, None, torch.float32, (True, False, True, True))
    assert not sg.wants(key, 0, 2)  # no window entry yet
    windows.entries[(0, 2)] = SimpleNamespace(graph=None)
    assert not sg.wants(key, 0, 2)  # its window graph is not captured yet
    windows.entries[(0, 2)] = SimpleNamespace(graph="captured")
    assert not sg.wants(key, 0, 2)  # first step: marked, launched part by part
    assert sg.wants(key, 0, 2)  # second: captured now
    sg.capture_error = "RuntimeError: no"
    assert not sg.wants(key, 0, 2)  # a failed capture turns graphs off


def test_a_graph_whose_window_entry_was_replaced_is_dropped_and_its_claim_retired():
    sg, windows = graphs()
    window = windows.entries[(1, 4)] = SimpleNamespace(graph="captured")
    key = sg.key(1, 4, object(), None, torch.float32, ())
    waited = []
    last = SimpleNamespace(bytes_read=None, wait=lambda: waited.append(1))
    slot = sg._free.pop()
    sg._graphs[key] = _StepGraph(None, window, None, None, None, slot, sg._counts[slot].view(3, 4), last)
    assert sg.wants(key, 1, 4) and len(sg) == 1
    windows.entries[(1, 4)] = SimpleNamespace(graph="captured")  # the window graphs dropped and remade it
    assert sg.wants(key, 1, 4) is False  # dropped (and this key counts as seen once more)
    assert len(sg) == 0 and waited == [1] and slot in sg._free
    sg.clear()
    assert not sg._seen
