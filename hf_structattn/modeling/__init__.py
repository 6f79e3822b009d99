"""The checkpoint payload: every file a saved model needs (copied next to the weights by save_pretrained).

Rules (what transformers' remote-code loader supports): flat folder, ``from .sibling import name`` imports only, torch/transformers only,
no classes defined here.
"""
