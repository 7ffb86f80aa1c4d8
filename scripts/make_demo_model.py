#!/usr/bin/env python3
"""Build the demo GLM-4 checkpoint: glm_tools/demo_model.py (`--help` for the options)."""

import sys

from glm_tools.demo_model import main

if __name__ == "__main__":
    sys.exit(main())
