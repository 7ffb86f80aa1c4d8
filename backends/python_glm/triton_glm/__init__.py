"""Thin Triton adapters over glm_engine: tensors in and out, errors as responses, nothing else."""
