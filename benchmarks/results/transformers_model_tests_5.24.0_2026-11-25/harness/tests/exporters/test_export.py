# STUB: the real tests/exporters/test_export.py is not in the transformers sdist.
class ExportTesterMixin:
    pass
