"""The step contract between the layers: what one step is and how it reaches a device.

`plan`: `StepPlan` (one step's batch metadata, a frozen flat layout) and its builders, made by
the scheduler (Python or the Rust core, which mirrors the layout). `staging`: `DevicePlan` (a
plan's arrays on the device), `InputFill` (the in-flight tokens an overlapped step fills on
the device) and `PlanStager` (one pinned, double-buffered copy a step). The engine runs plans,
the attention backends read them; none of them imports the others for it. This package
imports nothing of minisgl's.
"""
