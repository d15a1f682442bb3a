"""Where minisgl keeps what it converts once (the embedded model's folder, GGUF files turned
into HF folders, packed weights): `$MINISGL_CACHE_DIR`, else the user's cache dir."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    env = os.environ.get("MINISGL_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("minisgl"))
