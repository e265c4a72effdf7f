"""``python -m pytest_modelpatch``: the ``modelpatch`` command line."""

import sys

from pytest_modelpatch.cli import main

sys.exit(main())
