import sys

from sidecar.cli.dispatch import main

sys.exit(main())
