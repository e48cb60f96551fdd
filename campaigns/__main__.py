"""``python -m campaigns all ...``: run several campaigns, write the table (campaigns.report)."""

import sys

from campaigns.report import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["all"]:
        argv = argv[1:]
    sys.exit(main(argv))
