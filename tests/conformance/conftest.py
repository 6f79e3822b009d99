"""Conformance suite (issue 26): transformers' own ModelTesterMixin / ConfigTester, taken from the installed
version's sdist (``upstream.py``), plus our GenerationTesterMixin, run on every hf_structattn family and on stock
controls."""

import re

import pytest

# our stand-ins for the sdist's missing modules are imported as part of the upstream package, never collected
collect_ignore = ["upstream_support"]

UPSTREAM_MARKERS = ("generate", "torch_compile_test", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test",
                    "accelerate_tests")


# transformers' own tests that are slow on CPU and add little there: eager vs SDPA in half precision (16 of its 25
# cases; the fp32 ones run by default). With the stock controls and the two long compile tests (marked where they
# are defined) they form the ``slow`` part, which keeps the default suite under 15 minutes on the 2-core machine.
SLOW_UPSTREAM_TESTS = re.compile(r"^test_eager_matches_sdpa_inference_\d+_(fp16|bf16)_")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "conformance" in item.nodeid and SLOW_UPSTREAM_TESTS.match(item.name):
            item.add_marker(pytest.mark.slow)


def pytest_configure(config):
    for marker in UPSTREAM_MARKERS:
        config.addinivalue_line("markers", f"{marker}: transformers' own test marker (conformance suite)")


@pytest.fixture(autouse=True, scope="module")
def _plugin_classes_in_transformers_name_tables():
    from .testers import auto_registrations_in_name_tables

    with auto_registrations_in_name_tables():
        yield
