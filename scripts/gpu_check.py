#!/usr/bin/env python3
"""The check to run on a GPU machine: glm_tools/gpu_check.py (`--help` for the options)."""

import sys

from glm_tools.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
