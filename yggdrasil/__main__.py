import sys

from yggdrasil.cli import main

sys.exit(main())
