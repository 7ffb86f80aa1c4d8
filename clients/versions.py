"""Rolling out numbered versions of the glm model from Python: the API behind scripts/glm_versions.py, which lives
with the operator's tools (glm_tools/versions.py, where the docs are)."""

from glm_tools.versions import VersionError, VersionManager, VersionStatus

__all__ = ["VersionError", "VersionManager", "VersionStatus"]
