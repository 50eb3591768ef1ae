"""What every layer may use: environment variables, cache paths, logging, dtypes.

Nothing here imports another ``rbln_ray`` package (it is the bottom of the layer order in
docs/ARCHITECTURE.md), so any layer can depend on it.
"""
