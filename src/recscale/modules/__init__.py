"""Single-device building blocks. Nothing here knows about sharding. Import the module
you need (``embedding_bag_collection``, ``interaction``, ``mlp``, ``dcn``): this package
imports nothing itself, so ``interaction_padding`` loads without torch."""
