"""``eager_torch``: a training backend plugged in from outside dualrl's packages.

It proves that a backend is a plug-in: core names it nowhere; it is registered by a package
entry point in group ``dualrl.backends`` (:mod:`tests.plugin_backend.site` writes the
``*.dist-info`` that declares it); :mod:`tests.plugin_backend.spec` is its spec and
:mod:`tests.plugin_backend.worker` its worker: one process, an unsharded eager torch module.
docs/extending.md walks through both files.
"""
