"""Getting a model onto the machines: which process is which (distributed), the model and tokenizer (models), their
weights read shard by shard (weights), LoRA adapters (adapters), the compute precision (precision), and parallelism
applied to a model as functions (placement)."""
