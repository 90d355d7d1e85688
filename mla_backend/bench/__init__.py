"""The benchmark `python -m mla_backend bench` runs, shipped with the package (research tools stay in the
source tree's benchmarks/ folder)."""
