import sys

from facepipe.cli import main

sys.exit(main())
