"""The request/step runtime: one object (`Runtime`) drives the steps of the offline API, the
python engine worker and the rust_service GPU worker."""

from minisgl.runtime.loop import StepBatch, StepLoop
from minisgl.runtime.runtime import Runtime, warms_up_by_default

__all__ = ["Runtime", "StepBatch", "StepLoop", "warms_up_by_default"]
