"""The ``sncaffe`` command: the process environment the command line wants (config.py), set
before NumPy and the BLAS load, then the command line itself."""
import os

from . import config


def main(argv=None):
    for name, value in config.process_environment().items():
        os.environ.setdefault(name, value)
    from .cli import main as cli_main
    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
