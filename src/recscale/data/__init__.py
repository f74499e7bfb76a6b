"""Batches and where they come from: ``batch`` (the jagged batch type), ``synthetic``,
``dataset`` (a preprocessed dataset), ``prefetch``. Import the module you need: this
package imports nothing itself, so its torch-free parts (``columns``, ``zipf_law``) load
without torch (``recscale plan`` does)."""
