"""The one compiled part: the native CPU kernels (see src/recscale/native/__init__.py).

``optional=True``: without a working C compiler the install still succeeds and the
kernels fall back to numba/torch. Everything else about the package is in pyproject.toml.
"""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "recscale.native._kernels",
            sources=[
                "src/recscale/native/dot_interaction.c",
                "src/recscale/native/embedding_lookup.c",
                "src/recscale/native/sparse_update.c",
                "src/recscale/native/weight_grad.c",
                "src/recscale/native/weight_grad_bf16.c",
                "src/recscale/native/weight_grad_amx.c",
                "src/recscale/native/input_grad_amx.c",
                "src/recscale/native/narrow_layer.c",
                "src/recscale/native/dot_interaction_avx512.c",
                "src/recscale/native/dot_interaction_narrow.c",
                "src/recscale/native/dot_interaction_bf16.c",
                "src/recscale/native/dot_interaction_amx.c",
                "src/recscale/native/logit.c",
                "src/recscale/native/small_layers_bf16.c",
                "src/recscale/native/dense_sgd.c",
                "src/recscale/native/team.c",
                "src/recscale/native/cpu_features.c",
                "src/recscale/native/unique_ids.c",
                "src/recscale/native/row_io.c",
                "src/recscale/native/row_uring.c",
                "src/recscale/native/row_direct.c",
                "src/recscale/native/cache_index.c",
            ],
            # headers: a change to one rebuilds the extension (and ships them in an sdist)
            depends=[
                "src/recscale/native/recscale_native.h",
                "src/recscale/native/amx_tiles.h",
                "src/recscale/native/bf16_bits.h",
                "src/recscale/native/row_format.h",
                "src/recscale/native/weight_grad_driver.h",
                "src/recscale/native/weight_grad_tile.h",
            ],
            # dlopen/dlsym (team.c): in libc itself since glibc 2.34, in libdl before
            libraries=["dl"] if sys.platform.startswith("linux") else [],
            extra_compile_args=["-O3", "-std=c11"],
            optional=True,
        )
    ]
)
