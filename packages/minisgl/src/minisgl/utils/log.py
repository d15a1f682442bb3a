from __future__ import annotations

import logging
import os


def get_logger(name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    if not logging.getLogger("minisgl").handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s %(name)s %(levelname)s] %(message)s"))
        root = logging.getLogger("minisgl")
        root.addHandler(handler)
        root.setLevel(os.environ.get("MINISGL_LOG_LEVEL", "WARNING").upper())
    return logger
