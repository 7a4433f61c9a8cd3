"""`python scripts/chaos ...`: the package's folder is on the path, not scripts/."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chaos.cli import main

sys.exit(main(sys.argv[1:]))
