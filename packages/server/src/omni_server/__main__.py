"""``python -m omni_server`` is ``omni-server``."""

import sys

from omni_server.cli import main

sys.exit(main())
