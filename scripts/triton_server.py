#!/usr/bin/env python3
"""Run tritonserver on this repository's models: glm_tools/supervisor.py (`--help` for the options)."""

import sys

from glm_tools.supervisor import main

if __name__ == "__main__":
    sys.exit(main())
