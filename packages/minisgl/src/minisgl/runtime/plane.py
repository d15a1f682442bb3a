"""What the `Runtime` asks of a control plane: the scheduler in this process (`LocalPlane`)
or the Rust service (`ServicePlane`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from minisgl.core import SamplingParams
from minisgl.runtime.loop import StepBatch


class ControlPlane(Protocol):
    def add(
        self,
        rid: int,
        input_ids: Sequence[int] | np.ndarray,
        params: SamplingParams,
        generator: Any,
        leader: int | None,
    ) -> None: ...
    def abort(self, rid: int) -> None: ...
    def finish(self, rid: int, reason: str) -> None: ...
    def has_work(self) -> bool: ...
    def step(self) -> StepBatch: ...
    def drain(self, fail: bool = False) -> list[StepBatch]: ...
    def fail_all(self) -> list[int]: ...
    def close(self) -> None: ...
