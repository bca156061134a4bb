"""How a model is spread over the workers, applied from outside the model: `mesh` (where each
rank sits), `parallel` (DDP, FSDP2, HSDP), `tensor_parallel`, `recompute` (activation
checkpointing), `collectives` (the loop's few collectives, the gloo interface)."""
