"""The GPU check (``nox -s gpu``), its set-up rows and its offline bundle: not benchmarks, a check of packfree's CUDA
routes against stock transformers on a CUDA machine (docs/gpu-check.md)."""
