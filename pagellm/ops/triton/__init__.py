"""Triton kernels (GPU; the CPU runs them under Triton's interpreter in tests): the small ops of a
decoder layer, paged attention, and the quantized and one-row matrix products. Importing any of
these modules imports Triton, which is optional: callers import them only when a Triton
implementation runs (`pagellm.ops.dispatch`)."""
