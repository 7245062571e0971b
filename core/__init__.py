"""What a training step computes, as tensors in and tensors out: model inputs from tokenized pairs (layouts), the
float32 log-probs of a model on them (scoring, logprobs), the losses and the objective that combines them (losses,
objective), the optimizer (optim), evaluation and sampling (evaluation), and the reward of iterative rounds (rewards).
No file is written here."""
