from __future__ import annotations

from cardgate.cli import main

raise SystemExit(main())
