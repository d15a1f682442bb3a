"""Tensor parallelism on torch.distributed: the rank layout (`layout`), the forward's
collectives (`comm`), the rank processes (`ranks`, `follower`)."""

from minisgl.distributed.errors import RankFailed
from minisgl.distributed.layout import TPInfo, check_tp, dist_backend

__all__ = ["RankFailed", "TPInfo", "check_tp", "dist_backend"]
