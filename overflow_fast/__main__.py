"""``python -m overflow_fast report RUN.jsonl [--png OUT.png]`` (see ``overflow_fast.cli``)."""

import sys

from .cli import main

sys.exit(main())
