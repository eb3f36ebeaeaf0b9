"""Benchmarks: the project's figures beside megatron-core's, measured in the same run.

``python -m benchmarks`` runs every ``benchmarks/bench_*.py`` in turn; each is also runnable
alone (``python -m benchmarks.bench_init``). Every module has ``main(argv) -> int``.
"""
