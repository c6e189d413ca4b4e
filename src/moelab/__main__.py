"""``python -m moelab`` is the ``moelab`` command."""

import sys

from .cli import main

sys.exit(main())
