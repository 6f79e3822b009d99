"""The checkpoint payload: every file a saved model needs (copied next to the weights by save_pretrained).

Rules (what transformers' remote-code loader supports): flat folder, ``from .sibling import name`` imports only, torch/transformers only,
no classes defined here.
"""

# The installed package runs stock models loaded with attn_implementation="mlr" too: the decoder spec registers how
# their layers get a geometry (``structattn_install.STOCK_GEOMETRY_RESOLVERS``). A checkpoint's remote code does not
# run this file; it registers the spec only where it ships it (MLR<Arch> checkpoints).
from .structattn_decoder_spec import stock_layer_geometry  # noqa: F401
