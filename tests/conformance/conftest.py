"""Conformance suite (issue 26): transformers' own ModelTesterMixin / ConfigTester, taken from the installed
version's sdist (``upstream.py``), plus our GenerationTesterMixin, run on every hf_structattn family and on stock
controls."""

import pytest

# our stand-ins for the sdist's missing modules are imported as part of the upstream package, never collected
collect_ignore = ["upstream_support"]

UPSTREAM_MARKERS = ("generate", "torch_compile_test", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test",
                    "accelerate_tests")


def pytest_configure(config):
    for marker in UPSTREAM_MARKERS:
        config.addinivalue_line("markers", f"{marker}: transformers' own test marker (conformance suite)")


@pytest.fixture(autouse=True, scope="module")
def _plugin_classes_in_transformers_name_tables():
    from .testers import auto_registrations_in_name_tables

    with auto_registrations_in_name_tables():
        yield
