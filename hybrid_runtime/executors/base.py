"""The executor protocol: something that runs a list of tasks against a step's buffers."""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from hybrid_runtime.tasks import Step, Task


@runtime_checkable
class Executor(Protocol):
    device: str  # "cpu" or "gpu"
    bytes_read: int  # total bytes of metadata and KV read since creation

    def run(self, tasks: Sequence[Task], step: Step) -> None:
        """Run `tasks`, writing each task's `out, lse` rows into `step`; set `task.bytes_read`."""
        ...
