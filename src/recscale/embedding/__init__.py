"""Embedding storage, the fused lookup kernel and the fused sparse optimizers. Import the
module you need: this package imports nothing itself, so the tables' arithmetic
(``sizing``, ``compression_shapes``) loads without torch (``recscale plan`` does)."""
