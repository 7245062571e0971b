"""What a training step computes, as tensors in and tensors out: the tokenized examples it reads (examples), model
inputs from them (layouts), the float32 log-probs of a model on them (scoring, logprobs), the losses and the
objective that combines them (losses, objective), the step's objective on a micro-batch and what a loss reads of the
whole batch (step), the optimizer (optim), evaluation and sampling (evaluation), and the reward of iterative rounds
(rewards). No file is written here."""
