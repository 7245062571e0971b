"""Getting a model onto the machines: which process is which (distributed), where a model's files are (model_dirs),
the model (models) and its tokenizer (tokenizers), a reward model's head (reward_head), weights read shard by shard
(weights), LoRA adapters (adapters), the compute precision (precision), and parallelism applied to a model as
functions (placement)."""
