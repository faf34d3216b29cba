"""The MARS quickstart as a script (same as `mars-hf quickstart`).

python examples/quickstart.py                      # embedded SmolLM2-135M-Instruct, ~30 min on 2 CPU cores
python examples/quickstart.py --budget-minutes 5   # shorter training
python examples/quickstart.py --help
"""

import argparse
import sys

from mars_hf.commands import quickstart

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=quickstart.HELP)
    quickstart.add_arguments(parser)
    sys.exit(quickstart.run(parser.parse_args()))
