# STUB: the real tests/generation/test_utils.py is not in the transformers sdist.
class GenerationTesterMixin:
    pass
