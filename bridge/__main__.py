"""``python -m bridge``: the ``bridge`` command (what ``torchrun -m bridge train ...`` runs on each rank)."""
import sys

from .cli import main

sys.exit(main())
