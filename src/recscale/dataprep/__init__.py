"""The write side of datasets: ``recscale data preprocess`` (Criteo TSV / Parquet ->
binary columns), ``data multihot`` (one-hot -> multi-hot), id counting, and the
synthetic Criteo TSV writer. The read side (columns, loaders, batches) is
``recscale.data``; nothing there imports this package."""
