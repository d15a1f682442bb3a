"""Errors of a tensor-parallel group."""


class RankFailed(RuntimeError):
    """A tensor-parallel rank died or failed: the engine cannot run another step."""
