"""LoRA adapters: PEFT folders read and checked (`adapter`), kept in host memory by the engine core
(`store`), and applied per row on a worker's layers (`manager`, `layers`, `batch`)."""
