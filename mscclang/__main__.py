"""``python3 -m mscclang ...`` is the ``mscclang`` command."""

import sys

from mscclang.cli.main import main

sys.exit(main())
