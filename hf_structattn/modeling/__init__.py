"""The checkpoint payload: every file a saved model needs (copied next to the weights by save_pretrained).

Rules (DESIGN.md §3): flat folder, ``from .sibling import name`` imports only, torch/transformers only,
no classes defined here.
"""
