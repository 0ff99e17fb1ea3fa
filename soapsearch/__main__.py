import sys

from soapsearch.cli import main

sys.exit(main())
