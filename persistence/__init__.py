"""What a run writes and reads back: the writing helpers every file goes through (storage), checkpoints (checkpoint),
the run directory's lock (run_lock), and the caches of tokenized examples (tokenized) and reference log-probs
(reference_cache)."""
