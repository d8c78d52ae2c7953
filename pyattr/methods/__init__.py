"""The attribution methods: :func:`relevance`, :func:`layer_relevance`,
:func:`integrated_gradients` and :func:`capture`, each over the one pass in
:mod:`pyattr.methods._core` (the public names are also at the package root, ``pyattr.*``)."""
