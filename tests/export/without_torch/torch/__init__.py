# Stands in for PyTorch where a test runs as if python3-torch were not installed
# (export_pytorch_*_without_torch in tests/export.cmake puts this folder first on PYTHONPATH):
# importing it fails as a missing module does.
raise ModuleNotFoundError("No module named 'torch' (hidden by tests/export/without_torch)")
