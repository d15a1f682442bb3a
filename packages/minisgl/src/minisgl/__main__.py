"""`python -m minisgl ...`: the OpenAI-compatible server (see `minisgl.server.launch`)."""

import sys

from minisgl.server.launch import main

if __name__ == "__main__":
    sys.exit(main())
