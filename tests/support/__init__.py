"""Helpers shared by the tests (pytest puts tests/ on the import path, so `import support` finds this package):
tiny checkpoints made by transformers (checkpoints), the engine against transformers (reference), reading a running
server (server), and the C kernels or a skip (kernels)."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
