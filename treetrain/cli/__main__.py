"""``python -m treetrain.cli``: what trainer pods run (``torchrun -m treetrain.cli train CONFIG``)."""

import sys

from treetrain.cli import main

sys.exit(main())
