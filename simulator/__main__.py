"""python -m simulator: the same as `baton sim`."""

import sys

from simulator.report import main

sys.exit(main())
