"""Another commit's engine, imported beside this one, or its whole tree, so that a benchmark can time both side by
side in one run."""

from __future__ import annotations

import importlib
import importlib.util
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_PATH = "backends/python_glm/glm_engine"


def engine_at(commit: str) -> types.ModuleType:
    """The glm_engine package of a git commit, as a package of its own (glm_engine_<commit>): its modules are
    imported with importlib.import_module(f"{package.__name__}.sampler") and so on."""
    name = f"glm_engine_{commit}"
    if name in sys.modules:
        return sys.modules[name]
    directory = os.path.join(tree_at(commit, ENGINE_PATH), ENGINE_PATH)
    spec = importlib.util.spec_from_file_location(name, os.path.join(directory, "__init__.py"),
                                                  submodule_search_locations=[directory])
    sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def tree_at(commit: str, *paths: str) -> str:
    """A new temporary directory holding the repository's files (or those under `paths`) as of a git commit."""
    archive = subprocess.run(["git", "archive", commit, *paths], cwd=REPO, check=True, capture_output=True).stdout
    root = tempfile.mkdtemp(prefix=f"tree-{commit}-")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    return root
