"""Judging: which of two completions is better, and what that says of a model. Judges behind one Protocol (judges),
the rewards they and iterative rounds read (rewards), win rates with their intervals and the sampled KL (winrates),
the trainer's evaluation on held-out batches with its win rate against the reference (held_out), and evaluate.py's
candidates, sweeps and reference resolved from what a user names (candidates). No file is written here."""
