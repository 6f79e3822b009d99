"""Stands in for transformers' tests/utils/test_configuration_utils.py (not in the sdist): ``ConfigTester`` imports
``config_common_kwargs`` from it. The values are those of transformers 5.x (generation fields no longer live on
model configs)."""

config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["BertModel"],
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "problem_type": "regression",
}
