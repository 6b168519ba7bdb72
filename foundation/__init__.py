"""The floor of qvl: family records, the patch registry, the CPU / no-TE runtime, errors, layout check, cost model."""

# The one list of qvl's folders (each installed as `qvl.<folder>`, pyproject's package-dir) and their layers:
# imports point down only (tests/test_layers.py); the launch packager ships these folders.
LAYERS: dict[str, int] = {
    "foundation": 0,
    "kernels": 1,
    "bridges": 2,
    "data": 2,
    "recipes": 3,
    "training": 4,
    "launchers": 5,
}
FOLDERS: tuple[str, ...] = tuple(LAYERS)
