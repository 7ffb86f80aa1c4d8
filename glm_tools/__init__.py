"""Tools around the engine: the tritonserver launcher, the demo checkpoint builder and the GPU check.
scripts/ holds their command lines; tests and benchmarks import them from here."""
