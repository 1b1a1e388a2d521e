"""python -m fmha.bench: see fmha/bench/cli.py."""

import sys

from .cli import main

sys.exit(main())
