#!/usr/bin/env python3
"""Train the demo GLM-4 on local text: glm_tools/train_demo.py (`--help` for the options)."""

import sys

from glm_tools.train_demo import main

if __name__ == "__main__":
    sys.exit(main())
