"""Benchmark stock `generate` against MARS decoding side by side (same as `mars-hf bench`).

python examples/bench.py --batch-sizes 1 --taus 1.0,0.9 --schemes stock,cursor
python examples/bench.py --model synthetic --batch-sizes 1,8 --taus 0.9 --windows 4
"""

import argparse
import sys

from mars_hf.commands import bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=bench.HELP)
    bench.add_arguments(parser)
    sys.exit(bench.run(parser.parse_args()))
