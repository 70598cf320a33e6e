"""``python -m overflow_fast report RUN.jsonl [--png OUT.png]``, ``python -m overflow_fast info``
(see ``overflow_fast.cli``)."""

import sys

from .cli import main

sys.exit(main())
