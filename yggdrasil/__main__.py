"""`python -m yggdrasil ...`: the `yggdrasil` command, as the console script runs it.

The CLI is a layer above this package (yggdrasil.cli, cli/ in a checkout), and yggdrasil/ imports
nothing above it; so this finds the command where pyproject binds it, [project.scripts], in the
installed distribution's metadata, as the console script's wrapper does. Commands recorded as
`python -m yggdrasil ...` (bench results) keep running; `python -m yggdrasil.cli` needs no metadata.
"""

import sys
from importlib.metadata import entry_points


def main() -> int:
    commands = entry_points(group="console_scripts", name="yggdrasil")
    if not commands:
        print("error: `python -m yggdrasil` runs the installed `yggdrasil` command, and no installed "
              "distribution names one; install the checkout (pip install -e .) or run `python -m yggdrasil.cli`",
              file=sys.stderr)
        return 2
    return next(iter(commands)).load()()


sys.exit(main())
