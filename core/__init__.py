"""What a training step computes, as tensors in and tensors out: the tokenized examples it reads (examples), model
inputs from them (layouts; their attention masks and spans: attention; a vision-language model's image inputs:
image_inputs), the float32 log-probs or rewards of a model on them (heads, logprobs) as the run's Scorer decided them
(scoring), checked by the probes (probes), the losses, what they share and the objective that combines them
(losses, loss_contract, objective), the step's objective on a micro-batch and what a loss reads of the
whole batch (step), a mixture of experts' router loss (router_loss), Liger's kernels (liger) and the optimizer
(optim). Generating completions is generation/'s, judging them judging/'s. No file is written here."""
