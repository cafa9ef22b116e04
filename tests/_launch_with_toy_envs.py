"""`recursa.cli` with the test suite's toy envs registered, for runs launched in a subprocess
(tests/test_ddp.py starts it under torchrun). Not a test module."""

import sys

import conftest  # noqa: F401  registers toy-digits and toy-corridor

from recursa.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
