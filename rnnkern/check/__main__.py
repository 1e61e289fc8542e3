"""``python -m rnnkern.check``: the field self-check (see :mod:`rnnkern.check`)."""
import sys

from .cli import main

sys.exit(main())
