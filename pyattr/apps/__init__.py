"""Applications over the methods: explain (text and images), rendering, patching reports,
dataset runs (``pyattr.run``)."""
