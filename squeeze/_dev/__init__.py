"""Development tools over squeeze's own source (no runtime code imports them): the import graph, shared by
the layering test (tests/test_import_layers.py) and the house metrics (scripts/dev/house_metrics.py)."""
