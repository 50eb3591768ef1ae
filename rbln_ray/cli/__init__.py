"""The ``rbln-ray`` command line: serve, compile, devices, build-model."""
