"""C kernels for the CPU, built on first use (`build`): the small ops (`cpu_ops`), GGML block
products (`ggml`) and the fused decoder layer that calls both (`cpu_layer.c`)."""
