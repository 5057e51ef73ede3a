import sys

from pagellm.cli.main import main

sys.exit(main())
