import sys

from deltastore.cli import main

sys.exit(main())
