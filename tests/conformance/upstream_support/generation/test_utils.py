"""Stands in for transformers' tests/generation/test_utils.py (not in the sdist): ``test_modeling_common`` imports
``GenerationTesterMixin`` from here. The mixin is ours: tests/conformance/generation_tester.py."""

from conformance.generation_tester import GenerationTesterMixin

__all__ = ["GenerationTesterMixin"]
