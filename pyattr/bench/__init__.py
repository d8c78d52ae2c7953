"""Benchmarks: kernel microbenchmarks (:mod:`pyattr.bench.micro`) and the end-to-end
relevance run (:mod:`pyattr.bench.e2e`); ``pyattr bench`` on the command line."""
